"""Self-speculative decoding by layer skipping: the draft is the target itself with some decoder layers skipped.

The skip set is found once per model by a greedy search on calibration text (the draft's top-1 agreement with the
target, traded against the draft's cost) and shipped as a small JSON file per model in
``mmaccel/speculative/skip_sets/<name>.json`` (:func:`available_skip_sets`), or passed directly (``skip=``).

File (``format = "mmaccel-skip-set/1"``)::

    {"format": ..., "model": "smollm2-135m", "num_layers": 30,
     "fingerprint": {"model_type": "llama", "num_hidden_layers": 30, ...},
     "skip": [5, 9, 14],                        # decoder layers the draft skips
     "agreement": 0.81,                         # draft/target top-1 agreement on the calibration text
     "draft_cost": 0.79,                        # draft forward / target forward, by weights read
     "found_by": {"search": "greedy", "path": [[9, 0.97], [5, 0.93], ...], ...}}

References
----------
Zhang et al., "Draft & Verify: Lossless Large Language Model Acceleration via Self-Speculative Decoding", 2024,
arXiv 2309.08168 (skipped layers chosen offline by search).
Xia et al., "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration", 2025, arXiv 2410.06916
(training-free layer-skip draft, skip set chosen by draft/target agreement on context).
Elhoushi et al., "LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding", 2024, arXiv 2404.16710.
"""
from __future__ import annotations

import json
import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ..longctx.head_pattern import config_fingerprint
from ..specs import read_shipped_json
from .base import Draft, Drafter
from .draft_model import DraftModel
from .schedule import best_draft_length, expected_rate

logger = logging.getLogger(__name__)

FORMAT = "mmaccel-skip-set/1"
SKIP_SET_DIR = Path(__file__).with_name("skip_sets")
_FIX = ("pass skip=[...] (decoder layer indices), or find a skip set with "
        "mmaccel.speculative.layer_skip.search_skip_layers(model, text, tokenizer=tok).save(path) and pass "
        "skip_set=path")


# ------------------------------------------------------------------------------------------------ the layers
def _layer_owner(model: nn.Module) -> nn.Module:
    """The module whose ``.layers`` is the decoder's ``nn.ModuleList`` (``model.model`` for Llama-like LMs, its
    ``language_model`` for a VLM).

    Raises
    ------
    ValueError
        If no such list is found.
    """
    base = getattr(model, "model", None)
    for owner in (base, getattr(base, "language_model", None), model):
        if isinstance(getattr(owner, "layers", None), nn.ModuleList):
            return owner
    raise ValueError(f"layer skipping needs a decoder whose layers are an nn.ModuleList named 'layers' (Llama, "
                     f"Qwen2, Mistral, ...); {type(model).__name__} has none")


def num_decoder_layers(model: nn.Module) -> int:
    """Decoder layers of ``model`` (the length of its ``layers`` list).

    Raises
    ------
    ValueError
        See :func:`skipping_layers`.
    """
    return len(_layer_owner(model).layers)


def check_skip(skip, num_layers: int | None = None) -> tuple[int, ...]:
    """Validate a skip set: distinct layer indices in ``1 .. num_layers - 1`` (layer 0 always runs: the draft's
    cache length and attention mask are read from it), at least one layer kept besides it.

    Parameters
    ----------
    skip : int, iterable of int, or str
        Layer indices, or a spec string ``"4,7,9"``.
    num_layers : int, optional
        Decoder layers of the model (``None``: the upper bound is not checked).

    Returns
    -------
    tuple of int
        The sorted indices.

    Raises
    ------
    ValueError
        For a non-integer, repeated or out-of-range index, layer 0, or an empty set; the message names the range.
    """
    if isinstance(skip, int) and not isinstance(skip, bool):
        skip = [skip]
    elif isinstance(skip, str):
        parts = [p.strip() for p in skip.replace(";", ",").split(",") if p.strip()]
        try:
            skip = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"skip must be layer indices such as '4,7,9', got {skip!r}") from None
    try:
        layers = list(skip)
    except TypeError:
        raise ValueError(f"skip must be a list of layer indices, got {skip!r}") from None
    if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise ValueError(f"skip must hold integer layer indices, got {layers!r}")
    if not layers:
        raise ValueError(f"skip is empty: the draft would be the target itself; {_FIX}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"skip lists a layer twice: {layers}")
    if 0 in layers:
        raise ValueError("layer 0 cannot be skipped: it always runs (the draft's cache length and attention mask are "
                         "read from it); skip layers from 1 up")
    bad = [i for i in layers if i < 0 or (num_layers is not None and i >= num_layers)]
    if bad:
        if num_layers is None:
            raise ValueError(f"skip index {bad[0]} is out of range: layer indices are >= 1 (layer 0 always runs)")
        raise ValueError(f"skip index {bad[0]} is out of range for a model with {num_layers} decoder layers: skip "
                         f"layers 1 .. {num_layers - 1} (layer 0 always runs)")
    return tuple(sorted(layers))


@contextmanager
def skipping_layers(model: nn.Module, skip):
    """Run ``model`` with the decoder layers ``skip`` left out, restoring it on exit (the layer-skip draft of
    Draft & Verify, arXiv 2309.08168, and SWIFT, arXiv 2410.06916).

    The decoder's ``layers`` list is swapped, for this one model object and inside the block only, for the list of
    the kept layers; they keep their ``layer_idx``, so a cache passed to the model fills only the kept layers' slots.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder LM whose layers are an ``nn.ModuleList`` named ``layers``.
    skip : iterable of int or str
        Layer indices (:func:`check_skip`).

    Raises
    ------
    ValueError
        A bad skip set, or a model without a ``layers`` list.
    """
    owner = _layer_owner(model)
    skip = set(check_skip(skip, len(owner.layers)))
    with _swapped(owner, nn.ModuleList([layer for i, layer in enumerate(owner.layers) if i not in skip])):
        yield model


@contextmanager
def _swapped(owner: nn.Module, layers: nn.ModuleList):
    full = owner.layers
    owner.layers = layers
    try:
        yield
    finally:
        owner.layers = full


def draft_cost(model: nn.Module, skip) -> float:
    """Cost of a layer-skip draft forward relative to a target forward, by weights read: ``(output head + kept
    layers) / (output head + all layers)`` (one-token forwards are bound by reading the weights).

    Parameters
    ----------
    model : transformers.PreTrainedModel
    skip : iterable of int
        Skipped layers (not validated here).

    Returns
    -------
    float
        In ``(0, 1]``.
    """
    layers = _layer_owner(model).layers
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    head = model.get_output_embeddings()
    head = head.weight.numel() if head is not None else 0
    skip = set(skip)
    return (head + sum(s for i, s in enumerate(sizes) if i not in skip)) / (head + sum(sizes))


# ------------------------------------------------------------------------------------------------ skip sets
@dataclass
class SkipSet:
    """The decoder layers a layer-skip draft leaves out, and how they were found (Draft & Verify, arXiv 2309.08168;
    SWIFT, arXiv 2410.06916).

    Attributes
    ----------
    skip : list of int
        Skipped layer indices, sorted, in ``1 .. num_layers - 1``.
    num_layers : int
        Decoder layers of the model.
    agreement : float or None
        Fraction of calibration positions where the draft's top-1 token equals the target's (teacher forced).
    draft_cost : float or None
        Draft forward / target forward (:func:`draft_cost`).
    fingerprint : dict
        :func:`mmaccel.longctx.head_pattern.config_fingerprint` of the model it was made for.
    model : str
        A label for that model.
    found_by : dict
        How it was found (search, calibration tokens, path of ``[layer, agreement]`` additions, costs).
    source : str
        Where it was loaded from (empty when built in memory).

    Raises
    ------
    ValueError
        If ``skip`` is not valid for ``num_layers`` (:func:`check_skip`).
    """

    skip: list
    num_layers: int
    agreement: float | None = None
    draft_cost: float | None = None
    fingerprint: dict = field(default_factory=dict)
    model: str = ""
    found_by: dict = field(default_factory=dict)
    source: str = ""

    def __post_init__(self):
        self.skip = list(check_skip(self.skip, int(self.num_layers)))

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model with another layer count; warn when other fingerprint fields differ.

        Raises
        ------
        ValueError
            If the model's decoder layer count differs from ``num_layers``.
        """
        n = num_decoder_layers(model)
        if n != self.num_layers:
            raise ValueError(f"skip set {self.source or self.model!r} was made for a model with {self.num_layers} "
                             f"decoder layers; this model has {n}. {_FIX}")
        fp = config_fingerprint(model.config)
        differ = [k for k, v in self.fingerprint.items() if fp.get(k) != v]
        if differ:
            logger.warning("skip set %r was made for another model config (%s)", self.source or self.model,
                           ", ".join(f"{k}: {self.fingerprint[k]} vs {fp.get(k)}" for k in differ))

    def to_dict(self) -> dict:
        """The JSON object of the file format (module docstring), ``format`` tag included."""
        return {"format": FORMAT, "model": self.model, "num_layers": self.num_layers, "fingerprint": self.fingerprint,
                "skip": list(self.skip), "agreement": self.agreement, "draft_cost": self.draft_cost,
                "found_by": self.found_by}

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> SkipSet:
        """Build from a loaded JSON object.

        Raises
        ------
        ValueError
            If the format tag is not ``mmaccel-skip-set/1``, a field is missing or the skip list is invalid.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source or 'data'} is not a skip set (expected format {FORMAT!r})")
        try:
            return cls(data["skip"], int(data["num_layers"]), data.get("agreement"), data.get("draft_cost"),
                       data.get("fingerprint", {}), data.get("model", ""), data.get("found_by", {}), source)
        except KeyError as exc:
            raise ValueError(f"skip set {source!r} lacks the field {exc}") from exc

    def save(self, path) -> Path:
        """Write this skip set to ``path`` as indented JSON, creating parent folders.

        Returns
        -------
        pathlib.Path
            Where it was written.
        """
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return out


def available_skip_sets() -> list[str]:
    """Names of the skip sets shipped in ``mmaccel/speculative/skip_sets/``."""
    return sorted(p.stem for p in SKIP_SET_DIR.glob("*.json"))


def load_skip_set(name_or_path) -> SkipSet:
    """Load a skip set by shipped name (``"smollm2-135m"``) or by path to a JSON file.

    Raises
    ------
    ValueError
        An unknown name or missing file (the message lists the shipped names), unreadable JSON, or a file that is
        not a skip set.
    """
    if isinstance(name_or_path, SkipSet):
        return name_or_path
    text = str(name_or_path)
    data = read_shipped_json(text, SKIP_SET_DIR, "skip set", _FIX)
    return SkipSet.from_dict(data, source=text)


def shipped_skip_set_for(model: nn.Module) -> SkipSet | None:
    """The shipped skip set whose fingerprint and layer count equal ``model``'s, or ``None``."""
    fp = config_fingerprint(model.config)
    n = num_decoder_layers(model)
    for name in available_skip_sets():
        found = load_skip_set(name)
        if found.num_layers == n and found.fingerprint == fp:
            return found
    return None


# ------------------------------------------------------------------------------------------------ search
def _calibration_ids(calibration, tokenizer, max_tokens: int) -> list[torch.Tensor]:
    if isinstance(calibration, torch.Tensor):
        items = list(calibration.reshape(-1, calibration.shape[-1])) if calibration.dim() else []
    else:
        items = [calibration] if isinstance(calibration, str) else list(calibration or [])
    out = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("calibration text needs a tokenizer: search_skip_layers(model, text, tokenizer=tok)")
            item = tokenizer(item, return_tensors="pt")["input_ids"]
        ids = torch.as_tensor(item).long().reshape(1, -1)[:, :max_tokens]
        if ids.shape[1] >= 2:
            out.append(ids)
    if not out:
        raise ValueError("calibration text is empty: give at least one text (or token ids) of 2 or more tokens, "
                         "e.g. a few paragraphs like the prompts the model will see")
    return out


def _top1(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids.to(next(model.parameters()).device), use_cache=False).logits.argmax(dim=-1)


@torch.inference_mode()
def draft_agreement(model: nn.Module, calibration: list, skip, targets: list | None = None) -> float:
    """Fraction of positions where the layer-skip draft's top-1 token equals the target's, teacher forced on the
    calibration sequences (the acceptance proxy of SWIFT, arXiv 2410.06916).

    Parameters
    ----------
    model : transformers.PreTrainedModel
    calibration : list of torch.LongTensor
        [1, L] token ids each.
    skip : iterable of int
        Skipped layers (:func:`check_skip`).
    targets : list of torch.LongTensor, optional
        [1, L] the target's top-1 tokens per item (computed when not given).

    Returns
    -------
    float
        In ``[0, 1]``.
    """
    if targets is None:
        targets = [_top1(model, ids) for ids in calibration]
    same = total = 0
    with skipping_layers(model, skip):
        for ids, target in zip(calibration, targets):
            same += int((_top1(model, ids) == target).sum())
            total += target.numel()
    return same / total


def _best_rate(alpha: float, cost: float, k_max: int, verify_cost: float) -> tuple[float, int]:
    k = best_draft_length(alpha, 1, k_max, cost, verify_cost)
    return expected_rate(alpha, k, cost + verify_cost), k


@torch.inference_mode()
def search_skip_layers(model: nn.Module, calibration, *, tokenizer=None, max_skip: int | None = None,
                       min_agreement: float = 0.5, verify_cost: float = 0.1, k_max: int = 8, max_tokens: int = 512,
                       model_name: str = "") -> SkipSet:
    """Greedy search of the layers a self-speculative draft skips (Draft & Verify, arXiv 2309.08168, searches the
    skip set offline; SWIFT, arXiv 2410.06916, scores candidate sets by draft/target agreement on context).

    Starting from no skipped layer, each round skips the one more layer whose removal keeps the draft's top-1
    agreement with the target (:func:`draft_agreement`) highest (ties: the lowest index). Every set on this path is
    scored by the expected tokens per unit of cost of its best draft length ``k <= k_max``
    (:func:`mmaccel.speculative.schedule.expected_rate` with the agreement as acceptance rate and
    :func:`draft_cost` + ``verify_cost`` per draft token); the best-scoring set is returned.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder LM with an ``nn.ModuleList`` of ``layers``.
    calibration : str, torch.LongTensor, or a list of them
        Calibration text (needs ``tokenizer``) or token ids; each item is cut to ``max_tokens`` tokens.
    tokenizer : tokenizer, optional
        Encodes text items.
    max_skip : int, optional
        Most layers skipped, ``1 .. num_layers - 2`` (default: all but layer 0 and one more).
    min_agreement : float
        Stop the search once the agreement falls below this, in ``[0, 1)``.
    verify_cost : float
        Extra cost of one more token in a verification forward relative to a one-token forward, ``>= 0``.
    k_max : int
        Longest draft considered when scoring, ``>= 1``.
    max_tokens : int
        Tokens per calibration item, ``>= 2``.
    model_name : str
        Label stored in the result.

    Returns
    -------
    SkipSet
        The chosen set; ``found_by["path"]`` holds every ``[layer, agreement]`` addition and ``found_by["rates"]``
        the expected rates (> 1 = faster than autoregressive decoding by this model).

    Raises
    ------
    ValueError
        Empty calibration text, text without a tokenizer, ``k_max <= 0``, ``max_skip`` out of range, a model with
        fewer than 3 decoder layers or without a ``layers`` list.
    """
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max <= 0:
        raise ValueError(f"k_max (longest draft scored) must be an integer >= 1, got {k_max!r}")
    if not 0 <= min_agreement < 1 or verify_cost < 0 or max_tokens < 2:
        raise ValueError("need 0 <= min_agreement < 1, verify_cost >= 0 and max_tokens >= 2")
    n = num_decoder_layers(model)
    if n < 3:
        raise ValueError(f"layer skipping needs a model with at least 3 decoder layers, this one has {n}")
    limit = n - 2 if max_skip is None else max_skip
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= n - 2:
        raise ValueError(f"max_skip must be an integer in 1 .. {n - 2} for a model with {n} decoder layers, "
                         f"got {max_skip!r}")
    ids = _calibration_ids(calibration, tokenizer, max_tokens)
    targets = [_top1(model, i) for i in ids]
    skip: list[int] = []
    path, rates = [], []
    best = (-1.0, None)
    for _ in range(limit):
        scored = [(draft_agreement(model, ids, skip + [c], targets), -c) for c in range(1, n) if c not in skip]
        agreement, neg = max(scored)
        if agreement < min_agreement and path:
            break
        skip.append(-neg)
        cost = draft_cost(model, skip)
        rate, k = _best_rate(agreement, cost, k_max, verify_cost)
        path.append([-neg, round(agreement, 6)])
        rates.append({"skipped": len(skip), "agreement": round(agreement, 6), "draft_cost": round(cost, 6),
                      "k": k, "expected_rate": round(rate, 6)})
        logger.info("skip %s: agreement %.3f, draft cost %.3f, expected rate %.3f (k=%d)", sorted(skip), agreement,
                    cost, rate, k)
        if rate > best[0]:
            best = (rate, (sorted(skip), agreement, cost))
    chosen, agreement, cost = best[1]
    if best[0] <= 1.0:
        logger.warning("no skip set is expected to beat autoregressive decoding (best rate %.3f)", best[0])
    return SkipSet(chosen, n, round(agreement, 6), round(cost, 6), config_fingerprint(model.config), model_name,
                   {"search": "greedy agreement", "calibration_tokens": sum(int(i.shape[1]) for i in ids),
                    "verify_cost": verify_cost, "k_max": k_max, "min_agreement": min_agreement, "path": path,
                    "rates": rates})


# ------------------------------------------------------------------------------------------------ drafter
class LayerSkip(Drafter):
    """Self-speculative drafting: the target with a set of decoder layers skipped drafts for itself (Draft & Verify,
    Zhang et al., 2024, arXiv 2309.08168; SWIFT, Xia et al., 2025, arXiv 2410.06916; LayerSkip, Elhoushi et al.,
    2024, arXiv 2404.16710, without its early-exit training).

    The draft runs the target's embedding, its kept layers, final norm and output head (:func:`skipping_layers`)
    with its own ``DynamicCache`` (only the kept layers' slots fill), so the target's cache never sees a draft
    token; drafting, rollback and sampling are :class:`~mmaccel.speculative.DraftModel`'s, with the target as the
    draft model. Lossless like every verified drafter: greedy output equals plain greedy decoding.

    Parameters
    ----------
    skip : str or list of int, optional
        Decoder layers to skip (``"4,7,9"`` in a spec), in ``1 .. num_layers - 1``.
    skip_set : str, optional
        A shipped skip-set name (:func:`available_skip_sets`) or a path to one saved by
        :meth:`SkipSet.save`. Default (neither given): the shipped set made for this model's config.
    stop_below : float, optional
        Stop drafting once the draft's product of top-1 probabilities falls below this, in ``(0, 1)`` (SpecDec++
        style, as in :class:`~mmaccel.speculative.DraftModel`).

    Raises
    ------
    ValueError
        Both ``skip`` and ``skip_set``; a bad ``skip`` (not integers, repeated, layer 0); at the first generation, an
        index out of range for the target, an unknown skip set or one made for another layer count, or no shipped
        set for the target (the message says how to find one).
    """

    name: ClassVar[str] = "layer_skip"

    def __init__(self, skip: str | list | None = None, skip_set: str | None = None, stop_below: float | None = None):
        if skip is not None and skip_set is not None:
            raise ValueError("layer_skip: pass skip (layer indices) or skip_set (a name or path), not both")
        if skip is not None:
            check_skip(skip)  # types, repeats, layer 0 now; the range at the first generation
        self.skip, self.skip_set, self.stop_below = skip, skip_set, stop_below
        self._inner = DraftModel(model=None, stop_below=stop_below)  # checks stop_below; the target comes in begin
        self._target = None
        self._layers = None
        self.resolved: SkipSet | None = None

    def resolve(self, target: nn.Module) -> SkipSet:
        """The skip set used for ``target``: ``skip``, else ``skip_set``, else the shipped set for its config.

        Raises
        ------
        ValueError
            See the class.
        """
        n = num_decoder_layers(target)
        if self.skip is not None:
            return SkipSet(list(check_skip(self.skip, n)), n, fingerprint=config_fingerprint(target.config),
                           draft_cost=round(draft_cost(target, check_skip(self.skip, n)), 6))
        if self.skip_set is not None:
            found = load_skip_set(self.skip_set)
            found.check_model(target)
            return found
        found = shipped_skip_set_for(target)
        if found is None:
            raise ValueError(f"no shipped skip set matches this {config_fingerprint(target.config)['model_type']} "
                             f"model with {n} layers (shipped: {', '.join(available_skip_sets()) or 'none'}); {_FIX}")
        return found

    def begin(self, target, input_ids, attention_mask, sampler) -> None:
        """Resolve the skip set (once per target), start a fresh draft cache.

        Raises
        ------
        ValueError
            See the class.
        """
        if self._target is None or self._target() is not target:
            self.resolved = self.resolve(target)
            owner = _layer_owner(target)
            drop = set(self.resolved.skip)
            self._layers = nn.ModuleList([layer for i, layer in enumerate(owner.layers) if i not in drop])
            self._inner.model = target
            self._target = weakref.ref(target)
        self._owner = _layer_owner(target)
        self._inner.begin(target, input_ids, attention_mask, sampler)

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """Draft up to ``k`` tokens with the kept layers; see :meth:`DraftModel.propose`."""
        with _swapped(self._owner, self._layers):
            return self._inner.propose(sequences, attention_mask, k, sampler, generator)

    def observe(self, target_logits, draft: Draft, kept: int) -> None:
        """Crop the draft cache to the committed tokens."""
        self._inner.observe(target_logits, draft, kept)

    def end(self) -> dict:
        """Free the draft cache; report draft forwards and tokens and the skipped layers."""
        telemetry = self._inner.end()
        telemetry["draft_model"] = "self (layer skip)"
        telemetry["skipped_layers"] = list(self.resolved.skip) if self.resolved else []
        telemetry["draft_cost"] = self.resolved.draft_cost if self.resolved else None
        return telemetry
