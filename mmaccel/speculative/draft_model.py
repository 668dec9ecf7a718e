"""Draft model: a smaller causal LM with the target's tokenizer proposes ``k`` tokens autoregressively.

Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding", 2023, arXiv 2211.17192;
Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling", 2023, arXiv 2302.01318.
"""
from __future__ import annotations

import logging
import weakref
from typing import ClassVar

import torch

from ..kernels.hf import cache_kwarg
from .base import ColumnPositions, Draft, Drafter, crop_cache, croppable_cache, left_padding
from .quantized_draft import check_scheme, quantized_draft
from .sampling import Sampler
from .schedule import cached_draft_cost, cached_verify_costs, confidence_stops

logger = logging.getLogger(__name__)

_SPECIAL = ("bos_token_id", "eos_token_id")


def check_same_vocabulary(draft_model, target, draft_tokenizer=None, target_tokenizer=None) -> None:
    """Refuse a draft that does not share the target's vocabulary (speculative decoding compares draft and target
    distributions token id by token id: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
    2023, arXiv 2211.17192).

    Parameters
    ----------
    draft_model, target : transformers.PreTrainedModel
        Their ``config.vocab_size`` (logit widths) and BOS/EOS ids must match (``None`` on one side is not checked).
    draft_tokenizer, target_tokenizer : tokenizer, optional
        When both are given, their ``get_vocab()`` maps must be identical.

    Raises
    ------
    ValueError
        On any mismatch; the message says to use a draft trained with the target's tokenizer.
    """
    fix = "use a draft model trained with the target's tokenizer (e.g. micro-draft for micro-lm)"
    dv = getattr(draft_model.config, "vocab_size", None)
    tv = getattr(target.config, "vocab_size", None)
    if dv != tv:
        raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}); {fix}")
    for name in _SPECIAL:
        d, t = getattr(draft_model.config, name, None), getattr(target.config, name, None)
        if d is not None and t is not None and d != t:
            raise ValueError(f"the draft model's {name} ({d}) differs from the target's ({t}): a different tokenizer; "
                             f"{fix}")
    if (draft_tokenizer is not None and target_tokenizer is not None
            and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()):
        raise ValueError(f"the draft model's tokenizer maps tokens to ids differently from the target's; {fix}")


class DraftModel(Drafter):
    """Speculative decoding with a separate, smaller draft LM (Leviathan et al., "Fast Inference from Transformers via
    Speculative Decoding", 2023, arXiv 2211.17192; Chen et al., "Accelerating Large Language Model Decoding with
    Speculative Sampling", 2023, arXiv 2302.01318).

    The draft keeps its own ``DynamicCache`` across steps and crops it to the tokens the target kept, so each step
    costs ``k`` one-or-two-token draft forwards. Its cache only ever holds committed tokens after a verification,
    so it can share steps with another drafter (``cascade:first=prompt_lookup:then=draft``): a step it did not
    draft leaves its cache behind, and its next proposal feeds the missing tokens in one forward. Greedy decoding drafts the argmax; sampling draws from the draft's
    distribution filtered like the target's and hands it (``q``, [B, k, V]) to verification.

    Parameters
    ----------
    model : str or transformers.PreTrainedModel
        A model object, or a name loaded lazily with :func:`mmaccel.models.load` on the target's device and dtype
        (a zoo name such as ``"micro-draft"``, a local checkpoint directory, or a hub id).
    tokenizer : tokenizer, optional
        The draft's tokenizer (loaded with the model when ``model`` is a name).
    target_tokenizer : tokenizer, optional
        The target's tokenizer; when given, vocabularies are compared entry by entry at :meth:`begin`.
    stop_below : float or "auto", optional
        SpecDec++-style early stop (Huang et al., 2024, arXiv 2405.19715, training-free analogue): stop drafting
        once the draft's estimate of "all drafted tokens accepted", the product of its top-1 probabilities (the
        minimum over rows), falls below this value, in ``(0, 1)``. ``"auto"`` derives the threshold per position
        from costs measured once per (draft, target) pair on this machine: the draft's one-token forward over the
        target's (:func:`~mmaccel.speculative.schedule.cached_draft_cost`) plus the marginal cost of one more
        verified token (:func:`~mmaccel.speculative.schedule.cached_verify_costs`), see
        :func:`~mmaccel.speculative.schedule.confidence_stops`; pair it with a long ``k`` (``k=16``). ``None``
        (default) always drafts ``k`` tokens.
    quantize : {"int8"}, optional
        Draft with an int8 copy of the draft model (:func:`~mmaccel.speculative.quantized_draft.quantized_draft`:
        float32 on the CPU only). The target still verifies every token, so greedy output is unchanged; the draft's
        proposals, hence the acceptance rate, may differ.

    Raises
    ------
    ValueError
        At :meth:`begin`: a draft whose vocabulary size, BOS/EOS ids or tokenizer differ from the target's, or one
        that cannot be quantized as asked; at construction, ``stop_below`` outside ``(0, 1)`` or an unknown
        ``quantize``.
    """

    name: ClassVar[str] = "draft"
    observes_any_draft: ClassVar[bool] = True
    folds_prefill: ClassVar[bool] = True  # it prefills its own cache from the token ids

    def __init__(self, model="micro-draft", tokenizer=None, target_tokenizer=None,
                 stop_below: float | str | None = None, quantize: str | None = None):
        check_scheme(quantize, self.name)
        self.auto_stop = isinstance(stop_below, str) and stop_below.strip().lower() == "auto"
        if stop_below is not None and not self.auto_stop and (
                isinstance(stop_below, (str, bool)) or not 0.0 < float(stop_below) < 1.0):
            raise ValueError(f"stop_below must be in (0, 1), 'auto' or None, got {stop_below!r}")
        self.model_ref = model
        self.model = None if isinstance(model, str) else model
        self.tokenizer = tokenizer
        self.target_tokenizer = target_tokenizer
        self.stop_below = stop_below
        self.quantize = quantize
        self._cache = None
        self._checked = None
        self._forwards = 0

    def _load(self, target) -> None:
        if self.model is None:
            from ..models import load

            dtype = next(target.parameters()).dtype
            with torch.inference_mode(False):  # real parameters, not inference tensors, even from generation
                self.model, self.tokenizer = load(self.model_ref, device=str(target.device), dtype=dtype)
            logger.info("loaded draft model %s", self.model_ref)
        self.model = quantized_draft(self.model, self.quantize, self.name)

    def draft_modules(self) -> list:
        """The draft model, once loaded (:meth:`begin`, or the harness's ``prepare``)."""
        return [] if self.model is None else [self.model]

    def begin(self, target, input_ids, attention_mask, sampler: Sampler) -> None:
        """Load the draft if needed, check its vocabulary against the target's (once per target, draft and tokenizer
        objects), start a fresh draft cache.

        Raises
        ------
        ValueError
            A different vocabulary size, BOS/EOS ids or tokenizer (see :func:`check_same_vocabulary`).
        """
        self._load(target)
        checked = (self.model, self.tokenizer, self.target_tokenizer)
        last = self._checked  # (weakref to the target, draft, tokenizers) of the last passed check
        if last is None or last[0]() is not target or any(a is not b for a, b in zip(last[1:], checked)):
            check_same_vocabulary(self.model, target, self.tokenizer, self.target_tokenizer)  # ~1 ms per 2k vocab
            self._checked = (weakref.ref(target), *checked)
        self._cache = croppable_cache(self.model.config)
        self._device = next(self.model.parameters()).device
        self._pads = left_padding(attention_mask)
        if self._pads is not None:
            self._pads = self._pads.to(self._device)
        self._positions = ColumnPositions(self._pads, input_ids.shape[0], self._device,
                                          capacity=2 * input_ids.shape[1] + 64)
        self._forwards = 0
        self._proposed = 0
        self._stops = self._costs = None
        if self.auto_stop:  # measured once per (draft, target) objects; seconds in the telemetry
            verify, verify_s = cached_verify_costs(target)
            cost, cost_s = cached_draft_cost(self.model, target)
            self._stops = confidence_stops(cost, verify, 64)
            self._costs = {"draft_cost": round(cost, 4), "stop_thresholds": self._stops[:16],
                           "costs_s": round(verify_s + cost_s, 3)}
        self._last = None  # (the last Draft this drafter returned, the sequence length it was proposed after)

    def _forward(self, tokens: torch.Tensor, end: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Run the draft on the new ``tokens`` [B, n], the sequence's columns ``end - n .. end - 1``; returns the
        logits at the last of them, [B, 1, V].

        ``mask`` [B, >= end] is the sequence's attention mask, used only when the prompt was padded (otherwise the
        forward gets none: every column is real). Positions come from the prompt's pad counts
        (:class:`~mmaccel.speculative.base.ColumnPositions`), not from a pass over the mask.
        """
        logits = self.model(input_ids=tokens, attention_mask=None if self._pads is None else mask[:, :end],
                            position_ids=self._positions(end - tokens.shape[1], end),
                            **cache_kwarg(self.model, self._cache), use_cache=True, logits_to_keep=1).logits
        self._forwards += 1
        return logits

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """Draft up to ``k`` tokens; see :meth:`Drafter.propose`. Returns probabilities [B, k, V] when sampling."""
        seq = sequences if sequences.device == self._device else sequences.to(self._device)
        B, T = seq.shape
        mask = None
        if self._pads is not None:  # the mask of the whole proposal, sliced per forward
            mask = attention_mask.to(self._device)
            mask = torch.cat([mask, mask.new_ones(B, k)], dim=1)
        held = self._cache.get_seq_length()
        forwards0 = self._forwards
        logits = self._forward(seq[:, held:], T, mask)  # [B, 1, V]
        tokens, probs = [], []
        confidence = None
        for i in range(k):
            if sampler.greedy:  # the argmax, [B, 1]; no one-hot distribution (greedy drafts carry no probs)
                tok, p = logits.argmax(dim=-1), None
            else:
                tok, p = sampler.choose(logits[:, -1], generator)
                tok = tok[:, None]
            tokens.append(tok)
            probs.append(p)
            if self.stop_below is not None:
                top1 = (p if p is not None else self.model_probs(logits[:, -1])).max(dim=-1).values
                confidence = top1 if confidence is None else confidence * top1
                limit = self._stops[min(i, len(self._stops) - 1)] if self.auto_stop else self.stop_below
                if float(confidence.min()) < limit:
                    break
            if i + 1 < k:
                logits = self._forward(tok, T + i + 1, mask)
        self._proposed += len(tokens)
        draft_tokens = torch.cat(tokens, dim=1) if len(tokens) > 1 else tokens[0]
        draft_probs = None if sampler.greedy else torch.stack(probs, dim=1)
        draft = Draft(tokens=draft_tokens, probs=draft_probs, forwards=self._forwards - forwards0)
        self._last = (draft, T)
        return draft

    @staticmethod
    def model_probs(logits: torch.Tensor) -> torch.Tensor:
        """Unfiltered softmax of draft logits, [B, V] float32 (the confidence used by ``stop_below`` when greedy)."""
        return logits.float().softmax(dim=-1)

    def observe(self, target_logits, draft: Draft, kept: int) -> None:
        """Crop the draft cache to the committed tokens (the previous sequence + ``kept`` draft tokens); a step
        another drafter drafted (or an empty one) leaves the cache as it is: it holds committed tokens only."""
        if self._last is None or self._last[0] is not draft:
            return
        # the cache holds the previous sequence (T tokens) + d_1 .. d_{k-1}; d_1 .. d_kept stay valid
        crop_cache(self._cache, self._last[1] + kept)
        self._last = None

    def end(self) -> dict:
        """Free the draft cache; report draft forwards and tokens."""
        telemetry = {"draft_model": str(getattr(self.model, "name_or_path", self.model_ref)),
                     "draft_forwards": self._forwards, "draft_tokens": getattr(self, "_proposed", 0),
                     **(getattr(self, "_costs", None) or {})}
        self._cache = self._last = None
        return telemetry
