"""Speculative Jacobi Decoding (SJD): Jacobi iteration with probabilistic acceptance, for autoregressive image models.

Teng et al., "Accelerating Auto-regressive Text-to-Image Generation with Training-free Speculative Jacobi Decoding",
2024, arXiv 2410.01699 (ICLR 2025).

SJD keeps a window of ``k`` draft tokens after the committed sequence. Each iteration the target runs once over
the pending token and the window; every window token ``x_i`` was *sampled* from the target's distribution at that
position in the previous iteration, ``p_{t-1}``, and is accepted with probability ``min(1, p_t(x_i) / p_{t-1}(x_i))``;
at the first rejection the token is resampled from ``norm(max(0, p_t - p_{t-1}))``. That is speculative sampling
(Leviathan et al., 2023, arXiv 2211.17192) with the stale distribution as the draft ``q``, so here it is a drafter of
the shared engine (:func:`mmaccel.speculative.speculative_generate`): the drafter samples its window from the target's
stale output and reports it as ``Draft.probs``; the engine verifies, resamples and rolls the KV cache back. Lossless
in distribution at temperature > 0; at temperature 0 the stale samples are argmaxes and the verification exact, so
greedy SJD is plain Jacobi decoding and token-identical to greedy autoregressive decoding.

Positions the previous iteration did not reach are initialised: uniformly at random (the paper's default), or from
spatial neighbours (the token above in the image raster, else the one to its left: the paper's locality-aware
initialisation), or -- our extension for clips -- from the same pixel of the previous frame.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Draft, Drafter
from .sampling import Sampler

INITS = ("random", "neighbour", "previous_frame")


class SpeculativeJacobi(Drafter):
    """SJD as a drafter: the window is resampled from the target's stale distributions, the rest initialised.

    Teng et al., "Accelerating Auto-regressive Text-to-Image Generation with Training-free Speculative Jacobi
    Decoding", 2024, arXiv 2410.01699. The window length is the engine's ``num_draft_tokens``.

    Parameters
    ----------
    init : str
        How window positions without a stale distribution are filled: ``"random"`` (uniform over ``init_tokens``;
        its ``q`` is that uniform distribution), ``"neighbour"`` (the token ``width`` columns back, i.e. the pixel
        above, or the previous token on the first row; ``q`` one-hot) or ``"previous_frame"`` (the token ``frame``
        columns back, the same pixel one frame earlier; ``"neighbour"`` within the first frame).
    width : int, optional
        Tokens per image row; required for ``"neighbour"`` and ``"previous_frame"``.
    frame : int, optional
        Tokens per frame; required for ``"previous_frame"``.
    init_tokens : sequence of int, optional
        Token ids random initialisation draws from (e.g. the image vocabulary); default the whole vocabulary.

    Raises
    ------
    ValueError
        For an unknown ``init``, a missing or non-positive ``width`` / ``frame``, or empty ``init_tokens``.

    Notes
    -----
    Raster positions count from the first generated token (the prompt, e.g. ``... <image>``, is the prefix given to
    :meth:`begin`); every row of a batch shares that start. Telemetry (:meth:`end`): tokens drawn from stale
    distributions and tokens initialised.
    """

    name: ClassVar[str] = "sjd"
    lossless: ClassVar[bool] = True

    def __init__(self, init: str = "random", width: int | None = None, frame: int | None = None,
                 init_tokens=None):
        if init not in INITS:
            raise ValueError(f"unknown SJD init {init!r}; use one of {INITS}")
        for label, value, needed in (("width", width, init != "random"), ("frame", frame, init == "previous_frame")):
            if value is None and needed:
                raise ValueError(f"init={init!r} needs {label}= (tokens per image row / per frame)")
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        if init_tokens is not None:
            init_tokens = torch.as_tensor(list(init_tokens), dtype=torch.long)
            if init_tokens.numel() == 0:
                raise ValueError("init_tokens is empty; pass the token ids random initialisation may draw")
        self.init, self.width, self.frame, self.init_tokens = init, width, frame, init_tokens
        self._stale: torch.Tensor | None = None
        self._start = 0
        self._vocab = 0
        self._counts = {"stale_tokens": 0, "initialised_tokens": 0}

    def begin(self, target, input_ids, attention_mask, sampler) -> None:
        """Remember where the picture starts (after the prompt) and the vocabulary size."""
        self._stale = None
        self._start = int(input_ids.shape[1])
        self._vocab = int(target.get_output_embeddings().weight.shape[0])
        self._counts = {"stale_tokens": 0, "initialised_tokens": 0}

    def _source_offset(self, raster: int) -> int | None:
        """Columns back to copy raster position ``raster`` from (``None``: no neighbour, draw at random)."""
        if self.init == "previous_frame" and raster >= self.frame:
            return self.frame
        within = raster % self.frame if self.init == "previous_frame" else raster
        if within >= self.width:
            return self.width
        return 1 if within >= 1 else None

    def _initialise(self, sequences: torch.Tensor, window: torch.Tensor, probs: torch.Tensor, first: int,
                    generator: torch.Generator | None) -> None:
        """Fill window positions ``first ..`` in place (tokens and their ``q``)."""
        B, k = window.shape
        T = sequences.shape[1]
        pool = self.init_tokens if self.init_tokens is not None else torch.arange(self._vocab)
        pool = pool.to(window.device)
        for j in range(first, k):
            offset = None if self.init == "random" else self._source_offset(T + j - self._start)
            if offset is None:
                pick = torch.randint(len(pool), (B,), device=window.device, generator=generator)
                window[:, j] = pool[pick]
                probs[:, j].zero_()
                probs[:, j, pool] = 1.0 / len(pool)
            else:
                src = T + j - offset
                window[:, j] = sequences[:, src] if src < T else window[:, src - T]
                probs[:, j].zero_()
                probs[:, j].scatter_(1, window[:, j:j + 1], 1.0)

    def propose(self, sequences, attention_mask, k, sampler: Sampler, generator=None) -> Draft:
        """See :meth:`Drafter.propose`: ``k`` tokens with their draft distributions ``probs`` [B, k, V]."""
        B = sequences.shape[0]
        window = sequences.new_zeros(B, k)
        probs = torch.zeros(B, k, self._vocab, dtype=torch.float32, device=sequences.device)
        n_stale = 0
        if self._stale is not None and self._stale.shape[1] > 0:
            stale = self._stale[:, :k].to(sequences.device)
            n_stale = stale.shape[1]
            q = sampler.probs(stale)  # [B, n, V]; one-hot argmax when greedy
            if sampler.greedy:
                window[:, :n_stale] = stale.argmax(dim=-1)
            else:
                window[:, :n_stale] = torch.multinomial(q.reshape(-1, q.shape[-1]), 1,
                                                        generator=generator).reshape(B, n_stale)
            probs[:, :n_stale] = q
        self._initialise(sequences, window, probs, n_stale, generator)
        self._counts["stale_tokens"] += n_stale
        self._counts["initialised_tokens"] += k - n_stale
        return Draft(tokens=window, probs=probs)

    def observe(self, target_logits, draft: Draft, kept: int) -> None:
        """Keep the target's logits after draft tokens ``kept + 1 .. k``: the next window's stale distributions."""
        self._stale = target_logits[:, kept + 1:]

    def end(self) -> dict:
        """Report how many window tokens came from stale distributions and how many were initialised."""
        self._stale = None
        return {"init": self.init, **self._counts}
