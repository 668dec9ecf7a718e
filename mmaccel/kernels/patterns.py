"""Per-head sparse attention patterns and the one pattern -> block-mask computation every backend shares.

Every pattern reduces to one token rule. With the ``Lq`` queries at the last ``Lq`` of the ``Lk`` key positions
(absolute query position ``qa = Lk - Lq + i``), key ``k`` is attended when

    k <= qa  and  (k < sink  or  qa - k < window  or  table[qa // g, k // g])

- :class:`Dense`: ``window = inf``.
- :class:`Streaming`: ``sink`` first tokens plus the last ``window`` tokens (StreamingLLM; DuoAttention's streaming
  heads; the "A-shape" of MInference).
- :class:`Chunked`: full attention inside a chunk of ``chunk_size`` tokens, plus sinks and selected earlier chunks
  (Video-XL-2's chunk-based prefill; LongHeads' per-head chunk selection).
- :class:`BlockSparse`: a block table, e.g. vertical-slash or top-k blocks estimated as in MInference.

:func:`block_plan` turns per-head rules into the kernel-block tables (which blocks are computed at all, and which are
fully inside the pattern so need no token mask). The reference, FlexAttention and Triton backends all read it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

INF_WINDOW = 1 << 30


@dataclass(frozen=True)
class Dense:
    """Full causal attention for a head."""


@dataclass(frozen=True)
class Streaming:
    """Attention sinks plus a sliding window of recent tokens.

    From "Efficient Streaming Language Models with Attention Sinks" (Xiao et al., 2023, arXiv 2309.17453) and
    DuoAttention's streaming heads (Xiao et al., 2024, arXiv 2410.10819).

    Attributes
    ----------
    sink : int
        Number of initial tokens every query attends (>= 0).
    window : int
        Each query attends itself and the ``window - 1`` tokens before it (>= 1).

    Raises
    ------
    ValueError
        On a negative sink or a window below 1.
    """

    sink: int = 4
    window: int = 1024

    def __post_init__(self):
        if self.sink < 0 or self.window < 1:
            raise ValueError(f"Streaming needs sink >= 0 and window >= 1, got sink={self.sink}, window={self.window}")


@dataclass(frozen=True, eq=False)
class Chunked:
    """Full attention within a chunk, sinks plus selected earlier chunks across chunks.

    From "Video-XL-2: Towards Very Long-Video Understanding Through Task-Aware KV Sparsification" (2025,
    arXiv 2506.19225; chunk-based prefill) and "LongHeads: Multi-Head Attention is Secretly a Long Context
    Processor" (Lu et al., 2024, arXiv 2402.10685; per-head chunk selection).

    Attributes
    ----------
    chunk_size : int
        Tokens per chunk (>= 1); chunk ``c`` covers absolute positions ``[c * chunk_size, (c + 1) * chunk_size)``.
    sink : int
        Initial tokens every query attends.
    selected : torch.Tensor, optional
        Extra chunks across: either bool ``[n_chunks, n_chunks]`` (row = query chunk, column = key chunk) or int64
        ``[n_chunks, k]`` key-chunk ids per query chunk, ``-1`` = none. ``n_chunks = ceil(Lk / chunk_size)``.
        Causality still applies.

    Raises
    ------
    ValueError
        On ``chunk_size < 1`` or ``sink < 0``; on use, on a table of the wrong size or out-of-range chunk ids.
    """

    chunk_size: int
    sink: int = 0
    selected: torch.Tensor | None = None

    def __post_init__(self):
        if self.chunk_size < 1 or self.sink < 0:
            raise ValueError(f"Chunked needs chunk_size >= 1 and sink >= 0, got {self.chunk_size}, {self.sink}")


@dataclass(frozen=True, eq=False)
class BlockSparse:
    """Block-sparse attention from a block table: vertical-slash or top-k blocks.

    From "MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention" (Jiang et al.,
    2024, arXiv 2407.02490).

    Attributes
    ----------
    block_index : torch.Tensor
        Either bool ``[n_blocks, n_blocks]`` or int64 ``[n_blocks, k]`` key-block ids per query block (``-1`` = none),
        with ``n_blocks = ceil(Lk / block_size)`` over absolute positions. Causality still applies; a query block
        that selects nothing attends nothing (its output is zero).
    block_size : int
        Tokens per block of the table (independent of the kernels' tile size).

    Raises
    ------
    ValueError
        On ``block_size < 1``; on use, on a table of the wrong size or out-of-range block ids.
    """

    block_index: torch.Tensor
    block_size: int = 64

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"BlockSparse needs block_size >= 1, got {self.block_size}")

    @classmethod
    def from_vertical_slash(
        cls, vertical: torch.Tensor, slash: torch.Tensor, length: int, block_size: int = 64
    ) -> BlockSparse:
        """Blocks covering MInference's vertical lines (key columns) and slash lines (query - key offsets).

        Parameters
        ----------
        vertical : torch.Tensor
            int64 [n_v] key positions every query attends.
        slash : torch.Tensor
            int64 [n_s] offsets ``qa - k >= 0`` every query attends.
        length : int
            Sequence length (``Lk``).
        block_size : int
            Table granularity.

        Returns
        -------
        BlockSparse
            A bool table [n_blocks, n_blocks] with every block that a vertical or slash line crosses.
        """
        n = -(-length // block_size)
        table = torch.zeros(n, n, dtype=torch.bool)
        vb = (vertical.long().clamp(0, length - 1) // block_size).unique()
        table[:, vb] = True
        qb = torch.arange(n)
        for off in slash.long().clamp(0, length - 1).unique().tolist():
            # a slash qa - k = off crosses key blocks (qa_start - off) // bs .. (qa_end - off) // bs
            lo = (qb * block_size - off).clamp(min=0) // block_size
            hi = ((qb + 1) * block_size - 1 - off).clamp(min=0) // block_size
            ok = (qb + 1) * block_size - 1 - off >= 0
            table[qb[ok], lo[ok]] = True
            table[qb[ok], hi[ok].clamp(max=n - 1)] = True
        return cls(table, block_size)


Pattern = Union[Dense, Streaming, Chunked, BlockSparse]
PATTERN_TYPES = (Dense, Streaming, Chunked, BlockSparse)


@dataclass(frozen=True)
class HeadPatterns:
    """One pattern per attention head, so different heads of one call can follow different layouts.

    Attributes
    ----------
    patterns : tuple
        ``Hq`` patterns (one per query head) or ``Hkv`` patterns (one per key/value head, shared by its GQA group).

    Raises
    ------
    TypeError
        If an entry is not a pattern.
    """

    patterns: tuple

    def __post_init__(self):
        object.__setattr__(self, "patterns", tuple(self.patterns))
        for p in self.patterns:
            if not isinstance(p, PATTERN_TYPES):
                raise TypeError(f"HeadPatterns entries must be Dense/Streaming/Chunked/BlockSparse, got {type(p)}")

    def __len__(self) -> int:
        return len(self.patterns)

    @classmethod
    def uniform(cls, pattern: Pattern, num_heads: int) -> HeadPatterns:
        """The same pattern on ``num_heads`` heads."""
        return cls((pattern,) * num_heads)

    def per_query_head(self, num_q_heads: int, num_kv_heads: int) -> tuple:
        """Expand to ``Hq`` patterns.

        Raises
        ------
        ValueError
            If the count is neither ``Hq`` nor ``Hkv``.
        """
        n = len(self.patterns)
        if n == num_q_heads:
            return self.patterns
        if n == num_kv_heads:
            group = num_q_heads // num_kv_heads
            return tuple(p for p in self.patterns for _ in range(group))
        raise ValueError(
            f"a HeadPatterns of {n} heads does not fit {num_q_heads} query heads / {num_kv_heads} key-value heads"
        )


def as_head_patterns(pattern, num_q_heads: int, num_kv_heads: int) -> tuple:
    """Normalise a pattern, a sequence of patterns or a :class:`HeadPatterns` to a tuple of ``Hq`` patterns.

    Raises
    ------
    ValueError
        For the wrong number of heads.
    TypeError
        For something that is not a pattern.
    """
    if isinstance(pattern, PATTERN_TYPES):
        return (pattern,) * num_q_heads
    if not isinstance(pattern, HeadPatterns):
        if not isinstance(pattern, Sequence) or isinstance(pattern, str):
            raise TypeError(f"expected a pattern or HeadPatterns, got {type(pattern).__name__}")
        pattern = HeadPatterns(tuple(pattern))
    return pattern.per_query_head(num_q_heads, num_kv_heads)


@dataclass(frozen=True, eq=False)
class Rule:
    """The token rule of one pattern at a given key length (see the module docstring).

    ``table`` is bool [rows, cols] over ``gran``-token tiles of absolute positions, or None.
    """

    sink: int
    window: int
    gran: int = 1
    table: torch.Tensor | None = None

    def allowed(self, qa: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """bool mask over broadcast absolute query positions ``qa`` and key positions ``k`` (causal included)."""
        ok = (k < self.sink) | ((qa - k) < self.window)
        if self.table is not None:
            t = self.table.to(qa.device)
            ok = ok | t[(qa // self.gran).clamp(max=t.shape[0] - 1), (k // self.gran).clamp(max=t.shape[1] - 1)]
        return ok & (k <= qa)


def _index_table(index: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """bool [n, n] from a bool [n, n] table or int64 [n, k] ids (-1 = none)."""
    if index.dtype == torch.bool:
        if tuple(index.shape) != (n, n):
            raise ValueError(f"{what} bool table must be [{n}, {n}] for this length, got {tuple(index.shape)}")
        return index
    if index.dim() != 2 or index.shape[0] != n:
        raise ValueError(f"{what} index must be [{n}, k] for this length, got {tuple(index.shape)}")
    index = index.long()
    if index.numel() and (index.min() < -1 or index.max() >= n):
        raise ValueError(f"{what} ids must be in [-1, {n}); got min {int(index.min())}, max {int(index.max())}")
    table = torch.zeros(n, n + 1, dtype=torch.bool, device=index.device)
    table.scatter_(1, torch.where(index < 0, n, index), True)
    return table[:, :n]


def make_rule(pattern: Pattern, length: int) -> Rule:
    """The :class:`Rule` of ``pattern`` for ``length`` keys.

    Raises
    ------
    ValueError
        If the pattern's table does not fit ``length`` or holds out-of-range ids.
    """
    if isinstance(pattern, Dense):
        return Rule(0, INF_WINDOW)
    if isinstance(pattern, Streaming):
        return Rule(pattern.sink, pattern.window)
    if isinstance(pattern, Chunked):
        n = -(-length // pattern.chunk_size)
        table = torch.eye(n, dtype=torch.bool)
        if pattern.selected is not None:
            table = table | _index_table(pattern.selected, n, "Chunked.selected").cpu()
        return Rule(pattern.sink, 0, pattern.chunk_size, table)
    if isinstance(pattern, BlockSparse):
        n = -(-length // pattern.block_size)
        return Rule(0, 0, pattern.block_size, _index_table(pattern.block_index, n, "BlockSparse.block_index").cpu())
    raise TypeError(f"not a pattern: {type(pattern).__name__}")


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """Which kernel tiles to compute, per head.

    Attributes
    ----------
    rules : tuple of Rule
        ``Hq`` rules (shared objects for heads with the same pattern).
    head_group : torch.Tensor
        int64 [Hq]: index of each head's distinct rule.
    active : torch.Tensor
        bool [n_rules, n_qb, n_kb]: tile holds at least one attended pair.
    full : torch.Tensor
        bool [n_rules, n_qb, n_kb]: every pair of the tile is attended (no token mask needed).
    block_q, block_k, q_len, k_len : int
        Tile sizes and lengths.
    causal : bool
        False only for all-dense, non-causal plans.
    """

    rules: tuple
    head_group: torch.Tensor
    active: torch.Tensor
    full: torch.Tensor
    block_q: int
    block_k: int
    q_len: int
    k_len: int
    causal: bool = True

    def kv_lists(self, full_only: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head and query tile, the key tiles to visit.

        Parameters
        ----------
        full_only : bool, optional
            None: every active tile; True: only full tiles; False: active but not full tiles.

        Returns
        -------
        (num, idx) : int32 [Hq, n_qb], int32 [Hq, n_qb, n_kb]
            ``idx[h, i, :num[h, i]]`` are the key tiles, ascending; the rest is padding.
        """
        sel = self.active if full_only is None else (self.full if full_only else self.active & ~self.full)
        num = sel.sum(-1, dtype=torch.int32)
        n_kb = sel.shape[-1]
        order = torch.argsort((~sel).to(torch.int8) * n_kb + torch.arange(n_kb, device=sel.device), dim=-1)
        g = self.head_group.to(sel.device)
        return num[g].contiguous(), order.to(torch.int32)[g].contiguous()


def _range_any_all(table: torch.Tensor, r0, r1, c0, c1) -> tuple[torch.Tensor, torch.Tensor]:
    """For tiles spanning table rows r0..r1 and columns c0..c1 (inclusive, 1-D tensors), any / all True."""
    t = table.to(torch.int32)
    integ = torch.zeros(t.shape[0] + 1, t.shape[1] + 1, dtype=torch.int32, device=t.device)
    integ[1:, 1:] = t.cumsum(0).cumsum(1)
    r0, r1, c0, c1 = r0[:, None], r1[:, None] + 1, c0[None, :], c1[None, :] + 1
    total = integ[r1, c1] - integ[r0, c1] - integ[r1, c0] + integ[r0, c0]
    return total > 0, total == (r1 - r0) * (c1 - c0)


def _rule_tiles(rule: Rule, qa0, qa1, k0, k1) -> tuple[torch.Tensor, torch.Tensor]:
    """(active, full) bool [n_qb, n_kb] for one rule; qa0/qa1 and k0/k1 are inclusive tile bounds."""
    Q0, Q1, K0, K1 = qa0[:, None], qa1[:, None], k0[None, :], k1[None, :]
    causal_any, causal_all = K0 <= Q1, K1 <= Q0
    any_ = (K0 < rule.sink) | ((Q0 - K1).clamp(min=0) < rule.window)
    all_ = (K1 < rule.sink) | ((Q1 - K0) < rule.window)
    if rule.table is not None:
        g, t = rule.gran, rule.table.to(qa0.device)
        rows, cols = t.shape
        t_any, t_all = _range_any_all(
            t, (qa0 // g).clamp(max=rows - 1), (qa1 // g).clamp(max=rows - 1),
            (k0 // g).clamp(max=cols - 1), (k1 // g).clamp(max=cols - 1),
        )
        any_, all_ = any_ | t_any, all_ | t_all
    return causal_any & any_, causal_all & all_


def block_plan(
    patterns: tuple, q_len: int, k_len: int, block_q: int, block_k: int, device: torch.device | str = "cpu",
    causal: bool = True,
) -> BlockPlan:
    """Tile tables for ``Hq`` per-head patterns, queries at the last ``q_len`` of ``k_len`` positions.

    Tables are computed once per distinct pattern object (heads sharing a pattern share a row), in
    O(n_qb * n_kb) time and memory, never O(Lq * Lk).

    Raises
    ------
    ValueError
        If ``q_len > k_len``, a pattern's table does not fit ``k_len``, or ``causal=False`` with a sparse pattern.
    """
    if not causal and not all(isinstance(p, Dense) for p in patterns):
        raise ValueError("non-causal plans are only defined for Dense patterns")
    if q_len > k_len:
        raise ValueError(f"sparse prefill needs Lq <= Lk (queries are the last Lq positions), got {q_len} > {k_len}")
    distinct: dict[int, int] = {}
    uniq: list = []
    groups = []
    for p in patterns:
        if id(p) not in distinct:
            distinct[id(p)] = len(uniq)
            uniq.append(p)
        groups.append(distinct[id(p)])
    rules = [make_rule(p, k_len) for p in uniq]
    off = k_len - q_len
    n_qb, n_kb = -(-q_len // block_q), -(-k_len // block_k)
    qs = torch.arange(n_qb, device=device) * block_q
    ks = torch.arange(n_kb, device=device) * block_k
    qa0, qa1 = qs + off, (qs + block_q).clamp(max=q_len) - 1 + off
    k0, k1 = ks, (ks + block_k).clamp(max=k_len) - 1
    if causal:
        tiles = [_rule_tiles(r, qa0, qa1, k0, k1) for r in rules]
        active = torch.stack([a for a, _ in tiles])
        full = torch.stack([f for _, f in tiles])
    else:
        active = full = torch.ones(len(rules), n_qb, n_kb, dtype=torch.bool, device=device)
    head_rules = tuple(rules[g] for g in groups)
    return BlockPlan(
        head_rules, torch.tensor(groups, device=device), active, full, block_q, block_k, q_len, k_len, causal
    )


def head_masks(patterns: tuple, qa: torch.Tensor, k: torch.Tensor, k_len: int, rule_of=make_rule) -> torch.Tensor:
    """bool [Hq, *broadcast(qa, k)] of each head's rule (``rule_of(pattern, k_len)``), once per distinct pattern."""
    cache: dict[int, torch.Tensor] = {}
    for p in patterns:
        if id(p) not in cache:
            cache[id(p)] = rule_of(p, k_len).allowed(qa, k)
    return torch.stack([cache[id(p)] for p in patterns])


def token_mask(patterns: tuple, q_len: int, k_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense bool [Hq, Lq, Lk] mask of the patterns. O(Lq * Lk): for tests and tiny inputs only."""
    qa = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return head_masks(patterns, qa, torch.arange(k_len, device=device)[None, :], k_len)


def pattern_density(patterns: tuple, q_len: int, k_len: int, block: int = 256) -> float:
    """Fraction of the causal (query, key) pairs the patterns attend, computed per query tile (no L x L tensor)."""
    total = attended = 0
    counts: dict[int, list] = {}
    for p in patterns:
        counts.setdefault(id(p), [p, 0])[1] += 1
    for p, count in counts.values():
        rule = make_rule(p, k_len)
        for s in range(0, q_len, block):
            qa = torch.arange(s, min(s + block, q_len))[:, None] + (k_len - q_len)
            k = torch.arange(k_len)[None, :]
            attended += count * int(rule.allowed(qa, k).sum())
            total += count * int((k <= qa).sum())
    return attended / max(total, 1)
