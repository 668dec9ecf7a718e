"""Quest: query-aware page selection at every decode step, over a full cache kept in pages with key bounds.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", 2024, arXiv 2406.10774.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import attention, decode_attention, gather_pages
from .base import (
    KVMethod,
    _check_int,
    _check_ratio,
    append_slots,
    bookkeeping_bytes,
    check_group,
    kv_cache_bytes,
    query_group_scores,
)
from .owned import AttentionOwningLayer, OwnedAttentionCache


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the keys of every page.

    Parameters
    ----------
    keys : torch.Tensor
        [B, Hkv, T, D] keys (after RoPE).
    page_size : int
        Tokens per page; the last page may be partial.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``kmin``, ``kmax``: [B, Hkv, ceil(T / page_size), D] in the keys' dtype.
    """
    B, H, T, D = keys.shape
    pad = -T % page_size
    lo = F.pad(keys, (0, 0, 0, pad), value=float("inf")).view(B, H, -1, page_size, D).amin(3)
    hi = F.pad(keys, (0, 0, 0, pad), value=float("-inf")).view(B, H, -1, page_size, D).amax(3)
    return lo, hi


def quest_page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, group: str = "mean") -> torch.Tensor:
    """Quest's upper bound of each page's attention logit, combined over each KV head's query heads.

    Parameters
    ----------
    query : torch.Tensor
        [B, Hq, 1, D] the new token's queries; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    kmin, kmax : torch.Tensor
        [B, Hkv, P, D] per-page key bounds (:func:`page_bounds`).
    group : {"mean", "max"}
        How the bounds of a GQA group's query heads combine (:func:`~mmaccel.longctx.base.query_group_scores`):
        their mean (the ranking of their sum), or their maximum (a page one query head needs ranks high even if the
        group's other heads ignore it).

    Returns
    -------
    torch.Tensor
        [B, Hkv, P] float32: the ``group`` reduction over the group's query heads of
        ``sum_d max(q_d * kmin_d, q_d * kmax_d)``.
    """
    B, Hq, _, D = query.shape
    Hkv = kmin.shape[1]
    q = query.float().reshape(B, Hkv, Hq // Hkv, D)
    # max(q_d kmin_d, q_d kmax_d) is q_d kmax_d where q_d > 0 and q_d kmin_d where q_d < 0: two matmuls read each
    # bound once (the element-wise form wrote three [group, P, D] temporaries: 3x slower at 4k)
    bound = q.clamp(min=0) @ kmax.float().transpose(-1, -2) + q.clamp(max=0) @ kmin.float().transpose(-1, -2)
    return query_group_scores(bound.reshape(B, Hq, -1), Hkv, group)  # query head h = kv head * group + j


class QuestLayer(AttentionOwningLayer):
    """A full cache in pages with per-page key bounds; each decode step reads only the top pages per KV head.

    Attributes
    ----------
    keys, values : torch.Tensor
        [B, Hkv, T, D] every token (Quest bounds reads, not storage).
    kmin, kmax : torch.Tensor
        [B, Hkv, ceil(T / page_size), D] per-page key bounds (bookkeeping), refreshed for the pages each update
        touches.
    last_pages : torch.Tensor or None
        int64 [B, Hkv, k] the pages the last decode step read (``None`` when it read the whole cache).
    read_fractions : list of float
        Per decode step, the fraction of the held K/V rows read (the same for every row and KV head: ``k`` distinct
        pages, the newest partial one among them), computed from sizes alone (no tensor op, no GPU sync).
    dense : bool
        A layer Quest leaves dense (the first ``dense_layers``): every step reads the whole cache, no page bounds.
    """

    def __init__(self, budget: int | None, ratio: float | None, page_size: int, dense: bool = False,
                 group: str = "mean"):
        super().__init__()
        self.budget, self.ratio, self.page_size, self.dense, self.group = budget, ratio, page_size, dense, group
        self.kmin = self.kmax = None
        self.last_pages: torch.Tensor | None = None
        self.read_fractions: list[float] = []
        self._stores: dict[str, torch.Tensor] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, Hkv, q, D] K/V and refresh the bounds of the pages they land in; return the held K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[2]
        stores = self._stores  # growable buffers: a decode step writes its token in place (no copy of the cache)
        stores["k"], self.keys = append_slots(stores.get("k"), self.keys, key_states)
        stores["v"], self.values = append_slots(stores.get("v"), self.values, value_states)
        self.cumulative_length += key_states.shape[-2]
        if self.dense:
            return self.keys, self.values
        first = start // self.page_size
        lo, hi = page_bounds(self.keys[:, :, first * self.page_size:], self.page_size)
        if self.kmin is None:
            self.kmin, self.kmax = lo, hi
        else:  # the bounds of the pages this update touched are rewritten in place
            stores["lo"], self.kmin = append_slots(stores.get("lo"), self.kmin[:, :, :first], lo)
            stores["hi"], self.kmax = append_slots(stores.get("hi"), self.kmax[:, :, :first], hi)
        return self.keys, self.values

    def pages_to_read(self, T: int) -> int:
        """Pages read per KV head at a decode step over ``T`` held tokens: ``ceil(tokens / page_size)``, tokens =
        ``budget`` or ``ceil(ratio * T)``."""
        tokens = self.budget if self.ratio is None else math.ceil(self.ratio * T)
        return max(1, math.ceil(tokens / self.page_size))

    def select_pages(self, query: torch.Tensor) -> torch.Tensor:
        """int64 [B, Hkv, k] the top-``k`` pages per KV head by :func:`quest_page_scores`, the page holding the
        newest token always among them, ascending."""
        scores = quest_page_scores(query, self.kmin, self.kmax, self.group)
        scores[..., -1] = float("inf")  # the current (partial) page: the newest tokens
        k = min(self.pages_to_read(self.keys.shape[2]), scores.shape[-1])
        return scores.topk(k, dim=-1).indices.sort(dim=-1).values

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        q = query.shape[2]
        self.check_unpadded(attention_mask, q, "Quest")
        if q > 1:  # prefill stays dense, as in Quest
            return attention(query, self.keys, self.values, causal=True, scaling=scaling)
        T = self.keys.shape[2]
        if self.dense or self.pages_to_read(T) >= self.kmin.shape[2]:
            self.last_pages = None
            self.read_fractions.append(1.0)
            return decode_attention(query, self.keys, self.values, scaling=scaling)
        pages = self.select_pages(query)
        self.last_pages = pages
        # the k pages are distinct and hold the newest (partial) page: every row and head reads the same rows
        newest = (self.kmin.shape[2] - 1) * self.page_size
        self.read_fractions.append(((pages.shape[-1] - 1) * self.page_size + T - newest) / T)
        if query.device.type == "cpu":  # copy the whole pages read, then dense attention over the copy
            return self.attend_pages(query, pages, scaling)
        # pages come from a top-k over this cache's own pages: in range by construction, so skip the bounds check
        return decode_attention(query, self.keys, self.values, pages=pages, page_size=self.page_size,
                                scaling=scaling, check_indices=False)

    def attend_pages(self, query: torch.Tensor, pages: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of [B, Hq, 1, D] ``query`` over the rows of ``pages`` ([B, Hkv, k] ascending, the newest page
        last, as :meth:`select_pages` returns them): the whole pages are copied (:func:`~mmaccel.kernels.gather_pages`),
        the newest, possibly partial, page is appended, and SDPA reads the copy. The same result as
        :func:`~mmaccel.kernels.decode_attention` with ``pages=`` (tested), 3-4x faster on the CPU at 4k."""
        newest = (self.kmin.shape[2] - 1) * self.page_size
        B, H, T, D = self.keys.shape
        n = (pages.shape[-1] - 1) * self.page_size

        def rows(cache):
            out = cache.new_empty(B, H, n + T - newest, D)
            gather_pages(cache, pages[..., :-1], self.page_size, out=out)
            out[:, :, n:].copy_(cache[:, :, newest:])
            return out

        return attention(query, rows(self.keys), rows(self.values), causal=False, scaling=scaling, backend="sdpa")

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.kmin, self.kmax) if t is not None]

    def reset(self) -> None:
        super().reset()
        self.kmin = self.kmax = self.last_pages = None
        self.read_fractions = []
        self._stores = {}


@dataclass
class Quest(KVMethod):
    """Quest (Tang et al., 2024, arXiv 2406.10774): read only the top-k key pages per KV head at each decode step.

    The full K/V stays in the cache, in pages of ``page_size`` tokens with the element-wise min and max of each
    page's keys ([B, Hkv, P, D] each, bookkeeping). At a decode step each page gets Quest's upper bound of its
    attention logit, ``sum_d max(q_d * kmin_d, q_d * kmax_d)`` (averaged over the query heads of the GQA group, so a
    group reads one set of K/V rows), the best pages up to the token budget are kept, the newest page always, and
    attention reads only them through :func:`mmaccel.kernels.decode_attention` (``pages=``). Prefill is dense, and so
    are the first ``dense_layers`` layers at every step, as in Quest's own evaluation (its first two layers attend to
    everything: their attention is not sparse enough for page selection).

    **Quest bounds the K/V read per step, not the K/V held**: ``kv_cache_bytes`` equals full attention's (plus the
    page bounds in ``bookkeeping_bytes``). The telemetry reports the fraction read per decode step.

    Parameters
    ----------
    budget : int or None
        Tokens read per decode step and KV head, rounded up to whole pages (default 256).
    ratio : float or None
        Fraction of the context read instead, in (0, 1] (``quest:ratio=0.25``).
    page_size : int
        Tokens per page, >= 1 (default 8, the measured best; Quest's paper uses 16).
    dense_layers : int
        The first this many layers read the whole cache at every step, >= 0 (default 2, as in Quest). They count in
        the telemetry's read fraction.
    group : {"max", "mean"}
        How a GQA group's query heads combine their page bounds (:func:`quest_page_scores`): ``"max"`` (default, the
        measured best) or ``"mean"`` (Quest's per-head score averaged over the group). On smollm2-135m at 4k,
        ``"max"`` finds the needle's page for 94% of the retrieving (head, step) pairs at 25% against 91% for
        ``"mean"`` (``studies/needle_digits/quest_recall.py``).

    The defaults are the best record's: on the GQA model smollm2-135m, ``quest:ratio=0.19`` (= ``group=max``,
    ``page_size=8``) answers 20/20 NIAH documents at 4k, as full attention does, while reading 0.244 of the K/V per
    step, where the paper's setting (``group=mean:page_size=16``) answers 7/10 reading 25%
    (``benchmarks/results/longctx/smollm2_quest_group_max_4k``).

    Notes
    -----
    A budget covering every page reads everything (bit-exact with full attention). Padded batches, beam search and
    cropping raise; chunked prefill works through ``generate(prefill_chunk_size=C)`` and the ``Chunked`` wrapper alike.

    Raises
    ------
    ValueError
        On a bad hyper-parameter, or both ``budget`` and ``ratio``.
    """

    budget: int | None = None
    ratio: float | None = None
    page_size: int = 8
    dense_layers: int = 2
    group: str = "max"

    method_name = "quest"
    prefill_is_full = True  # dense prefill; pages are bounded in update and read sparsely at decode only
    uses_hooks = False

    def __post_init__(self):
        name = self.method_name
        if self.budget is not None and self.ratio is not None:
            raise ValueError(f"{name}: give budget (tokens read per step) or ratio (fraction read), not both")
        if self.ratio is not None:
            _check_ratio(name, self.ratio)
        else:
            if self.budget is None:
                self.budget = 256
            _check_int(name, "budget", self.budget, 1, f"pass the tokens read per decode step, e.g. {name}:budget=256")
        _check_int(name, "page_size", self.page_size, 1, f"e.g. {name}:page_size=8")
        _check_int(name, "dense_layers", self.dense_layers, 0, f"e.g. {name}:dense_layers=2 (0: every layer sparse)")
        check_group(name, self.group)

    def make_layer(self, layer_idx: int) -> QuestLayer:
        return QuestLayer(self.budget, self.ratio, self.page_size, dense=layer_idx < self.dense_layers,
                          group=self.group)

    def make_cache(self, model: torch.nn.Module) -> OwnedAttentionCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done)."""
        return OwnedAttentionCache(model, self)

    def telemetry(self, cache) -> dict:
        """``method``, ``spec``, the hyper-parameters, ``seen_tokens``, ``kv_read_fraction_per_step`` (per decode
        step, mean over layers of the fraction of held K/V rows read), ``kv_read_fraction`` (their mean),
        ``kv_cache_bytes`` (the full cache: Quest does not evict), ``bookkeeping_bytes`` (page bounds), ``warnings``
        (a warning when every step read everything)."""
        layers = [l for l in getattr(cache, "layers", []) if isinstance(l, QuestLayer)]
        steps = min((len(l.read_fractions) for l in layers), default=0)
        per_step = [sum(float(l.read_fractions[i]) for l in layers) / len(layers) for i in range(steps)]
        warnings = list(getattr(cache, "warnings", []))
        if per_step and min(per_step) >= 1.0:
            warnings.append(f"budget {self.budget if self.ratio is None else f'ratio {self.ratio}'} covers the "
                            "whole context: every decode step read all K/V (ran as full attention)")
        seen = max((l.cumulative_length for l in layers), default=0)
        return {
            "method": self.name,
            "spec": self.spec,
            "budget": self.budget,
            "ratio": self.ratio,
            "page_size": self.page_size,
            "dense_layers": self.dense_layers,
            "group": self.group,
            "seen_tokens": seen,
            "kept_tokens_per_layer": [l.keys.shape[2] if l.is_initialized else 0 for l in layers],
            "evicted_tokens": 0,
            "kv_read_fraction_per_step": [round(f, 6) for f in per_step],
            "kv_read_fraction": sum(per_step) / len(per_step) if per_step else 1.0,
            "kv_cache_bytes": kv_cache_bytes(cache),
            "bookkeeping_bytes": bookkeeping_bytes(cache),
            "warnings": warnings,
        }
