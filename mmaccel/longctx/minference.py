"""MInference-style dynamic sparse prefill: one sparse pattern per head, its blocks estimated online per prompt.

Jiang et al., "MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention", 2024,
arXiv 2407.02490. Each attention head is given one of three patterns by an offline search on a few calibration
prompts (:func:`search_patterns`, saved as ``mmaccel/longctx/head_patterns/minference-<model>.json``):

- ``a_shape``: the first block of tokens (sinks) plus a local window (:class:`~mmaccel.kernels.Streaming`);
- ``vertical_slash``: the key columns and the diagonals (query - key offsets) that the last ``last_q`` queries
  attend most, found per prompt (:func:`vertical_slash_scores`), then every block they cross
  (:meth:`~mmaccel.kernels.BlockSparse.from_vertical_slash`);
- ``block_sparse``: per query block, the key blocks with the highest mean-pooled ``q . k``
  (:func:`block_sparse_table`).

At every prefill forward (``Lq == Lk >= min_length``) each layer estimates the blocks of its heads from this forward's
own queries and keys and runs :func:`~mmaccel.kernels.sparse_prefill_attention`; decode steps (and short prompts) run
the model's own attention. The K/V are kept by a wrapped KV method (``method=``, default ``full``), which can bound
the cache for decoding (``minference:method=snapkv,ratio=0.25``).

How the model reaches the sparse prefill, per instance and reversibly: an attention function is registered once in
transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`; the cache gives each full-attention module of this
model a shallow copy of its config naming that function (sliding-window layers keep their own), and a model
pre-hook marks the forwards that run with this cache. ``cache.close()`` (or ``with cache:``) restores them.
"""
from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from ..kernels import BlockSparse, HeadPatterns, Streaming, sparse_prefill_attention
from ..kernels.hf import attention_modules, cache_kwarg, check_attention_kwargs, hooked_cache, refuse_attention_variants
from ..kernels.sparse_prefill import dense_plan_fraction
from ..specs import read_shipped_json
from .base import KVMethod, KVMethodCache, LayerStep, _check_int, has_padding, no_method_layers_error
from .chunked import resolve_inner
from .head_pattern import PATTERN_DIR, HeadPattern, config_fingerprint
from .owned import OwnedAttentionCache, _original_attention

logger = logging.getLogger(__name__)

ATTENTION_NAME = "mmaccel_minference"
STATE_ATTR = "_mmaccel_minference"
FORMAT = "mmaccel-minference-pattern/1"
KINDS = ("a_shape", "vertical_slash", "block_sparse")
#: key columns every vertical-slash head keeps (attention sinks), besides its estimated ones
SINK_COLUMNS = 4


# ------------------------------------------------------------------------------------------------------ head choice
@dataclass(frozen=True)
class HeadChoice:
    """One head's pattern kind and budgets, budgets as fractions of the prompt length (so they transfer across
    lengths).

    Attributes
    ----------
    kind : {"a_shape", "vertical_slash", "block_sparse"}
    window : float
        ``a_shape``: local window, fraction of the length (the sink is one block).
    vertical, slash : float
        ``vertical_slash``: key columns and diagonals kept, fractions of the length (at least one each; the first
        :data:`SINK_COLUMNS` columns and the diagonals of the local block come on top).
    blocks : float
        ``block_sparse``: fraction of each query block's causal key blocks kept (at least the diagonal block and
        block 0).

    Raises
    ------
    ValueError
        On an unknown kind or a budget outside [0, 1].
    """

    kind: str
    window: float = 0.0
    vertical: float = 0.0
    slash: float = 0.0
    blocks: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown MInference head pattern {self.kind!r}; choose one of {', '.join(KINDS)}")
        for name in ("window", "vertical", "slash", "blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"MInference {self.kind}: {name} must be a fraction of the length in [0, 1], "
                                 f"got {value!r}")

    def to_dict(self) -> dict:
        keys = {"a_shape": ("window",), "vertical_slash": ("vertical", "slash"), "block_sparse": ("blocks",)}
        return {"kind": self.kind, **{k: getattr(self, k) for k in keys[self.kind]}}

    @classmethod
    def from_dict(cls, data: dict) -> HeadChoice:
        return cls(**{k: v for k, v in data.items() if k in ("kind", "window", "vertical", "slash", "blocks")})


#: the candidates :func:`search_patterns` tries per head (block densities at 4k-8k tokens span about 0.1-0.4)
DEFAULT_CANDIDATES = (
    *(HeadChoice("a_shape", window=w) for w in (0.05, 0.1, 0.15)),
    *(HeadChoice("vertical_slash", vertical=v, slash=s) for v, s in ((0.002, 0.005), (0.005, 0.01), (0.01, 0.02))),
    *(HeadChoice("block_sparse", blocks=b) for b in (0.1, 0.15, 0.2)),
)


def _count(fraction: float, length: int) -> int:
    return max(1, min(length, round(fraction * length)))


# ------------------------------------------------------------------------------------------------ online estimation
def last_query_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax of the last queries of a sequence over all its keys.

    Parameters
    ----------
    query : torch.Tensor
        [Hq, n, D] post-RoPE queries at positions ``L - n .. L - 1`` (``n <= L``).
    key : torch.Tensor
        [Hkv, L, D] keys; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    scaling : float
        Softmax scale.

    Returns
    -------
    torch.Tensor
        float32 [Hq, n, L]; row ``i`` is the query at position ``L - n + i``; rows sum to 1.
    """
    Hq, n, D = query.shape
    Hkv, L = key.shape[0], key.shape[1]
    grouped = query.float().reshape(Hkv, Hq // Hkv, n, D)
    logits = (grouped @ key.float().transpose(-1, -2)[:, None]).reshape(Hq, n, L) * scaling
    pos = torch.arange(L, device=query.device)
    logits.masked_fill_(pos[None, :] > pos[L - n:, None], float("-inf"))
    return logits.softmax(-1)


def vertical_slash_scores(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mass of every key column and every diagonal, from the last queries' probabilities.

    Parameters
    ----------
    probs : torch.Tensor
        [H, n, L] (:func:`last_query_probs`); row ``i`` is at position ``L - n + i``.

    Returns
    -------
    (vertical, slash) : float32 [H, L] each
        ``vertical[h, k]``: the mass key ``k`` receives; ``slash[h, o]``: the mass on offset ``o = query - key``.
    """
    H, n, L = probs.shape
    qa = torch.arange(L - n, L, device=probs.device)[:, None]
    offset = (qa - torch.arange(L, device=probs.device)[None, :]).clamp(min=0)  # masked (future) keys carry 0 mass
    slash = probs.new_zeros(H, L).scatter_add_(1, offset.flatten().expand(H, -1), probs.reshape(H, -1))
    return probs.sum(1), slash


def top_with_forced(scores: torch.Tensor, count: int, forced: int) -> torch.Tensor:
    """int64 [H, min(L, forced + count)]: indices ``0 .. forced - 1`` plus, per row, the ``count`` best others.

    Parameters
    ----------
    scores : torch.Tensor
        [H, L] scores, higher = keep.
    count : int
        Indices chosen by score (beyond the forced ones).
    forced : int
        Leading indices always kept.
    """
    H, L = scores.shape
    forced = min(forced, L)
    rest = scores.clone()
    rest[:, :forced] = float("-inf")
    top = rest.topk(min(count, L - forced), dim=-1).indices
    return torch.cat([torch.arange(forced, device=scores.device).expand(H, forced), top], dim=1)


def vertical_slash_table(vertical: torch.Tensor, slash: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """The blocks that vertical lines (key columns) and slash lines (offsets ``query - key``) cross, vectorized.

    The same table as :meth:`~mmaccel.kernels.BlockSparse.from_vertical_slash` whenever column 0 is among the
    vertical lines (as :func:`estimate_patterns` forces: the sinks), without its Python loop over offsets: an offset
    ``o`` crosses the block diagonals ``floor(o / block)`` and ``ceil(o / block)``.

    Parameters
    ----------
    vertical : torch.Tensor
        int64 [n_v] key positions.
    slash : torch.Tensor
        int64 [n_s] offsets >= 0.
    length : int
        Sequence length.
    block : int
        Block size.

    Returns
    -------
    torch.Tensor
        bool [n, n], ``n = ceil(length / block)``: every row holds the vertical lines' block columns (also above the
        diagonal, as ``from_vertical_slash``; causality is applied by the kernels) and the slashes' causal blocks.
    """
    n = -(-length // block)
    cols = torch.arange(n, device=vertical.device)
    diag = cols[:, None] - cols[None, :]
    slash = slash.long().clamp(0, length - 1)
    diagonals = torch.cat([slash // block, -(-slash // block)]).unique()
    return torch.isin(cols, (vertical.long().clamp(0, length - 1) // block).unique())[None, :] | (
        torch.isin(diag, diagonals) & (diag >= 0))


def block_sparse_table(query: torch.Tensor, key: torch.Tensor, block: int, fraction: float,
                       scaling: float) -> torch.Tensor:
    """MInference's block-sparse estimate: per query block, the causal key blocks with the highest ``q . k`` of the
    blocks' mean query and mean key.

    Parameters
    ----------
    query : torch.Tensor
        [Hq, L, D] post-RoPE queries (positions ``0 .. L - 1``).
    key : torch.Tensor
        [Hkv, L, D] keys (GQA as :func:`last_query_probs`).
    block : int
        Tokens per block.
    fraction : float
        Kept fraction of each query block's ``i + 1`` causal key blocks: ``ceil(fraction * (i + 1))`` blocks.
    scaling : float
        Softmax scale (orders nothing; kept for the logits' units).

    Returns
    -------
    torch.Tensor
        bool [Hq, n, n], ``n = ceil(L / block)``; row ``i`` always keeps block 0 and block ``i`` (the diagonal).
    """
    Hq, L, D = query.shape
    n = -(-L // block)
    owner = torch.arange(L, device=query.device) // block
    size = torch.bincount(owner, minlength=n).clamp(min=1).float()[None, :, None]
    qb = query.float().new_zeros(Hq, n, D).index_add_(1, owner, query.float()) / size
    kb = key.float().new_zeros(key.shape[0], n, D).index_add_(1, owner, key.float()) / size
    scores = qb @ kb.repeat_interleave(Hq // key.shape[0], dim=0).transpose(-1, -2) * scaling
    rows, cols = torch.arange(n, device=query.device)[:, None], torch.arange(n, device=query.device)[None, :]
    scores = scores.masked_fill(cols > rows, float("-inf"))
    scores = scores.masked_fill((cols == rows) | (cols == 0), float("inf"))
    rank = scores.argsort(dim=-1, descending=True).argsort(dim=-1)
    keep = torch.ceil(fraction * (rows + 1).float()).clamp(min=2)
    return (rank < keep) & (cols <= rows)


def estimate_patterns(query: torch.Tensor, key: torch.Tensor, choices: Sequence[HeadChoice], *, block: int,
                      last_q: int, scaling: float) -> tuple:
    """Per-head kernel patterns for one sequence, estimated from its own queries and keys.

    Parameters
    ----------
    query : torch.Tensor
        [Hq, L, D] post-RoPE queries of a whole prompt (positions ``0 .. L - 1``).
    key : torch.Tensor
        [Hkv, L, D] its keys.
    choices : sequence of HeadChoice
        ``Hq`` choices, one per query head.
    block : int
        Block size of the tables (and the A-shape sink).
    last_q : int
        Queries the vertical-slash estimate reads (MInference: 64).
    scaling : float
        Softmax scale.

    Returns
    -------
    tuple
        ``Hq`` patterns (:class:`~mmaccel.kernels.Streaming` or :class:`~mmaccel.kernels.BlockSparse`) for
        :func:`~mmaccel.kernels.sparse_prefill_attention`; heads with equal A-shape budgets share one object.

    Raises
    ------
    ValueError
        If ``len(choices) != Hq``.
    """
    Hq, L, _ = query.shape
    if len(choices) != Hq:
        raise ValueError(f"MInference: {len(choices)} head choices for {Hq} query heads")
    vs = [h for h, c in enumerate(choices) if c.kind == "vertical_slash"]
    bs = [h for h, c in enumerate(choices) if c.kind == "block_sparse"]
    patterns: list = [None] * Hq
    shared: dict[int, Streaming] = {}
    for h, c in enumerate(choices):
        if c.kind == "a_shape":
            window = _count(c.window, L)
            patterns[h] = shared.setdefault(window, Streaming(sink=block, window=window))
    if vs:
        group = Hq // key.shape[0]
        idx = torch.tensor(vs, device=query.device)
        last = query[:, L - min(last_q, L):]
        if len(vs) == Hq:
            probs = last_query_probs(last, key, scaling)
        else:  # one KV head per selected query head
            probs = last_query_probs(last.index_select(0, idx), key.index_select(0, idx // group), scaling)
        vertical, slash = vertical_slash_scores(probs)
        for row, h in enumerate(vs):
            c = choices[h]
            cols = top_with_forced(vertical[row:row + 1], _count(c.vertical, L), SINK_COLUMNS)[0]
            offs = top_with_forced(slash[row:row + 1], _count(c.slash, L), block)[0]
            patterns[h] = BlockSparse(vertical_slash_table(cols, offs, L, block).cpu(), block)
    for h in bs:
        group = Hq // key.shape[0]
        table = block_sparse_table(query[h:h + 1], key[h // group:h // group + 1], block, choices[h].blocks, scaling)
        patterns[h] = BlockSparse(table[0].cpu(), block)
    return tuple(patterns)


# ---------------------------------------------------------------------------------------------------- pattern file
@dataclass
class MInferencePattern:
    """Each head's MInference pattern for one model, as found by :func:`search_patterns` (a JSON file per model).

    File (``format = "mmaccel-minference-pattern/1"``)::

        {"format": ..., "model": "smollm2-135m", "fingerprint": {...}, "block": 64, "last_q": 64,
         "heads": [[{"kind": "vertical_slash", "vertical": 0.005, "slash": 0.01}, ...], ...],  # [layers][Hq]
         "recall": [[0.97, ...], ...], "density": [[0.21, ...], ...],   # per head, on the calibration prompts
         "found_by": {...}, "validation": {...}}

    Attributes
    ----------
    heads : list of list of HeadChoice
        [num_layers][num_attention_heads]; a layer the search did not see (sliding window) is ``[]``.
    fingerprint : dict
        :func:`~mmaccel.longctx.head_pattern.config_fingerprint` of the model.
    recall, density : list of list of float
        Per head, the mean attention recall and block density of its choice on the calibration prompts.
    found_by, validation : dict
        How it was found; its recall and density on held-out prompts (:func:`pattern_recall`).
    model, source : str
        A label for the model; where the pattern was loaded from.

    Raises
    ------
    ValueError
        If ``recall``/``density`` do not match ``heads``.
    """

    heads: list
    fingerprint: dict = field(default_factory=dict)
    recall: list = field(default_factory=list)
    density: list = field(default_factory=list)
    found_by: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    model: str = ""
    source: str = ""

    def __post_init__(self):
        self.heads = [[c if isinstance(c, HeadChoice) else HeadChoice.from_dict(c) for c in row] for row in self.heads]
        for name in ("recall", "density"):
            value = getattr(self, name)
            if value and [len(r) for r in value] != [len(r) for r in self.heads]:
                raise ValueError(f"MInference pattern: {name} must have the shape of heads [layers][heads]")

    def layer(self, idx: int) -> list:
        """The ``Hq`` choices of layer ``idx`` (``[]`` when it has none)."""
        return self.heads[idx] if idx < len(self.heads) else []

    def kind_counts(self) -> dict[str, int]:
        """Heads per pattern kind."""
        return {k: sum(c.kind == k for row in self.heads for c in row) for k in KINDS}

    def check_model(self, config) -> None:
        """Raise ``ValueError`` if the pattern was made for a model with other layer or head counts."""
        fp = config_fingerprint(config)
        keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        differ = [k for k in keys if k in self.fingerprint and self.fingerprint[k] != fp[k]]
        if differ:
            raise ValueError(
                f"MInference pattern {self.source or self.model!r} was made for another model ("
                + ", ".join(f"{k}: {self.fingerprint[k]} vs {fp[k]}" for k in differ)
                + "); find one for this model with mmaccel.longctx.minference.search_patterns(model, prompts)")

    def to_dict(self) -> dict:
        def rounded(rows):
            return [[round(float(x), 4) for x in row] for row in rows]

        return {"format": FORMAT, "model": self.model, "fingerprint": self.fingerprint,
                "heads": [[c.to_dict() for c in row] for row in self.heads],
                "recall": rounded(self.recall), "density": rounded(self.density),
                "kind_counts": self.kind_counts(), "found_by": self.found_by, "validation": self.validation}

    save = HeadPattern.save  # writes ``to_dict()`` as JSON to a path (parent folders created); returns the path

    @classmethod
    def load(cls, name_or_path) -> MInferencePattern:
        """A shipped pattern by name (``"minference-smollm2-135m"``) or a JSON file by path.

        Raises
        ------
        ValueError
            Unknown name or missing file, unreadable JSON, or not a MInference pattern.
        """
        if isinstance(name_or_path, MInferencePattern):
            return name_or_path
        text = str(name_or_path)
        data = read_shipped_json(text, PATTERN_DIR, "MInference pattern",
                                 "make one with mmaccel.longctx.minference.search_patterns(model, prompts).save(path)")
        if not isinstance(data, dict) or data.get("format") != FORMAT or "heads" not in data:
            raise ValueError(f"{text} is not a MInference pattern (expected format {FORMAT!r} with 'heads')")
        return cls(data["heads"], data.get("fingerprint", {}), data.get("recall", []), data.get("density", []),
                   data.get("found_by", {}), data.get("validation", {}), data.get("model", ""), text)


# ---------------------------------------------------------------------------------------------- attention function
class _PrefillState:
    """What the attention function of one cache needs: each layer's head choices, the estimation settings, and the
    per-forward statistics (``mode="run"``), or the candidates to score (``mode="search"``)."""

    def __init__(self, choices_of, *, block: int, last_q: int, min_length: int, mode: str = "run",
                 candidates: Sequence = (), rows: int = 256, rows_at: str = "spread"):
        self.choices_of, self.block, self.last_q, self.min_length = choices_of, block, last_q, min_length
        self.mode, self.candidates, self.rows, self.rows_at = mode, list(candidates), rows, rows_at
        self.active = False
        self.flops: dict[int, list[float]] = {}  # layer -> kept block fraction per sparse forward
        self.estimate: dict[int, list[float]] = {}  # layer -> estimation (q . k pairs) / dense causal pairs
        self.dense_forwards = 0
        self.recall: dict[int, torch.Tensor] = {}  # search: layer -> [candidates, Hq] summed over prompts
        self.density: dict[int, torch.Tensor] = {}
        self.prompts: dict[int, int] = {}

    def sparse(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """[B, Hq, L, D] sparse prefill of one layer, one sequence at a time (patterns have no batch axis)."""
        choices = self.choices_of(layer, query.shape[1])
        out = torch.empty_like(query)
        L = query.shape[2]
        for b in range(query.shape[0]):
            patterns = estimate_patterns(query[b], key[b], choices, block=self.block, last_q=self.last_q,
                                         scaling=scaling)
            out[b:b + 1] = sparse_prefill_attention(query[b:b + 1], key[b:b + 1], value[b:b + 1],
                                                    HeadPatterns(patterns), scaling=scaling)
            self.flops.setdefault(layer, []).append(dense_plan_fraction(patterns, len(patterns), L, L, self.block))
            self.estimate.setdefault(layer, []).append(self.estimate_fraction(choices, L))
        return out

    def estimate_fraction(self, choices, L: int) -> float:
        """(q . k pairs the estimation computes) / (causal pairs of dense attention), over the layer's heads."""
        n = -(-L // self.block)
        pairs = sum(min(self.last_q, L) * L if c.kind == "vertical_slash" else
                    n * n if c.kind == "block_sparse" else 0 for c in choices)
        return pairs / (len(choices) * L * (L + 1) / 2)

    def score(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Search mode: per candidate and head, the attention recall of its estimated pattern on ``rows`` query
        rows (spread over the prompt, or its last ones: :func:`search_rows`), and its block density; summed into
        :attr:`recall` / :attr:`density`."""
        from ..kernels.patterns import make_rule

        Hq, L = query.shape[1], query.shape[2]
        rows = search_rows(L, self.rows, self.rows_at, query.device)
        k_pos = torch.arange(L, device=query.device)
        for b in range(query.shape[0]):
            k = key[b].float().repeat_interleave(Hq // key.shape[1], dim=0)
            logits = query[b][:, rows].float() @ k.transpose(-1, -2) * scaling
            probs = logits.masked_fill(k_pos[None, :] > rows[:, None], float("-inf")).softmax(-1)  # [Hq, R, L]
            recall = torch.zeros(len(self.candidates), Hq)
            density = torch.zeros(len(self.candidates), Hq)
            for ci, cand in enumerate(self.candidates):
                choices = cand(layer, Hq) if callable(cand) else [cand] * Hq
                patterns = estimate_patterns(query[b], key[b], choices, block=self.block, last_q=self.last_q,
                                             scaling=scaling)
                for h, p in enumerate(patterns):
                    allowed = make_rule(p, L).allowed(rows[:, None], k_pos[None, :])
                    recall[ci, h] = float((probs[h] * allowed).sum(-1).mean())
                    density[ci, h] = dense_plan_fraction((p,), 1, L, L, self.block)
            self.recall[layer] = self.recall.get(layer, 0) + recall
            self.density[layer] = self.density.get(layer, 0) + density
            self.prompts[layer] = self.prompts.get(layer, 0) + 1


def minference_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as :data:`ATTENTION_NAME`: MInference's sparse prefill for the forwards of
    the cache that set it up, the module's own attention otherwise.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module (a weak reference to its cache's state and its original implementation are on
        it while the cache is open).
    query : torch.Tensor
        [B, Hq, Lq, D] post-RoPE queries.
    key, value : torch.Tensor
        [B, Hkv, Lk, D] what the cache layer's ``update`` returned.
    attention_mask : object
        The mask the model built.
    scaling : float, optional
        Softmax scale (default ``module.scaling``).

    Returns
    -------
    (torch.Tensor, None)
        [B, Lq, Hq, D] attention output and no weights.

    Raises
    ------
    ValueError
        On a padded prefill (the per-head block tables cannot follow a padding mask).
    NotImplementedError
        If the module passes a softcap or sink logits (refused up front by the cache).
    """
    ref, original = getattr(module, STATE_ATTR, (None, None))
    state = ref() if ref is not None else None
    q_len, k_len = query.shape[2], key.shape[2]
    if (state is None or not state.active or q_len != k_len or q_len < state.min_length
            or kwargs.get("sliding_window") is not None or (dropout and module.training)):
        if state is not None and state.active and q_len > 1:
            state.dense_forwards += 1
        return _original_attention(original)(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
    if has_padding(attention_mask):
        raise ValueError("minference cannot run a padded prefill (per-head block tables have no padding mask); run "
                         "prompts one at a time or with equal lengths")
    check_attention_kwargs(module, kwargs, "minference")
    scale = float(scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5))
    if state.mode == "search":
        state.score(module.layer_idx, query, key, scale)
        return _original_attention(original)(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
    out = state.sparse(module.layer_idx, query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, minference_attention_forward)


class _Swap:
    """Handle (``remove()``) that routes one attention module to :data:`ATTENTION_NAME` through a config copy."""

    def __init__(self, module: torch.nn.Module, state: _PrefillState):
        self.module, self.config = module, module.config
        own = copy.copy(module.config)
        own._attn_implementation_internal = ATTENTION_NAME  # this copy only; the model's mask is untouched
        module.config = own
        setattr(module, STATE_ATTR, (weakref.ref(state), self.config._attn_implementation))

    def remove(self) -> None:
        if self.module is not None:
            self.module.config = self.config
            if hasattr(self.module, STATE_ATTR):
                delattr(self.module, STATE_ATTR)
            self.module = None


def attach(model: torch.nn.Module, cache, state: _PrefillState, owner: str = "minference") -> list:
    """Route the full-attention modules of ``model`` to the sparse prefill for the forwards with ``cache``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The one model instance.
    cache : transformers.Cache
        The cache whose forwards are sparse (recognised by the model pre-hook); its sliding-window layers
        (``is_sliding``) keep the model's attention.
    state : _PrefillState
        Choices, settings and statistics (held by the caller: the modules keep a weak reference).
    owner : str
        Method name for messages.

    Returns
    -------
    list
        Handles with ``remove()`` (the module swaps and the two model hooks).

    Raises
    ------
    ValueError
        If the model has no full-attention module, or one with a softcap or attention sinks.
    """
    layers = getattr(cache, "layers", [])
    modules = {i: m for i, m in attention_modules(model).items()
               if i < len(layers) and not getattr(layers[i], "is_sliding", False)}
    if not modules:
        raise no_method_layers_error(model, cache, owner)
    refuse_attention_variants(modules, owner)
    ref = weakref.ref(cache)

    def mark(module, args, kwargs):
        state.active = ref() is not None and hooked_cache(kwargs) is ref()

    def unmark(module, args, kwargs, output):
        state.active = False

    handles: list = [_Swap(m, state) for m in modules.values()]
    handles.append(model.register_forward_pre_hook(mark, with_kwargs=True))
    handles.append(model.register_forward_hook(unmark, with_kwargs=True, always_call=True))
    return handles


# ---------------------------------------------------------------------------------------------------------- method
@dataclass
class MInference(KVMethod):
    """MInference dynamic sparse prefill (Jiang et al., 2024, arXiv 2407.02490) over any hook-driven KV method.

    Every prefill forward of at least ``min_length`` tokens (a whole prompt, no past) runs each full-attention layer
    through :func:`~mmaccel.kernels.sparse_prefill_attention` with one pattern per query head, its blocks estimated
    from this prompt (see the module docstring). Decode steps and shorter forwards run the model's own attention.
    The K/V are stored by ``method`` (its cache, hooks and telemetry unchanged): ``full`` keeps everything, a
    prefill-time eviction (``snapkv``, ``chunkkv``, ...) bounds the decode cache.

    Parameters
    ----------
    pattern : str or MInferencePattern or None
        Per-head kinds and budgets: a shipped name (``"minference-smollm2-135m"``), a JSON path, or a pattern
        object (:func:`search_patterns`). ``None``: every head ``vertical_slash`` with ``vertical`` and ``slash``.
    vertical, slash : float
        Without a pattern: key columns and diagonals kept, fractions of the prompt length in [0, 1] (defaults
        0.005 and 0.01). ``vertical=1`` keeps every block: the prefill is then exactly full attention.
    last_q : int
        Queries the vertical-slash estimate reads, >= 1 (MInference: 64).
    block : int
        Block size of the tables (tokens), >= 1 (default 64).
    min_length : int
        Shorter prompts run dense, >= 1 (default 1024).
    method : KVMethod or str
        The KV method that keeps the cache, or its spec with commas for colons (``method=snapkv,ratio=0.25``);
        a method that computes its own attention (``quest``, ``retrieval_heads``, ...) is refused.

    Attributes
    ----------
    prefill_flops_fraction : float
        After a run: attention FLOPs of the kept blocks / dense causal FLOPs, mean over layers and sparse forwards
        (1.0 when nothing ran sparse); the estimation's own cost is ``estimate_flops_fraction`` in telemetry.

    Notes
    -----
    Budgets are per head fractions of the length; blocks are counted at ``block`` granularity, so a vertical line
    costs a whole block column. Padded prefills raise; beam search follows the wrapped method. The ``Chunked``
    wrapper is refused (a later chunk has a past, so it would run dense).

    Raises
    ------
    ValueError
        On a bad hyper-parameter, an unknown pattern, or a wrapped method that computes its own attention; in
        :meth:`make_cache`, for a pattern made for another model, a model without full-attention layers, or one
        with an attention softcap or sink logits.
    """

    pattern: object = None
    vertical: float = 0.005
    slash: float = 0.01
    last_q: int = 64
    block: int = 64
    min_length: int = 1024
    method: object = "full"

    method_name = "minference"
    supports_chunking = False
    chunking_error = "its online estimate needs the whole prompt in one forward"

    def __post_init__(self):
        name = self.method_name
        _check_int(name, "last_q", self.last_q, 1, f"e.g. {name}:last_q=64")
        _check_int(name, "block", self.block, 1, f"e.g. {name}:block=64")
        _check_int(name, "min_length", self.min_length, 1, f"e.g. {name}:min_length=1024")
        HeadChoice("vertical_slash", vertical=self.vertical, slash=self.slash)  # checks both fractions
        self._pattern = None if self.pattern is None else MInferencePattern.load(self.pattern)
        self.method = resolve_inner(self.method, name)
        if not self.method.uses_hooks and self.method.name != "full":
            raise ValueError(f"{name}: method={self.method.name} computes its own attention, which would bypass the "
                             "sparse prefill; wrap a method that keeps the model's attention (full, snapkv, "
                             "pyramidkv, chunkkv, streaming, h2o, tova, knorm)")
        self._state: _PrefillState | None = None

    @property
    def uses_hooks(self) -> bool:
        return self.method.uses_hooks

    def make_layer(self, layer_idx: int):
        return self.method.make_layer(layer_idx)

    def on_step(self, step: LayerStep) -> None:
        self.method.on_step(step)

    @property
    def spec(self) -> str:
        label = self._pattern.source or "<in-memory>" if self._pattern is not None else None
        own = f"pattern={label}" if label else f"vertical={self.vertical}:slash={self.slash}"
        return (f"{self.name}:{own}:last_q={self.last_q}:block={self.block}:min_length={self.min_length}"
                f":method={self.method.spec.replace(':', ',')}")

    def choices(self, layer: int, num_heads: int) -> list:
        """The ``num_heads`` head choices of ``layer`` (the pattern's, or the uniform vertical-slash one).

        Raises
        ------
        ValueError
            If the pattern's layer has another number of heads.
        """
        if self._pattern is None:
            return [HeadChoice("vertical_slash", vertical=self.vertical, slash=self.slash)] * num_heads
        row = self._pattern.layer(layer)
        if len(row) != num_heads:
            raise ValueError(f"{self.name}: pattern {self._pattern.source!r} has {len(row)} heads at layer {layer}, "
                             f"the model {num_heads}")
        return row

    def make_cache(self, model: torch.nn.Module) -> KVMethodCache:
        """A fresh cache for one ``generate`` run of ``model``: the wrapped method's cache with the sparse prefill
        attached (removed by ``close()`` / ``with``)."""
        if self._pattern is not None:
            self._pattern.check_model(model.config)
        cache = self.method.make_cache(model)
        if isinstance(cache, OwnedAttentionCache):
            cache.close()
            raise ValueError(  # noqa: TRY004 - a bad spec value, reported like every other one
                f"{self.name}: method={self.method.name} computes its own attention, which would bypass the sparse "
                "prefill; wrap full, snapkv, pyramidkv, chunkkv, streaming, h2o, tova or knorm")
        if not isinstance(cache, KVMethodCache):  # full: a plain DynamicCache that cannot hold hooks
            cache = KVMethodCache(model, self)
        self._state = _PrefillState(self.choices, block=self.block, last_q=self.last_q, min_length=self.min_length)
        cache._minference_state = self._state  # the modules hold a weak reference; the cache keeps it alive
        try:
            cache._hooks.extend(attach(model, cache, self._state, self.name))
        except ValueError:
            cache.close()
            raise
        return cache

    @property
    def prefill_flops_fraction(self) -> float:
        """Attention FLOPs of the kept blocks / dense causal FLOPs in the last cache's sparse forwards (mean over
        layers; 1.0 when none ran sparse)."""
        flops = [f for fs in (self._state.flops.values() if self._state else []) for f in fs]
        return sum(flops) / len(flops) if flops else 1.0

    def telemetry(self, cache) -> dict:
        """The wrapped method's telemetry with ``method``/``spec`` of this one, ``inner_method``, ``pattern``,
        ``prefill_flops_fraction`` (kept blocks / dense causal blocks, mean over layers),
        ``prefill_flops_fraction_per_layer``, ``estimate_flops_fraction`` (the estimation's q . k pairs / dense
        causal pairs), ``sparse_layers``, ``dense_prefill_forwards`` (prefill forwards that ran dense:
        shorter than ``min_length`` or with a past) and ``head_kinds``."""
        state = getattr(cache, "_minference_state", self._state)
        per_layer = {i: sum(f) / len(f) for i, f in sorted(state.flops.items())} if state else {}
        estimate = [e for es in state.estimate.values() for e in es] if state else []
        kinds = self._pattern.kind_counts() if self._pattern else {"vertical_slash": -1}
        return {**self.method.telemetry(cache), "method": self.name, "spec": self.spec,
                "inner_method": self.method.spec,
                "pattern": self._pattern.source if self._pattern else None,
                "prefill_flops_fraction": (sum(per_layer.values()) / len(per_layer)) if per_layer else 1.0,
                "prefill_flops_fraction_per_layer": [round(f, 4) for f in per_layer.values()],
                "estimate_flops_fraction": sum(estimate) / len(estimate) if estimate else 0.0,
                "sparse_layers": len(per_layer),
                "dense_prefill_forwards": state.dense_forwards if state else 0,
                "head_kinds": kinds}


# ---------------------------------------------------------------------------------------------------------- search
def _run_state(model: torch.nn.Module, prompts: Sequence[torch.Tensor], state: _PrefillState) -> None:
    """One forward per prompt with ``state`` attached (search mode scores inside the attention function)."""
    from transformers import DynamicCache

    for ids in prompts:
        cache = DynamicCache(config=model.config)
        handles = attach(model, cache, state, "minference search")
        try:
            with torch.no_grad():
                model(ids, use_cache=True, logits_to_keep=1, **cache_kwarg(model, cache))
        finally:
            for h in handles:
                h.remove()


def search_rows(length: int, rows: int, rows_at: str = "spread", device=None) -> torch.Tensor:
    """int64 [R] the query rows a pattern search measures attention recall on, R = min(rows, length).

    ``rows_at="spread"``: evenly spread over the prompt (every part of the document counts alike); ``"end"``: the
    last R rows, where a retrieval prompt puts its question, so a head is judged by what the question's rows read
    (the needle's columns), not by the document's mostly local rows.

    Raises
    ------
    ValueError
        For another ``rows_at`` or ``rows < 1``.
    """
    if rows_at not in ("spread", "end"):
        raise ValueError(f"rows_at must be 'spread' or 'end', got {rows_at!r}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    n = min(rows, length)
    if rows_at == "end":
        return torch.arange(length - n, length, device=device)
    return torch.linspace(0, length - 1, n, device=device).round().long().unique()


def search_patterns(model: torch.nn.Module, prompts: Sequence[torch.Tensor], *, density: float = 0.25,
                    candidates: Sequence[HeadChoice] = DEFAULT_CANDIDATES, block: int = 64, last_q: int = 64,
                    rows: int = 256, rows_at: str = "spread", label: str = "",
                    found_by: dict | None = None) -> MInferencePattern:
    """MInference's offline pattern search: per head, the candidate with the best attention recall within a block
    budget, on a few calibration prompts.

    For each prompt, layer and candidate, the candidate's blocks are estimated online exactly as at inference
    (:func:`estimate_patterns`); its *recall* is the softmax mass of full attention that the pattern keeps, averaged
    over ``rows`` query rows spread over the prompt, and its *density* the fraction of causal blocks it computes.
    Per head, the candidate with the highest mean recall among those with mean density <= ``density`` wins (the
    sparsest candidate when none fits). This is the paper's kernel-aware search (same cost, best recall), with the
    cost measured in blocks.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model (batch-1 prompts, any attention implementation).
    prompts : sequence of torch.Tensor
        int64 [1, L] token ids; each L >= ``block``.
    density : float
        Block budget per head, in (0, 1].
    candidates : sequence of HeadChoice
        What each head may be (default :data:`DEFAULT_CANDIDATES`).
    block, last_q : int
        As in :class:`MInference`.
    rows : int
        Query rows per prompt the recall is measured on.
    rows_at : {"spread", "end"}
        Where those rows are (:func:`search_rows`): spread over the prompt (default), or its last ``rows`` (the
        question of a retrieval prompt).
    label : str
        Model label stored in the file.
    found_by : dict, optional
        Extra provenance stored in ``found_by`` (e.g. the calibration source).

    Returns
    -------
    MInferencePattern
        ``heads`` [layers][Hq] with their calibration ``recall`` and ``density``.

    Raises
    ------
    ValueError
        On no prompts, a bad ``density``, ``rows`` or ``rows_at``, or an empty candidate list.
    """
    if not prompts or not candidates:
        raise ValueError("search_patterns needs at least one prompt and one candidate")
    search_rows(1, rows, rows_at)  # ValueError before any forward
    if isinstance(density, bool) or not 0 < density <= 1:
        raise ValueError(f"search_patterns: density must be in (0, 1], got {density!r}")
    state = _PrefillState(None, block=block, last_q=last_q, min_length=1, mode="search", candidates=candidates,
                          rows=rows, rows_at=rows_at)
    _run_state(model, prompts, state)
    num_layers = int(config_fingerprint(model.config)["num_hidden_layers"])
    heads, recall, dens = [], [], []
    for layer in range(num_layers):
        if layer not in state.recall:
            heads.append([]), recall.append([]), dens.append([])
            continue
        r = state.recall[layer] / state.prompts[layer]
        d = state.density[layer] / state.prompts[layer]
        fits = d <= density + 1e-9
        score = torch.where(fits, r, r - 2.0 - d)  # over budget: only if nothing fits, and then the sparsest
        best = score.argmax(0)
        heads.append([candidates[int(i)] for i in best])
        recall.append([float(r[i, h]) for h, i in enumerate(best)])
        dens.append([float(d[i, h]) for h, i in enumerate(best)])
    info = {"search": "best recall within a block budget (MInference, arXiv 2407.02490)", "density_budget": density,
            "block": block, "last_q": last_q, "rows": rows, "rows_at": rows_at, "prompts": len(prompts),
            "lengths": [int(p.shape[-1]) for p in prompts],
            "candidates": [c.to_dict() for c in candidates], **(found_by or {})}
    return MInferencePattern(heads, config_fingerprint(model.config), recall, dens, info, {}, label)


def pattern_recall(model: torch.nn.Module, pattern: MInferencePattern, prompts: Sequence[torch.Tensor], *,
                   block: int = 64, last_q: int = 64, rows: int = 256, rows_at: str = "spread") -> dict:
    """Recall and block density of a pattern's per-head choices on other prompts (validation of a search).

    Parameters
    ----------
    model : transformers.PreTrainedModel
    pattern : MInferencePattern
    prompts : sequence of torch.Tensor
        int64 [1, L] token ids.
    block, last_q, rows : int
        As in :func:`search_patterns`.
    rows_at : {"spread", "end"}
        As in :func:`search_patterns`.

    Returns
    -------
    dict
        ``recall`` and ``density`` (means over layers and heads), ``recall_min`` (worst head), ``prompts``,
        ``lengths``.

    Raises
    ------
    ValueError
        For a bad ``rows`` or ``rows_at`` (:func:`search_rows`).
    """
    search_rows(1, rows, rows_at)  # ValueError before any forward
    state = _PrefillState(None, block=block, last_q=last_q, min_length=1, mode="search",
                          candidates=[lambda layer, hq: pattern.layer(layer)], rows=rows, rows_at=rows_at)
    _run_state(model, prompts, state)
    r = torch.cat([state.recall[i][0] / state.prompts[i] for i in sorted(state.recall)])
    d = torch.cat([state.density[i][0] / state.prompts[i] for i in sorted(state.density)])
    return {"recall": float(r.mean()), "recall_min": float(r.min()), "density": float(d.mean()),
            "prompts": len(prompts), "lengths": [int(p.shape[-1]) for p in prompts]}
