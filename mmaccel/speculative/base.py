"""What a drafter is: the plug-in interface of the draft-and-verify engine, and the helpers drafters share.

A drafter says only how it proposes tokens; verification, KV rollback of the target and telemetry live once in
:func:`mmaccel.speculative.speculative_generate`. The engine calls, per generation:

1. :meth:`Drafter.begin` once, with the target and the (left-padded) prompt;
2. per step, :meth:`Drafter.propose` with the committed sequences (the last column is the *pending* token, the one
   the target has not yet seen) and a maximum draft length ``k``; it returns a :class:`Draft` of ``0 .. k`` tokens
   per row (the same number for every row);
3. :meth:`Drafter.observe` with the target's logits of that verification forward and the number of draft tokens
   kept, so stateful drafters can roll back (a draft model crops its own KV cache) or reuse the target's output
   (Jacobi);
4. :meth:`Drafter.end`, which returns the drafter's telemetry.

A drafter whose draft tokens are a deterministic function of the past (prompt lookup, Jacobi) returns
``probs=None``: verification then treats its ``q`` as one-hot, which keeps speculative sampling lossless.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import Cache, DynamicCache

from .sampling import Sampler


@dataclass
class Draft:
    """Proposed tokens for one step: the ``x_i ~ q_i`` of speculative sampling (Leviathan et al., 2023,
    arXiv 2211.17192).

    Attributes
    ----------
    tokens : torch.LongTensor
        [B, k] draft tokens, ``k >= 0`` (the same ``k`` for every row).
    probs : torch.Tensor or None
        [B, k, V] float32 distributions the tokens were drawn from (filtered by the shared :class:`Sampler`), or
        ``None`` for deterministic drafts (one-hot ``q``).
    forwards : int
        Draft-model forward passes spent on this proposal (0 for model-free drafters).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    forwards: int = 0

    @property
    def length(self) -> int:
        """Number of draft tokens per row, ``k``."""
        return int(self.tokens.shape[1])

    @property
    def depth(self) -> int:
        """Most draft tokens one verification can accept: ``k`` for a chain (a token tree's depth for a tree)."""
        return self.length


class Drafter:
    """Base class of the drafters in :data:`mmaccel.speculative.METHODS`.

    Subclasses implement :meth:`propose` and, when they keep state, :meth:`begin`, :meth:`observe` and
    :meth:`end`. ``lossless`` says whether greedy output is guaranteed to equal plain greedy decoding (every drafter
    verified by the engine is; the flag exists for relaxed-acceptance methods that are not).

    Notes
    -----
    The engine implements speculative decoding as in Leviathan et al., "Fast Inference from Transformers via
    Speculative Decoding", 2023, arXiv 2211.17192, and Chen et al., "Accelerating Large Language Model Decoding with
    Speculative Sampling", 2023, arXiv 2302.01318.
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    #: whether :meth:`observe` stays right when the step's draft came from another drafter (a :class:`Cascade`)
    observes_any_draft: ClassVar[bool] = False
    #: whether the first proposal needs nothing from the target's prefill (no hidden states, no filled cache), so
    #: the engine may feed the prompt in the first verification forward instead of a prefill of its own
    folds_prefill: ClassVar[bool] = False

    def begin(self, target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              sampler: Sampler) -> None:
        """Start one generation.

        Parameters
        ----------
        target : transformers.PreTrainedModel
            The model being decoded.
        input_ids : torch.LongTensor
            [B, L] left-padded prompt.
        attention_mask : torch.LongTensor
            [B, L], 1 for real tokens, 0 for left padding.
        sampler : Sampler
            The decoding distribution shared with the target.

        Raises
        ------
        ValueError
            If the drafter cannot serve this target (e.g. a different vocabulary).
        """

    def draft_modules(self) -> list[torch.nn.Module]:
        """The networks this drafter runs (a draft model, an EAGLE head), for whole-model transforms such as
        :class:`~mmaccel.kernels.PackedLinears`; none by default (prompt lookup, Jacobi: the target drafts)."""
        return []

    def propose(self, sequences: torch.Tensor, attention_mask: torch.Tensor, k: int, sampler: Sampler,
                generator: torch.Generator | None = None) -> Draft:
        """Propose up to ``k`` tokens to follow ``sequences``.

        Parameters
        ----------
        sequences : torch.LongTensor
            [B, T] committed tokens, left-padded; the last column is the pending token.
        attention_mask : torch.LongTensor
            [B, T], 0 on left padding.
        k : int
            Maximum draft length, ``>= 1``.
        sampler : Sampler
            Greedy drafters take the argmax; sampling drafters draw from ``sampler.probs`` and return them.
        generator : torch.Generator, optional
            Randomness for sampling drafters.

        Returns
        -------
        Draft
            ``0 .. k`` tokens per row.
        """
        raise NotImplementedError

    def observe(self, target_logits: torch.Tensor, draft: Draft, kept: int) -> None:
        """See the verification result of the last :meth:`propose`.

        Parameters
        ----------
        target_logits : torch.Tensor
            [B, draft.length + 1, V] the target's logits at the pending token and at each draft token.
        draft : Draft
            What :meth:`propose` returned.
        kept : int
            Draft tokens committed to every row (the engine then appends one target token); the sequences of the
            next :meth:`propose` are the previous ones + ``draft.tokens[:, :kept]`` + one new pending token.
        """

    def end(self) -> dict:
        """Finish the generation; release per-generation state and return JSON-serialisable telemetry."""
        return {}


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a left-padded batch: ``cumsum(mask) - 1``, pads clamped to 0 (RoFormer, Su et al., 2021,
    arXiv 2104.09864; the rule transformers' ``generate`` applies).

    Parameters
    ----------
    attention_mask : torch.Tensor
        [B, T], 1 for real tokens, 0 for padding.

    Returns
    -------
    torch.LongTensor
        [B, T] position ids (what ``generate`` derives, so cached keys match plain decoding).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Leading pad columns per row of a left-padded mask, or ``None`` when no row has any.

    Decoding appends only real tokens, so these counts fix every later position (:func:`column_positions`) and say
    once per generation whether the forwards need an attention mask at all.

    Parameters
    ----------
    attention_mask : torch.Tensor
        [B, T], 1 for real tokens, 0 for (left) padding.

    Returns
    -------
    torch.LongTensor or None
        [B, 1] pad counts; ``None`` if the mask is all ones.
    """
    pads = attention_mask.shape[1] - attention_mask.long().sum(dim=-1, keepdim=True)
    return pads if bool(pads.any()) else None


def column_positions(start: int, stop: int, pads: torch.Tensor | None, batch: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE positions of the columns ``start .. stop - 1`` of a left-padded batch, without a pass over the mask.

    Equal to ``positions_from_mask(mask)[:, start:stop]`` for any mask whose padding is all on the left (pad
    columns get 0, the real token at column ``j`` of a row with ``p`` pads gets ``j - p``).

    Parameters
    ----------
    start, stop : int
        Column range, ``0 <= start <= stop``.
    pads : torch.LongTensor or None
        [B, 1] from :func:`left_padding`; ``None`` = no padding.
    batch : int
        ``B``.
    device : torch.device or str
        Where the positions live.

    Returns
    -------
    torch.LongTensor
        [B, stop - start] position ids (an expanded view of one row when there is no padding).
    """
    pos = torch.arange(start, stop, device=device)[None]
    return pos.expand(batch, -1) if pads is None else (pos - pads).clamp_min(0)


class ColumnPositions:
    """:func:`column_positions` of one generation, sliced from a table built once (one tensor op per call instead
    of an ``arange`` and its arithmetic); the table doubles when a column past its end is asked for.

    Parameters
    ----------
    pads, batch, device
        As in :func:`column_positions`.
    capacity : int
        Columns of the first table (e.g. prompt length + new tokens, so that it never grows).
    """

    def __init__(self, pads: torch.Tensor | None, batch: int, device: torch.device | str = "cpu",
                 capacity: int = 256):
        self.pads, self.batch, self.device = pads, batch, device
        self._table = column_positions(0, max(int(capacity), 1), pads, batch, device)

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        """[B, stop - start] positions of the columns ``start .. stop - 1`` (a view of the table)."""
        if stop > self._table.shape[1]:
            self._table = column_positions(0, max(stop, 2 * self._table.shape[1]), self.pads, self.batch,
                                           self.device)
        return self._table[:, start:stop]


def crop_cache(cache: Cache, length: int) -> None:
    """Roll a ``DynamicCache`` back to its first ``length`` slots with transformers' own ``crop`` (the KV rollback of
    rejected draft tokens in speculative decoding, Leviathan et al., 2023, arXiv 2211.17192).

    Parameters
    ----------
    cache : transformers.DynamicCache
        The cache to shorten in place.
    length : int
        Slots to keep, ``0 <= length``; a no-op when the cache holds no more than that (except that a sliding-window
        layer recording its past, :func:`croppable_cache`, is trimmed back to its window). Layers that no forward
        reached (a layer-skip draft's skipped layers) are left empty.
    """
    held = cache.get_seq_length()
    layers = getattr(cache, "layers", None)
    if layers is None:
        if held > length:
            cache.crop(length - held)
        return
    for layer in layers:  # layer by layer: a layer a forward never reached (a skipped layer) stays empty
        if not layer.is_initialized:
            continue
        if held > length:
            layer.crop(length - held)  # transformers 5: a negative count of slots to remove
        elif getattr(layer, "record_past", False):
            layer.crop(0)  # nothing rejected: a recording sliding-window layer still trims back to its window


def croppable_cache(config=None, cache: Cache | None = None) -> Cache:
    """A cache whose every layer can be rolled back by :func:`crop_cache`: a fresh ``DynamicCache`` for ``config``,
    or ``cache`` itself, with past recording switched on in its sliding-window layers.

    A ``DynamicSlidingWindowLayer`` (Mistral with ``sliding_window`` set, Gemma 2/3's local layers) keeps only its last
    ``window - 1`` slots, so it cannot give back the slots a rejected draft pushed out; with
    ``activate_past_recording()`` it keeps them until the next :func:`crop_cache`, which then trims it back to the
    window. Layers without that switch are left as they are.

    Parameters
    ----------
    config : transformers.PretrainedConfig, optional
        The model's config (its ``layer_types``/``sliding_window`` decide the layer classes) when no cache is given.
    cache : transformers.Cache, optional
        A caller's cache to prepare in place (returned).

    Returns
    -------
    transformers.Cache
    """
    cache = DynamicCache(config=config) if cache is None else cache
    for layer in getattr(cache, "layers", []):
        record = getattr(layer, "activate_past_recording", None)
        if callable(record):
            record()
    return cache
