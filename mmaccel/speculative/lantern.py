"""LANTERN: relaxed speculative acceptance over latent neighbourhoods of visual tokens (lossy by design).

Jang et al., "LANTERN: Accelerating Visual Autoregressive Models with Relaxed Speculative Decoding", 2024,
arXiv 2410.03355 (ICLR 2025).

Image tokens are interchangeable with their neighbours in latent space (VQ codes that decode to nearly the same
patch; here palette colours of nearly the same RGB), and an image model spreads its probability over them, so exact
speculative acceptance rejects drafts the picture would not miss. LANTERN lets a draft token ``x`` take the target
probability of its nearest latent neighbours: with ``B_k(x)`` = ``x`` and its ``k - 1`` nearest other tokens, the
neighbours are added in order of distance while the mass moved stays within ``delta``,

    A(x) = the longest prefix of B_k(x) \\ {x} with  sum_{y in A(x)} p(y) <= delta,
    p~(x) = p(x) + sum_{y in A(x)} p(y),   p~(y) = 0 for y in A(x),

so that the total variation between ``p`` and ``p~`` is at most ``delta``. Verification then runs on ``p~``: accept
with ``min(1, p~(x) / q(x))``, resample from ``norm(max(0, p~ - q))``; greedy verification accepts ``x`` when it is
the argmax of ``p~`` (``p`` at temperature 1 there). ``k = 1`` or ``delta = 0`` gives back plain verification.

Here LANTERN wraps a drafter (default :class:`~mmaccel.speculative.sjd.SpeculativeJacobi`): while a generation runs,
a forward hook on the target (registered in :meth:`Lantern.begin`, removed in :meth:`Lantern.end`) rewrites the
logits of each verification forward at the positions followed by a draft token, so the shared engine's unchanged
verification applies the relaxed rule. The inner drafter observes the logits before relaxation (SJD's stale ``q`` is
the target's own ``p``), so relaxation only ever raises the acceptance ratio ``p~(x) / q(x)``.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .base import Draft, Drafter
from .sampling import Sampler
from .sjd import SpeculativeJacobi


def latent_neighbours(latents: torch.Tensor, k: int, *, vocab_size: int | None = None,
                      token_ids=None) -> torch.Tensor:
    """The ``k`` nearest tokens of each token by L2 distance between latent vectors (itself first).

    Parameters
    ----------
    latents : torch.Tensor
        [N, D] one latent per token: VQ codebook vectors, input embeddings (``model.get_input_embeddings().weight``)
        or palette RGB values.
    k : int
        Neighbourhood size, ``1 <= k``; capped at ``N``.
    vocab_size : int, optional
        Rows of the table (default ``N``); tokens without a latent get only themselves.
    token_ids : sequence of int, optional
        Token id of each latent row (default ``0 .. N - 1``).

    Returns
    -------
    torch.LongTensor
        [vocab_size, k] token ids, nearest first, column 0 the token itself; ``-1`` where a token has fewer
        neighbours.

    Raises
    ------
    ValueError
        If ``k < 1``, ``latents`` is not 2-D, or ``token_ids`` does not match it.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1 (1 = the token alone, no relaxation), got {k!r}")
    latents = torch.as_tensor(latents).detach().float().cpu()
    if latents.dim() != 2:
        raise ValueError(f"latents must be [N, D], got shape {tuple(latents.shape)}")
    n = latents.shape[0]
    ids = torch.arange(n) if token_ids is None else torch.as_tensor(list(token_ids), dtype=torch.long)
    if ids.shape != (n,):
        raise ValueError(f"token_ids has {ids.numel()} entries for {n} latents")
    V = n if vocab_size is None else int(vocab_size)
    dist = torch.cdist(latents, latents)
    dist.fill_diagonal_(-1.0)  # the token itself first, even when two latents coincide
    order = dist.argsort(dim=1, stable=True)[:, : min(k, n)]
    table = torch.full((V, k), -1, dtype=torch.long)
    table[:, 0] = torch.arange(V)
    table[ids, : order.shape[1]] = ids[order]
    return table


def relax(probs: torch.Tensor, tokens: torch.Tensor, neighbours: torch.Tensor, k: int, delta: float):
    """LANTERN's relaxed target distributions ``p~`` for draft tokens (see the module docstring).

    Parameters
    ----------
    probs : torch.Tensor
        [B, n, V] target probabilities at the positions the draft tokens fill.
    tokens : torch.LongTensor
        [B, n] the draft tokens ``x``.
    neighbours : torch.LongTensor
        [V, >= k] from :func:`latent_neighbours` (column 0 the token itself, ``-1`` padding).
    k : int
        Neighbourhood size used (``1`` = no relaxation).
    delta : float
        Most probability mass moved onto ``x`` (the total-variation bound), ``>= 0``.

    Returns
    -------
    relaxed : torch.Tensor
        [B, n, V] ``p~``: the neighbours' mass moved onto ``x``; still sums to 1.
    moved : torch.Tensor
        [B, n] the mass moved (the total variation between ``p`` and ``p~``).
    """
    if k <= 1 or tokens.shape[1] == 0:
        return probs, probs.new_zeros(tokens.shape)
    cand = neighbours.to(tokens.device)[tokens][..., 1:k]  # [B, n, k-1]
    valid = cand >= 0
    cand = torch.where(valid, cand, tokens[..., None])
    p_cand = probs.gather(-1, cand) * valid
    take = (p_cand.cumsum(-1) <= delta) & valid  # a prefix: the cumulative sum never falls
    moved = (p_cand * take).sum(-1)
    out = probs.scatter(-1, cand, torch.where(take, torch.zeros_like(p_cand), probs.gather(-1, cand)))
    out = out.scatter_add(-1, tokens[..., None], moved[..., None])
    return out, moved


class Lantern(Drafter):
    """LANTERN relaxed acceptance around any chain drafter (lossy: ``lossless = False``).

    Jang et al., "LANTERN: Accelerating Visual Autoregressive Models with Relaxed Speculative Decoding", 2024,
    arXiv 2410.03355.

    Parameters
    ----------
    drafter : Drafter, optional
        The drafter whose tokens are verified with relaxed acceptance; default
        :class:`~mmaccel.speculative.sjd.SpeculativeJacobi` built from ``sjd_kwargs``.
    k : int
        Latent neighbourhood size ``|B_k(x)|``, ``>= 1`` (LANTERN's ``lantern_k``; 1 = plain verification).
    delta : float
        Total-variation bound, in ``[0, 1]`` (LANTERN's ``lantern_delta``; 0 = plain verification).
    neighbours : torch.LongTensor, optional
        [V, >= k] neighbour table (:func:`latent_neighbours`), e.g. by palette colour distance. Default: built in
        :meth:`begin` from the target's input embeddings.
    **sjd_kwargs
        ``init``, ``width``, ``frame``, ``init_tokens`` of the default SJD drafter (only without ``drafter``).

    Raises
    ------
    ValueError
        ``k < 1``, ``delta`` outside ``[0, 1]``, a neighbour table narrower than ``k``, ``sjd_kwargs`` together
        with ``drafter``, or (at :meth:`begin`) a table whose rows do not cover the vocabulary, or ``top_p`` sampling
        (the nucleus of ``p~`` would be filtered a second time by the engine).
    TypeError
        If ``drafter`` is not a chain :class:`Drafter`.

    Notes
    -----
    Telemetry (:meth:`end`): the inner drafter's, plus ``lantern_k``, ``lantern_delta``, ``relaxed_positions``
    (verified draft positions where mass was moved) and ``mean_moved_mass``.
    """

    name: ClassVar[str] = "lantern"
    lossless: ClassVar[bool] = False

    def __init__(self, drafter: Drafter | None = None, *, k: int = 4, delta: float = 0.1,
                 neighbours: torch.Tensor | None = None, **sjd_kwargs):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1 (1 = no relaxation), got {k!r}")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 <= delta <= 1.0:
            raise ValueError(f"delta must be a number in [0, 1] (0 = no relaxation), got {delta!r}")
        if drafter is not None and sjd_kwargs:
            raise ValueError(f"{sorted(sjd_kwargs)} configure the default SJD drafter; pass them to the drafter "
                             "you give instead")
        if drafter is None:
            drafter = SpeculativeJacobi(**sjd_kwargs)
        if not isinstance(drafter, Drafter) or isinstance(drafter, Lantern):
            raise TypeError(f"drafter must be a chain Drafter, got {type(drafter).__name__}")
        if neighbours is not None:
            neighbours = torch.as_tensor(neighbours, dtype=torch.long)
            if neighbours.dim() != 2 or neighbours.shape[1] < k:
                raise ValueError(f"neighbours must be [V, >= k={k}], got shape {tuple(neighbours.shape)}; build it "
                                 "with latent_neighbours(..., k)")
        self.drafter, self.k, self.delta, self.neighbours = drafter, k, float(delta), neighbours
        self._table: torch.Tensor | None = None
        self._hook = None
        self._raw: torch.Tensor | None = None
        self._sampler: Sampler | None = None
        self._stats = {"relaxed_positions": 0, "verified_positions": 0, "moved_mass": 0.0}

    def begin(self, target, input_ids, attention_mask, sampler) -> None:
        """Start the inner drafter and hook the target's forward (relaxed logits at draft positions)."""
        if sampler.top_p is not None and sampler.top_p < 1.0:
            raise ValueError("LANTERN relaxes the filtered target distribution, and top_p would filter it again; "
                             "use temperature and top_k only")
        V = int(target.get_output_embeddings().weight.shape[0])
        table = self.neighbours
        if table is None:
            table = latent_neighbours(target.get_input_embeddings().weight, self.k)
        if table.shape[0] < V:
            raise ValueError(f"the neighbour table has {table.shape[0]} rows for a vocabulary of {V}; pass "
                             "latent_neighbours(..., vocab_size=V)")
        self._table = table[:V, : self.k].to(input_ids.device)
        self._sampler = sampler
        self._stats = {"relaxed_positions": 0, "verified_positions": 0, "moved_mass": 0.0}
        self.drafter.begin(target, input_ids, attention_mask, sampler)
        self._hook = target.register_forward_hook(self._relax_hook, with_kwargs=True)

    def _relax_hook(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if ids is None or logits is None:
            return output
        n = logits.shape[1]
        if n < 2 or ids.shape[1] < n:
            return output  # the prefill (one kept logit): no draft token follows it
        tokens = ids[:, ids.shape[1] - n + 1:]  # [B, n - 1] the draft tokens each position verifies
        sampler = self._sampler
        p = logits[:, :-1].float().softmax(-1) if sampler.greedy else sampler.probs(logits[:, :-1])
        p_relaxed, moved = relax(p, tokens, self._table, self.k, self.delta)
        self._raw = logits  # what the inner drafter observes: its stale q must be the target's own p
        if bool((moved > 0).any()):
            new = p_relaxed.clamp_min(0).log()
            if not sampler.greedy:
                new = new * sampler.temperature  # the engine divides by the temperature again
            # positions where nothing moved keep their logits bit for bit (k = 1 or delta = 0: plain verification)
            new = torch.where((moved > 0)[..., None], new.to(logits.dtype), logits[:, :-1])
            output.logits = torch.cat([new, logits[:, -1:]], dim=1)
        self._stats["verified_positions"] += moved.numel()
        self._stats["relaxed_positions"] += int((moved > 0).sum())
        self._stats["moved_mass"] += float(moved.sum())
        return output

    def propose(self, sequences, attention_mask, k, sampler, generator=None) -> Draft:
        """The inner drafter's proposal."""
        return self.drafter.propose(sequences, attention_mask, k, sampler, generator)

    def observe(self, target_logits, draft: Draft, kept: int) -> None:
        """Pass the verification forward's logits *before* relaxation on to the inner drafter.

        SJD samples its next window from them; relaxed logits would put the moved mass on the old draft token in
        ``q`` as well and lower the next acceptance ratio ``p~ / q``.
        """
        raw = self._raw if self._raw is not None and self._raw.shape == target_logits.shape else target_logits
        self._raw = None
        self.drafter.observe(raw, draft, kept)

    def end(self) -> dict:
        """Remove the hook; the inner drafter's telemetry plus LANTERN's parameters and relaxation counts."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._raw = None
        inner = self.drafter.end()
        n = self._stats["verified_positions"]
        return {**inner, "inner_drafter": getattr(self.drafter, "name", type(self.drafter).__name__),
                "lantern_k": self.k, "lantern_delta": self.delta, "lossless": False,
                "relaxed_positions": self._stats["relaxed_positions"], "verified_positions": n,
                "mean_moved_mass": self._stats["moved_mass"] / n if n else 0.0}
