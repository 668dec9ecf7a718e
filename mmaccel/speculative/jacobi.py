"""Jacobi drafting: the target drafts for itself from the stale predictions of its last verification forward.

Santilli et al., "Accelerating Transformer Inference for Translation via Parallel Decoding", 2023, arXiv 2305.10427;
Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", 2024, arXiv 2402.02057.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Draft, Drafter


class Jacobi(Drafter):
    """Jacobi iteration as a drafter (Santilli et al., 2023, arXiv 2305.10427; the Jacobi window of lookahead
    decoding, Fu et al., 2024, arXiv 2402.02057, without its n-gram pool).

    Every verification forward also predicts a token after each draft token. When ``m`` drafts are kept, the
    predictions made after draft tokens ``m + 1 .. k`` are stale guesses (their context held a rejected token) for the
    positions after the new pending token; they are the next draft, one Jacobi update per step at no extra forward.
    The window is topped up to ``k`` by repeating the last guess; the first step (no guesses yet) proposes the
    pending token repeated. Guesses are argmaxes (deterministic), so sampling stays lossless.

    Notes
    -----
    No draft model and no extra forward: the price is ``k`` extra tokens in each verification forward. Plain Jacobi
    iteration rarely accepts more than one token per step on free text; it gains on repetitive output.
    """

    name: ClassVar[str] = "jacobi"

    def __init__(self):
        self._guess: torch.Tensor | None = None

    def begin(self, target, input_ids, attention_mask, sampler) -> None:
        """Forget any guesses from a previous generation."""
        self._guess = None
        self._from_guess = 0

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """See :meth:`Drafter.propose`; ``probs`` is ``None`` (deterministic drafts)."""
        B = sequences.shape[0]
        guess = self._guess
        if guess is None or guess.shape[1] == 0:
            return Draft(tokens=sequences[:, -1:].repeat(1, k))
        guess = guess[:, :k].to(sequences.device)
        self._from_guess += guess.shape[1]
        if guess.shape[1] < k:
            guess = torch.cat([guess, guess[:, -1:].repeat(1, k - guess.shape[1])], dim=1)
        return Draft(tokens=guess.reshape(B, k))

    def observe(self, target_logits, draft: Draft, kept: int) -> None:
        """Keep the target's predictions after draft tokens ``kept + 1 .. k`` as the next guesses."""
        self._guess = target_logits[:, kept + 1:].argmax(dim=-1)

    def end(self) -> dict:
        """Report how many draft tokens came from Jacobi guesses (the rest were fill)."""
        self._guess = None
        return {"guessed_tokens": self._from_guess}
