"""Prompt lookup: copy the continuation of an earlier occurrence of the last tokens (PLD, CopySpec), drafting only
when the copy is expected to pay for its verification.

Saxena, "Prompt Lookup Decoding", 2023 (github.com/apoorvumang/prompt-lookup-decoding; no paper);
Dumitru et al., "CopySpec: Accelerating LLMs with Speculative Copy-and-Paste Without Compromising Quality", 2025,
arXiv 2502.08923; the draft length per step (0 included) as in SmartSpec, Liu et al., "Optimizing Speculative
Decoding for Serving Large Language Models Using Goodput", 2024, arXiv 2406.14066.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Draft, Drafter
from .schedule import cached_verify_costs, parse_costs


@dataclass
class LookupMatch:
    """The copy source found for one row.

    Attributes
    ----------
    tokens : torch.LongTensor
        [n] the continuation, ``1 <= n <= k``.
    length : int
        Tokens of the row's suffix that match before the source (the match strength, ``min_ngram .. max_ngram``).
    start : int
        Index in the row where the copied continuation starts.
    """

    tokens: torch.Tensor
    length: int
    start: int


class PromptLookup(Drafter):
    """Model-free drafting by copying from the prompt and the generated text (prompt lookup decoding, Saxena 2023;
    CopySpec, Dumitru et al., 2025, arXiv 2502.08923), with a cost-aware draft length that is 0 on weak matches.

    Matching: the occurrences of the row's last ``min_ngram`` tokens earlier in the row (prompt + generated, padding
    excluded) are extended backwards up to ``max_ngram`` tokens; the most recent of the longest matches is the
    source and its length ``l`` the match strength. The draft copies what followed the source; with ``extend`` a
    source close to the end continues periodically (a repeated phrase or loop: CopySpec's copy of up to ``k``
    tokens), so every match can supply ``k`` tokens.

    Draft length: per match strength ``l`` the drafter estimates ``p1`` (the first copied token is accepted) and
    ``alpha`` (each further one is, given the previous was), both with a prior (:meth:`chances`, weight
    ``prior_weight``) updated from every step of the generation -- steps that drafted nothing included: the drafter
    compares what it would have copied with the tokens that were committed.
    It proposes the ``k`` in ``0 .. k_max`` with the most expected tokens per unit of cost,
    ``(1 + p1 (1 - alpha^k) / (1 - alpha)) / (1 + verify_cost k)`` (Leviathan et al., 2023, arXiv 2211.17192,
    Sec. 3.5, with the first token apart). ``k = 0`` (no match, or a weak one) makes the step a plain decoding step:
    one target forward of one token. A batch drafts one length for all rows from the product of the rows' chances
    (the engine commits the rows' minimum). Drafts are deterministic (``probs=None``), so sampling stays lossless.

    Parameters
    ----------
    max_ngram : int
        Longest match measured, ``>= min_ngram`` (default 8; 3 in PLD).
    min_ngram : int
        Shortest match used, ``>= 1`` (default 1).
    verify_cost : float
        Extra cost of one more token in a verification forward relative to a one-token forward, ``>= 0`` (default
        0.15: smollm2-135m on a CPU, where 4 tokens cost 1.7 one-token forwards; about 0.01 on a GPU). ``0`` drafts
        the full ``k`` on every match (classic PLD).
    extend : bool
        Continue a source that reaches the end of the row periodically (default ``True``); ``False`` copies only
        the tokens that exist (PLD), preferring the most recent source with ``k`` tokens after it.
    prior_weight : float
        Pseudo-observations of the priors of ``p1`` and ``alpha``, ``> 0``.
    decay : float
        Weight of the past per new observation of a match strength, in ``(0, 1]`` (1 = all steps alike).
    verify_costs : str or list of float, optional
        Measured costs of verifying ``1, 2, ..., n`` draft tokens (a forward of ``k + 1`` tokens over a one-token
        forward), e.g. ``"1.03,1.19,1.67"`` or :func:`mmaccel.speculative.schedule.measure_verify_costs`; replaces
        the linear ``verify_cost`` and caps the draft at ``n`` tokens. On CPUs the curve is not linear (matrix
        kernels change with the token count), so a measured table picks better lengths. ``"auto"``: measured on
        the target at the first generation (:func:`~mmaccel.speculative.schedule.cached_verify_costs`: drafts of 1,
        2, 4, ..., 32 tokens interpolated to 32 entries, a 256-token random context, wall clock, the median of 3;
        once per model object, so a warm-up run pays it;
        the seconds are in the telemetry as ``verify_costs_s``). It measures the model as it is then (packed
        linears, dtype, threads) and reads no prompt.

    Raises
    ------
    ValueError
        If ``1 <= min_ngram <= max_ngram`` does not hold, ``verify_cost < 0``, ``prior_weight <= 0``, ``decay``
        is outside ``(0, 1]`` or ``verify_costs`` is not a list of positive numbers.
    """

    name: ClassVar[str] = "prompt_lookup"
    observes_any_draft: ClassVar[bool] = True  # it learns from the committed tokens alone
    folds_prefill: ClassVar[bool] = True  # it reads token ids only

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, verify_cost: float = 0.15, extend: bool = True,
                 prior_weight: float = 2.0, decay: float = 0.9, verify_costs: str | None = None):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"prompt lookup needs integers 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        if not isinstance(verify_cost, (int, float)) or verify_cost < 0:
            raise ValueError(f"prompt lookup: verify_cost must be a number >= 0 (0 = always draft k), "
                             f"got {verify_cost!r}")
        if not prior_weight > 0 or not 0 < decay <= 1:
            raise ValueError(f"prompt lookup: prior_weight must be > 0 and decay in (0, 1], got {prior_weight!r}, "
                             f"{decay!r}")
        self.auto_costs = isinstance(verify_costs, str) and verify_costs.strip().lower() == "auto"
        self.costs = parse_costs(verify_costs) if verify_costs is not None and not self.auto_costs else None
        self._costs_s = 0.0
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.verify_cost, self.extend = float(verify_cost), bool(extend)
        self.prior_weight, self.decay = float(prior_weight), float(decay)
        self.begin(None, None, None, None)

    # ------------------------------------------------------------------------------------------- matching
    def match(self, tokens: torch.Tensor, k: int) -> LookupMatch | None:
        """The copy source of one row and the ``k`` (or fewer, without ``extend``) tokens it supplies.

        Parameters
        ----------
        tokens : torch.LongTensor
            [T] one row without padding.
        k : int
            Tokens wanted, ``>= 1``.

        Returns
        -------
        LookupMatch or None
            ``None`` if the last ``min_ngram`` tokens do not occur earlier.
        """
        T, n0 = tokens.shape[0], self.min_ngram
        if T <= n0:
            return None
        windows = tokens[: T - 1].unfold(0, n0, 1)  # [T - n0, n0]: occurrences ending before the last token
        ends = ((windows == tokens[T - n0:]).all(dim=1).nonzero().flatten() + n0)  # continuation starts, ascending
        if not ends.numel():
            return None
        depth = min(self.max_ngram, T - 1) - n0
        if depth > 0:  # extend each occurrence backwards: how many more tokens before it match the row's suffix
            back = torch.arange(n0 + 1, n0 + depth + 1, device=tokens.device)  # [depth]
            src = ends[:, None] - back[None]  # [C, depth]
            same = (tokens[src.clamp_min(0)] == tokens[T - back][None]) & (src >= 0)
            lengths = n0 + same.long().cumprod(dim=1).sum(dim=1)
        else:
            lengths = torch.full_like(ends, n0)
        strongest = int(lengths.max())
        ends = ends[lengths == strongest]
        if self.extend:
            start = int(ends[-1])
            idx = start + torch.arange(k, device=tokens.device) % (T - start)  # periodic past the row's end
            return LookupMatch(tokens[idx], strongest, start)
        full = ends[ends + k <= T]
        start = int(full[-1]) if full.numel() else int(ends[0])
        return LookupMatch(tokens[start: start + k], strongest, start)

    def lookup(self, tokens: torch.Tensor, k: int) -> torch.Tensor | None:
        """The continuation of :meth:`match` (``[1 .. k]`` tokens), or ``None`` without a match."""
        found = self.match(tokens, k)
        return None if found is None else found.tokens

    # ------------------------------------------------------------------------------------------- statistics
    def chances(self, length: int) -> tuple[float, float]:
        """Current estimates ``(p1, alpha)`` for a match of strength ``length``: the first copied token is accepted,
        and each further one is given the previous was.

        The prior of ``p1`` is ``l / (l + 2)`` times how the generation's copies did so far against that prior over
        all strengths (a model that does not copy makes every strength, even one not seen yet, less likely); the
        prior of ``alpha`` is ``(l + 2) / (l + 3)``.
        """
        w = self.prior_weight
        first, first_ok, more, more_ok = self._stats.get(length, (0.0, 0.0, 0.0, 0.0))
        seen_ok, expected = self._overall  # all strengths: accepted first tokens vs what the priors expected
        prior = min(length / (length + 2) * (seen_ok + w) / (expected + w), 0.99)
        p1 = (first_ok + w * prior) / (first + w)
        alpha = (more_ok + w * (length + 2) / (length + 3)) / (more + w)
        return p1, alpha

    def draft_length(self, p1: float, alpha: float, k: int) -> int:
        """The draft length in ``0 .. k`` with the most expected tokens per unit of verification cost, where the
        ``i``-th copied token is accepted with probability ``p1 * alpha^(i-1)``; 0 when no draft pays."""
        if self.costs is not None:
            k = min(k, len(self.costs))
        best, best_rate, expected, survive = 0, 1.0, 1.0, p1
        for n in range(1, k + 1):
            expected += survive
            survive *= alpha
            rate = expected / (self.costs[n - 1] if self.costs is not None else 1.0 + self.verify_cost * n)
            if rate > best_rate + 1e-12:
                best, best_rate = n, rate
        return best

    def _learn(self, length: int, guess: list, committed: list) -> None:
        """Record how many of the ``guess`` tokens the committed tokens confirmed (censored at the shorter)."""
        n = min(len(guess), len(committed))
        if n == 0:
            return
        ok = 0
        while ok < n and guess[ok] == committed[ok]:
            ok += 1
        d = self.decay
        first, first_ok, more, more_ok = self._stats.get(length, (0.0, 0.0, 0.0, 0.0))
        first, first_ok = d * first + 1.0, d * first_ok + (ok >= 1)
        seen_ok, expected = self._overall
        self._overall = (d * seen_ok + (ok >= 1), d * expected + length / (length + 2))
        if ok >= 1:  # continuation: ok - 1 accepted, then one rejection unless censored
            more_ok = d * more_ok + ok - 1
            more = d * more + ok - 1 + (ok < n)
        self._stats[length] = (first, first_ok, more, more_ok)

    # ------------------------------------------------------------------------------------------- drafter
    def begin(self, target, input_ids, attention_mask, sampler) -> None:
        """Forget the acceptance statistics and counters of a previous generation (with ``verify_costs="auto"``,
        first measure the target's cost table if this model object has none yet)."""
        if self.auto_costs and target is not None:
            self.costs, self._costs_s = cached_verify_costs(target)
        self._stats: dict[int, tuple] = {}
        self._overall = (0.0, 0.0)
        self._pending: list = []
        self._hits = self._misses = self._drafted = self._held_back = 0

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """See :meth:`Drafter.propose`: ``0 .. k`` copied tokens per row; ``probs`` is ``None``."""
        B = sequences.shape[0]
        rows = [sequences[b] if bool(attention_mask[b, 0]) else sequences[b][attention_mask[b].bool()]
                for b in range(B)]
        for (length, guess, seen), row in zip(self._pending, rows):  # what the last step's copies would have got
            if length:
                self._learn(length, guess, row[seen:].tolist())
        found = [self.match(row, k) for row in rows]
        self._pending = [(f.length, f.tokens.tolist(), row.shape[0]) if f is not None else (0, None, 0)
                         for f, row in zip(found, rows)]
        hits = sum(f is not None for f in found)
        self._hits += hits
        self._misses += B - hits
        n = 0
        if hits == B:  # one length for all rows: the step commits the rows' minimum
            p1, alpha = 1.0, 1.0
            for f in found:
                p, a = self.chances(f.length)
                p1, alpha = p1 * p, alpha * a
            n = self.draft_length(p1, alpha, min(k, min(f.tokens.shape[0] for f in found)))
        if n == 0:
            self._held_back += hits == B
            return Draft(tokens=sequences.new_zeros(B, 0))
        self._drafted += 1
        return Draft(tokens=torch.stack([f.tokens[:n] for f in found]), probs=None, forwards=0)

    def end(self) -> dict:
        """Report row-steps with and without a match, steps that drafted, and matched steps held back (k = 0)."""
        return {"lookup_hits": self._hits, "lookup_misses": self._misses, "drafted_steps": self._drafted,
                "held_back_steps": self._held_back,
                **({"verify_costs": self.costs, "verify_costs_s": round(self._costs_s, 3)} if self.auto_costs else {})}
