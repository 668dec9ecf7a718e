"""Per-model retrieval-head patterns: which KV heads keep the full cache, as a small JSON file per model.

The pattern format of DuoAttention (Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval
and Streaming Heads", 2024, arXiv 2410.10819) and RazorAttention (Tang et al., "RazorAttention: Efficient KV Cache
Compression Through Retrieval Heads", 2024, arXiv 2407.15891), made GQA-aware: one score per (layer, KV head).

File (``format = "mmaccel-head-pattern/1"``)::

    {"format": ..., "model": "micro-lm",
     "num_layers": 4, "num_kv_heads": 2, "num_attention_heads": 6,
     "fingerprint": {"model_type": "llama", "num_hidden_layers": 4, ...},
     "scores": [[0.91, 0.10], ...],          # [num_layers][num_kv_heads], higher = more retrieval-like
     "retrieval_heads": [[0, 0], [2, 1]],    # (layer, KV head) pairs that keep the full cache
     "found_by": {"finder": "training-free", ...}}

Named patterns live in ``mmaccel/longctx/head_patterns/<name>.json`` (:func:`available_head_patterns`).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..specs import read_shipped_json

logger = logging.getLogger(__name__)

FORMAT = "mmaccel-head-pattern/1"
PATTERN_DIR = Path(__file__).with_name("head_patterns")
_FINGERPRINT_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "hidden_size", "vocab_size")


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def config_fingerprint(config) -> dict:
    """The facts of a model config a head pattern depends on.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        A model config (a VLM's text config is used).

    Returns
    -------
    dict
        ``model_type``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (defaults to the
        query heads), ``head_dim`` (defaults to ``hidden_size // heads``), ``hidden_size``, ``vocab_size``.
    """
    cfg = _text_config(config)
    heads = int(cfg.num_attention_heads)
    out = {k: getattr(cfg, k, None) for k in _FINGERPRINT_KEYS}
    out["num_key_value_heads"] = int(getattr(cfg, "num_key_value_heads", None) or heads)
    out["head_dim"] = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return out


@dataclass
class HeadPattern:
    """Which (layer, KV head) pairs are retrieval heads, with the per-head scores that chose them.

    DuoAttention (Xiao et al., 2024, arXiv 2410.10819) / RazorAttention (Tang et al., 2024, arXiv 2407.15891).

    Attributes
    ----------
    num_layers, num_kv_heads, num_attention_heads : int
        The model's decoder layers, key/value heads and query heads.
    scores : list of list of float
        [num_layers][num_kv_heads] retrieval scores, higher = more retrieval-like (the finder's units; see
        ``found_by``).
    retrieval_heads : list of (int, int)
        The (layer, KV head) pairs that keep the full cache.
    fingerprint : dict
        :func:`config_fingerprint` of the model the pattern was made for.
    model : str
        A label for that model.
    found_by : dict
        How it was found (finder, data, weights).
    source : str
        Where it was loaded from (a name or a path; empty when built in memory).
    validation : dict
        The pattern's card: what it scored on data it was not fitted on, beside its fitting source, and where it
        does not transfer (``{"transfers": bool, "summary": str, "record": path, ...}``); empty when not validated.

    Raises
    ------
    ValueError
        If ``scores`` is not [num_layers][num_kv_heads] or a retrieval head is out of range.
    """

    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    scores: list
    retrieval_heads: list
    fingerprint: dict = field(default_factory=dict)
    model: str = ""
    found_by: dict = field(default_factory=dict)
    source: str = ""
    validation: dict = field(default_factory=dict)

    def __post_init__(self):
        self.retrieval_heads = sorted({(int(l), int(h)) for l, h in self.retrieval_heads})
        if len(self.scores) != self.num_layers or any(len(row) != self.num_kv_heads for row in self.scores):
            raise ValueError(
                f"head pattern scores must be [{self.num_layers} layers][{self.num_kv_heads} KV heads], got "
                f"{len(self.scores)} rows of lengths {sorted({len(r) for r in self.scores})}"
            )
        bad = [(l, h) for l, h in self.retrieval_heads if not (0 <= l < self.num_layers and 0 <= h < self.num_kv_heads)]
        if bad:
            raise ValueError(f"retrieval heads {bad} are outside {self.num_layers} layers x {self.num_kv_heads} KV heads")

    # ------------------------------------------------------------------ queries
    def heads_of(self, layer: int) -> tuple[int, ...]:
        """KV heads of ``layer`` that are retrieval heads, ascending."""
        return tuple(h for l, h in self.retrieval_heads if l == layer)

    @property
    def retrieval_fraction(self) -> float:
        """Fraction of all (layer, KV head) pairs that are retrieval heads."""
        return len(self.retrieval_heads) / (self.num_layers * self.num_kv_heads)

    def with_fraction(self, fraction: float) -> HeadPattern:
        """A copy whose retrieval heads are the ``ceil(fraction * layers * kv_heads)`` best-scored pairs (global,
        as DuoAttention thresholds its gates; ties broken by layer then head).

        Raises
        ------
        ValueError
            If ``fraction`` is outside [0, 1].
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"retrieval fraction must be in [0, 1], got {fraction!r}")
        pairs = [(l, h) for l in range(self.num_layers) for h in range(self.num_kv_heads)]
        n = math.ceil(fraction * len(pairs) - 1e-9)
        ranked = sorted(pairs, key=lambda p: (-float(self.scores[p[0]][p[1]]), p))
        return HeadPattern(self.num_layers, self.num_kv_heads, self.num_attention_heads, self.scores, ranked[:n],
                           dict(self.fingerprint), self.model, {**self.found_by, "fraction": fraction}, self.source,
                           dict(self.validation))

    # ------------------------------------------------------------------ checks
    def check_model(self, config) -> list[str]:
        """Check that the pattern fits a model; return warnings for softer mismatches.

        Parameters
        ----------
        config : transformers.PretrainedConfig

        Returns
        -------
        list of str
            Warnings (fingerprint fields other than the layer and head counts differ).

        Raises
        ------
        ValueError
            If the layer count, KV head count or query head count differ (a pattern made for another model).
        """
        fp = config_fingerprint(config)
        got = (fp["num_hidden_layers"], fp["num_key_value_heads"], fp["num_attention_heads"])
        want = (self.num_layers, self.num_kv_heads, self.num_attention_heads)
        if got != want:
            raise ValueError(
                f"head pattern {self.source or self.model!r} was made for a model with {want[0]} layers, {want[1]} KV "
                f"heads and {want[2]} query heads; this model has {got[0]} layers, {got[1]} KV heads and {got[2]} "
                "query heads. Find a pattern for it with mmaccel.longctx.head_finder.find_retrieval_heads"
            )
        differ = [k for k in _FINGERPRINT_KEYS if k in self.fingerprint and self.fingerprint[k] != fp.get(k)]
        if differ:
            message = (f"head pattern {self.source or self.model!r} was made for another model config ("
                       + ", ".join(f"{k}: {self.fingerprint[k]} vs {fp.get(k)}" for k in differ) + ")")
            logger.warning(message)
            return [message]
        return []

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "num_attention_heads": self.num_attention_heads,
            "fingerprint": self.fingerprint,
            "scores": [[round(float(s), 6) for s in row] for row in self.scores],
            "retrieval_heads": [list(p) for p in self.retrieval_heads],
            "found_by": self.found_by,
            **({"validation": self.validation} if self.validation else {}),
        }

    def save(self, path) -> Path:
        """Write the pattern as JSON to ``path`` (parent folders are created); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> HeadPattern:
        """Build from a loaded JSON object.

        Raises
        ------
        ValueError
            If the format tag is not ``mmaccel-head-pattern/1`` or a field is missing.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source or 'data'} is not a head pattern (expected format {FORMAT!r})")
        try:
            return cls(int(data["num_layers"]), int(data["num_kv_heads"]), int(data["num_attention_heads"]),
                       data["scores"], data["retrieval_heads"], data.get("fingerprint", {}), data.get("model", ""),
                       data.get("found_by", {}), source, data.get("validation", {}))
        except KeyError as exc:
            raise ValueError(f"head pattern {source!r} lacks the field {exc}") from exc


def available_head_patterns() -> list[str]:
    """Names of the head patterns shipped in ``mmaccel/longctx/head_patterns/``."""
    return sorted(p.stem for p in PATTERN_DIR.glob("*.json"))


def load_head_pattern(name_or_path) -> HeadPattern:
    """Load a head pattern by name (``"micro-lm"``) or by path to a JSON file.

    Parameters
    ----------
    name_or_path : str, os.PathLike or HeadPattern
        A shipped name (:func:`available_head_patterns`), a path, or a pattern (returned as is).

    Returns
    -------
    HeadPattern

    Raises
    ------
    ValueError
        For an unknown name or a missing file (the message lists the shipped names), unreadable JSON, or a file that
        is not a head pattern.
    """
    if isinstance(name_or_path, HeadPattern):
        return name_or_path
    text = str(name_or_path)
    data = read_shipped_json(text, PATTERN_DIR, "head pattern", "make one with "
                             "mmaccel.longctx.head_finder.find_retrieval_heads(model, tokenizer).save(path)")
    return HeadPattern.from_dict(data, source=text)
