"""Prompt lookup: copy the continuation of an earlier occurrence of the last n-gram (PLD, CopySpec).

Saxena, "Prompt Lookup Decoding", 2023 (github.com/apoorvumang/prompt-lookup-decoding; no paper);
Dumitru et al., "CopySpec: Accelerating LLMs with Speculative Copy-and-Paste Without Compromising Quality", 2025,
arXiv 2502.08923.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Draft, Drafter


class PromptLookup(Drafter):
    """Model-free drafting by n-gram copy from the prompt and the generated text (prompt lookup decoding, Saxena
    2023; CopySpec, Dumitru et al., 2025, arXiv 2502.08923).

    For each row, the last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are searched for in the
    row's earlier tokens (prompt + generated, padding excluded); the ``k`` tokens that followed the most recent
    match with ``k`` tokens after it (else the earliest match, which has the longest continuation) are the draft. Rows without a match propose their last token repeated (a deterministic guess that costs
    nothing and is rejected when wrong). When no row matches, the step proposes nothing and the target decodes one
    token. Drafts are deterministic, so verification treats ``q`` as one-hot and sampling stays lossless.

    Parameters
    ----------
    max_ngram : int
        Longest n-gram matched, ``>= min_ngram`` (default 3).
    min_ngram : int
        Shortest n-gram matched, ``>= 1`` (default 1).

    Raises
    ------
    ValueError
        If ``1 <= min_ngram <= max_ngram`` does not hold.
    """

    name: ClassVar[str] = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"prompt lookup needs integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._hits = self._misses = 0

    def begin(self, target, input_ids, attention_mask, sampler) -> None:
        """Reset the hit counters."""
        self._hits = self._misses = 0

    def lookup(self, tokens: torch.Tensor, k: int) -> torch.Tensor | None:
        """The ``k`` (or fewer) tokens that followed the most recent earlier match of the row's last n-gram.

        Parameters
        ----------
        tokens : torch.LongTensor
            [T] one row without padding.
        k : int
            Maximum draft length.

        Returns
        -------
        torch.LongTensor or None
            [1 .. k] continuation (the most recent match followed by ``k`` tokens, else the earliest match), or
            ``None`` if no n-gram of length ``min_ngram .. max_ngram`` recurs.
        """
        T = tokens.shape[0]
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            pattern = tokens[T - n:]
            windows = tokens[: T - 1].unfold(0, n, 1)  # [T - n, n]: starts 0 .. T - n - 1, all before the suffix
            hits = (windows == pattern).all(dim=1).nonzero().flatten()
            if hits.numel():
                starts = hits + n
                full = starts[starts + k <= T]
                start = int(full[-1]) if full.numel() else int(starts[0])
                return tokens[start: start + k]
        return None

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """See :meth:`Drafter.propose`; ``probs`` is ``None`` (deterministic drafts)."""
        B = sequences.shape[0]
        found = []
        for b in range(B):
            row = sequences[b][attention_mask[b].bool()]
            found.append(self.lookup(row, k))
        self._hits += sum(f is not None for f in found)
        self._misses += sum(f is None for f in found)
        length = max((f.shape[0] for f in found if f is not None), default=0)
        draft = sequences[:, -1:].repeat(1, length)
        for b, f in enumerate(found):
            if f is not None:
                draft[b, : f.shape[0]] = f
                draft[b, f.shape[0]:] = f[-1]
        return Draft(tokens=draft, probs=None, forwards=0)

    def end(self) -> dict:
        """Report how many row-steps found an n-gram match."""
        return {"lookup_hits": self._hits, "lookup_misses": self._misses}
