"""The one decoding distribution that drafters and the target share: temperature, then top-k, then top-p.

Lossless speculative sampling (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023,
arXiv 2211.17192; Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling", 2023,
arXiv 2302.01318) reproduces the distribution the *target* would sample from. That distribution must therefore be
the one plain ``model.generate(do_sample=True, temperature=..., top_k=..., top_p=...)`` samples from, and the draft
distribution ``q`` must be filtered the same way, or the acceptance ratio ``p / q`` is computed between the wrong
distributions. :class:`Sampler` implements transformers' warper order and tie rules (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper`` with ``min_tokens_to_keep=1``) once, for both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampler:
    """Greedy (``temperature == 0``) or filtered sampling, applied identically to draft and target logits.

    Parameters
    ----------
    temperature : float
        ``0`` = greedy (argmax); ``> 0`` divides the logits before softmax.
    top_k : int, optional
        Keep the ``top_k`` largest logits (ties at the k-th value are kept, as in transformers); ``None`` or ``0`` =
        off.
    top_p : float, optional
        Nucleus filter in ``(0, 1]``: drop the smallest-probability tokens whose cumulative mass is ``<= 1 - top_p``
        (transformers' rule; the most likely token is always kept); ``None`` or ``1.0`` = off.

    Raises
    ------
    ValueError
        If ``temperature < 0``, ``top_k < 0`` or ``top_p`` is outside ``(0, 1]``.

    Notes
    -----
    Speculative sampling (Leviathan et al., 2023, arXiv 2211.17192; Chen et al., 2023, arXiv 2302.01318) is lossless
    only if ``p`` and ``q`` both come from this one filter.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not 0 <= self.temperature < float("inf")):  # NaN and inf too
            raise ValueError(
                f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature!r}; pass temperature=0.0 for "
                "greedy decoding or a positive value to sample"
            )
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (``temperature == 0``)."""
        return self.temperature == 0

    def filtered_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k and top-p applied to logits; filtered entries become ``-inf``.

        Parameters
        ----------
        logits : torch.Tensor
            [..., V] raw logits, any float dtype.

        Returns
        -------
        torch.Tensor
            [..., V] float32 logits (unchanged values divided by the temperature; greedy leaves them unscaled).
        """
        scores = logits.float()
        if self.greedy:
            return scores
        if self.temperature != 1.0:
            scores = scores / self.temperature
        vocab = scores.shape[-1]
        if self.top_k:
            k = min(self.top_k, vocab)
            kth = torch.topk(scores, k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            remove_sorted = cumulative <= (1 - self.top_p)
            remove_sorted[..., -1:] = False
            remove = remove_sorted.scatter(-1, order, remove_sorted)
            scores = scores.masked_fill(remove, float("-inf"))
        return scores

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The decoding distribution of ``logits``.

        Parameters
        ----------
        logits : torch.Tensor
            [..., V] raw logits.

        Returns
        -------
        torch.Tensor
            [..., V] float32 probabilities summing to 1; for greedy decoding a one-hot of the argmax.
        """
        if self.greedy:
            idx = logits.argmax(dim=-1, keepdim=True)
            return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)
        return self.filtered_logits(logits).softmax(dim=-1)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row: the argmax (greedy) or a sample from :meth:`probs`.

        Parameters
        ----------
        logits : torch.Tensor
            [B, V] raw logits.
        generator : torch.Generator, optional
            Source of randomness for sampling (on the logits' device).

        Returns
        -------
        tokens : torch.LongTensor
            [B] chosen token ids.
        probs : torch.Tensor
            [B, V] float32 distribution they were drawn from (one-hot for greedy).
        """
        probs = self.probs(logits)
        if self.greedy:
            return logits.argmax(dim=-1), probs
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs
