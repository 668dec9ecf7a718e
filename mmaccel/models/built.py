"""Built zoo models: composed at load time from other zoo entries plus small trained weights committed here.

A built entry names its parts (zoo names, fetched on first use), the function that composes them, and the trained
piece that joins them (for ``smol-llava``: a 0.55 M-parameter LLaVA projector and LoRA adapters of the LM, a 6 MB
bf16 safetensors file under ``assets/models/NAME/``). ``mmaccel.load(NAME)`` fetches the parts, composes the model and
loads the trained piece; ``mmaccel zoo train NAME`` trains that piece. Until it is trained, loading fails with one
error naming that command.
"""
from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .paths import resolve_checkpoint

logger = logging.getLogger(__name__)


class NotTrainedError(FileNotFoundError):
    """A built zoo model's trained weights are missing; the message names the command that trains them."""


@dataclass(frozen=True)
class BuiltEntry:
    """A zoo model composed from other zoo models and a trained piece.

    Attributes
    ----------
    name : str
        Zoo name (``"smol-llava"``).
    description : str
        One line for ``mmaccel zoo list``.
    parts : tuple of (str, str)
        ``(role, zoo name)`` pairs, e.g. ``(("vision", "dinov2-small"), ("language", "smollm2-135m"))``.
    weights : str
        File name of the trained piece inside ``assets/models/NAME/`` (default: the LLaVA projector file; the
        builder and processor default to :mod:`mmaccel.models.smol_llava`'s composition).
    builder : str
        ``"module:function"`` taking one ``ROLE_dir`` keyword per part (``vision_dir``, ``language_dir``) and
        ``projector``, ``dtype``, ``attn_implementation``; it returns ``(model, processor)``.
    processor : str
        ``"module:function"`` taking the same ``ROLE_dir`` keywords and ``projector``; it returns the processor
        alone, in seconds (no weights are loaded).
    trainer : str
        ``"module:function"`` that trains the piece (``mmaccel zoo train NAME``): ``(out_dir, *, steps, batch_size,
        lr, threads, device, ...)`` returning a summary dict with ``steps_done``, ``wall_time_s`` and ``eval``.
    license : str
        Of the trained piece (the parts keep theirs).
    """

    name: str
    description: str
    parts: tuple
    trainer: str
    weights: str = "projector.safetensors"
    builder: str = "mmaccel.models.smol_llava:build_llava"
    processor: str = "mmaccel.models.smol_llava:build_processor"
    license: str = "Apache-2.0"

    def train_command(self) -> str:
        """The shell command that trains the piece (named in error messages)."""
        return f"mmaccel zoo train {self.name}"


BUILT: dict[str, BuiltEntry] = {
    "smol-llava": BuiltEntry(
        name="smol-llava",
        description="LlavaForConditionalGeneration: dinov2-small at 168 px (144 visual tokens) + smollm2-135m, "
                    "joined by a trained 2-layer MLP projector (LLaVA-1.5 style, 0.55 M params) and LoRA "
                    "adapters of the LM (rank 8, merged at load)",
        parts=(("vision", "dinov2-small"), ("language", "smollm2-135m")),
        trainer="mmaccel.zoo.train.smol_llava:train",
    ),
    "micro-llava": BuiltEntry(
        name="micro-llava",
        description="LlavaForConditionalGeneration: dinov2-small at 168 px (144 visual tokens) + micro-lm, joined by "
                    "a trained projector, with LoRA adapters on the LM merged at load (the fallback when smol-llava's "
                    "real LM misses the scene-QA bar)",
        parts=(("vision", "dinov2-small"), ("language", "micro-lm")),
        trainer="mmaccel.zoo.train.smol_llava:train_micro_llava",
    ),
}


def _function(spec: str):
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


def built_path(name: str) -> Path:
    """Folder of a built model's trained piece and card, ``assets/models/NAME``.

    Raises
    ------
    KeyError
        If ``name`` is not a built zoo model.
    """
    from .zoo import assets_dir

    return assets_dir() / BUILT[name].name


def part_fingerprint(path: str | Path) -> str | None:
    """sha256 of a fetched part's ``model.safetensors`` from its cache manifest (``None`` for other checkpoints)."""
    manifest = Path(path) / "mmaccel_manifest.json"
    if not manifest.is_file():
        return None
    files = json.loads(manifest.read_text(encoding="utf-8")).get("files", {})
    return files.get("model.safetensors", {}).get("sha256")


def trained_weights(name: str, weights_dir: str | Path | None = None) -> Path:
    """Path of built model ``name``'s trained piece (in ``weights_dir``, default ``assets/models/NAME``).

    Raises
    ------
    NotTrainedError
        If the file does not exist; the message names ``mmaccel zoo train NAME``.
    """
    entry = BUILT[name]
    folder = Path(weights_dir) if weights_dir is not None else built_path(name)
    weights = folder / entry.weights
    if not weights.is_file():
        parts = " + ".join(part for _, part in entry.parts)
        raise NotTrainedError(
            f"{name} is composed from {parts} and a trained {entry.weights}, which is not trained yet (no {weights}): "
            f"run `{entry.train_command()}` (see {folder / 'README.md'})"
        )
    return weights


def _part_dirs(entry: BuiltEntry, cache_dir) -> dict:
    return {f"{role}_dir": resolve_checkpoint(part, cache_dir=cache_dir) for role, part in entry.parts}


def load_built(name: str, *, weights_dir: str | Path | None = None, cache_dir=None, dtype=None,
               attn_implementation: str | None = None):
    """Compose built zoo model ``name`` from its parts and load its trained piece; the model stays on the CPU.

    Parameters
    ----------
    name : str
        A key of :data:`BUILT`.
    weights_dir : path, optional
        Folder holding the trained piece (default ``assets/models/NAME``).
    cache_dir : path, optional
        Cache of the fetched parts (see :func:`mmaccel.models.fetched.cache_root`).
    dtype : torch.dtype, optional
        Default float32.
    attn_implementation : str, optional
        Default ``"sdpa"``.

    Returns
    -------
    (model, processor)

    Raises
    ------
    NotTrainedError
        If the trained piece is missing: checked first, before any part is fetched or loaded; the message names
        ``mmaccel zoo train NAME``.
    mmaccel.models.ModelLoadError
        If a part cannot be fetched or its cache is corrupted.
    """
    import torch

    from .smol_llava import read_projector_parts

    entry = BUILT[name]
    weights = trained_weights(name, weights_dir)
    dirs = _part_dirs(entry, cache_dir)
    for role, info in read_projector_parts(weights).items():
        now = part_fingerprint(dirs.get(f"{role}_dir", ""))
        if info.get("sha256") and now and now != info["sha256"]:
            logger.warning("%s: the %s part (%s) differs from the one the projector was trained on", name, role,
                           info.get("name"))
    build = _function(entry.builder)
    return build(**dirs, projector=weights, dtype=dtype or torch.float32,
                 attn_implementation=attn_implementation or "sdpa")


def load_built_processor(name: str, *, weights_dir: str | Path | None = None, cache_dir=None):
    """The processor of built model ``name`` without loading any weights. Errors as :func:`load_built`."""
    entry = BUILT[name]
    weights = trained_weights(name, weights_dir)
    return _function(entry.processor)(**_part_dirs(entry, cache_dir), projector=weights)


def list_built() -> list[dict]:
    """One row per built zoo model: name, kind, description, parts, whether trained, size of the trained piece."""
    rows = []
    for name, entry in BUILT.items():
        weights = built_path(name) / entry.weights
        rows.append({
            "name": name,
            "kind": "built",
            "description": entry.description,
            "parts": [part for _, part in entry.parts],
            "trained": weights.is_file(),
            "size_bytes": weights.stat().st_size if weights.is_file() else 0,
            "path": str(weights.parent),
        })
    return rows
