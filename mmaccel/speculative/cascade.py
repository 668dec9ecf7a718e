"""Cascade: ask drafters in turn each step; the first that proposes a token drafts (copy when a copy pays, else a
model).

The usual pairing is a model-free drafter that abstains on weak matches (the cost-aware ``prompt_lookup``) in front of
a trained one (``eagle``): copy-heavy answers get long copied drafts, free text gets the model's drafts. Every drafter
sees every verification (:meth:`Drafter.observe`), so a stateful one (EAGLE's feature cache, a draft model's KV)
stays in step whichever drafter proposed.

References
----------
Hu et al., "SAM Decoding: Speculative Decoding via Suffix Automaton", 2024, arXiv 2411.10666 (retrieval drafts when
the match is long, an auxiliary drafter otherwise); Saxena, "Prompt Lookup Decoding", 2023; Li et al., "EAGLE", 2024,
arXiv 2401.15077.
"""
from __future__ import annotations

from typing import ClassVar

from ..specs import resolve_nested
from .base import Draft, Drafter
from .sampling import Sampler


def _resolve(drafter, owner: str) -> Drafter:
    """A drafter from an object or a nested spec (``"eagle,head=smollm2-135m-eagle"``: commas for colons)."""
    from .registry import build_drafter

    return resolve_nested(drafter, Drafter, build_drafter, owner, "eagle,head=smollm2-135m-eagle")


class Cascade(Drafter):
    """Try ``first``; when it proposes nothing, ``then`` drafts up to ``then_k`` tokens (SAM Decoding's hybrid of a
    retrieval draft and an auxiliary drafter, Hu et al., 2024, arXiv 2411.10666).

    Parameters
    ----------
    first, then : Drafter or str
        Drafters or nested specs (``cascade:first=prompt_lookup:then=eagle,head=smollm2-135m-eagle``).
    then_k : int
        Most tokens ``then`` drafts per step, ``>= 1`` (the step's ``k`` still caps it); ``first`` gets the step's
        ``k`` (prompt lookup copies up to 16 tokens where a model drafts 3-4).

    Raises
    ------
    ValueError
        An unknown nested spec, ``then_k < 1``, or a drafter whose state only its own drafts can update
        (``observes_any_draft`` false, e.g. a tree drafter).
    """

    name: ClassVar[str] = "cascade"

    def __init__(self, first="prompt_lookup", then="eagle", then_k: int = 4):
        if isinstance(then_k, bool) or not isinstance(then_k, int) or then_k < 1:
            raise ValueError(f"cascade: then_k must be an int >= 1, got {then_k!r}")
        self.first, self.then = _resolve(first, "cascade first"), _resolve(then, "cascade then")
        for d in (self.first, self.then):
            if not d.observes_any_draft:
                raise ValueError(f"cascade: {d.name or type(d).__name__} keeps state that only its own drafts update "
                                 "(a draft model's KV cache), so it cannot share steps with another drafter; use "
                                 "drafters such as prompt_lookup and eagle")
        self.then_k = then_k
        self.lossless = self.first.lossless and self.then.lossless
        self.folds_prefill = self.first.folds_prefill and self.then.folds_prefill

    def draft_modules(self) -> list:
        """Both drafters' networks."""
        return [*self.first.draft_modules(), *self.then.draft_modules()]

    def begin(self, target, input_ids, attention_mask, sampler: Sampler) -> None:
        """Begin both drafters (errors as theirs)."""
        self.first.begin(target, input_ids, attention_mask, sampler)
        self.then.begin(target, input_ids, attention_mask, sampler)
        self._steps = [0, 0]

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """``first``'s draft, or ``then``'s when ``first`` proposes nothing; see :meth:`Drafter.propose`."""
        draft = self.first.propose(sequences, attention_mask, k, sampler, generator)
        if draft.length:
            self._steps[0] += 1
            return draft
        self._steps[1] += 1
        return self.then.propose(sequences, attention_mask, min(k, self.then_k), sampler, generator)

    def observe(self, target_logits, draft: Draft, kept: int) -> None:
        """Both drafters see every verification."""
        self.first.observe(target_logits, draft, kept)
        self.then.observe(target_logits, draft, kept)

    def end(self) -> dict:
        """Both drafters' telemetry, and how many steps each drafted."""
        return {"first": {"name": self.first.name, "steps": self._steps[0], **self.first.end()},
                "then": {"name": self.then.name, "steps": self._steps[1], **self.then.end()}}
