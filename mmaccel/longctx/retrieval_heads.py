"""Retrieval heads keep the full cache, streaming heads keep sinks + a recent window (DuoAttention, RazorAttention).

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", 2024,
arXiv 2410.10819. Tang et al., "RazorAttention: Efficient KV Cache Compression Through Retrieval Heads", 2024,
arXiv 2407.15891.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import Streaming, attention, decode_attention, sparse_prefill_attention
from ..kernels._common import attend as masked_attend
from .base import KVMethod, _check_int, bookkeeping_bytes, held_tokens, kv_cache_bytes
from .head_pattern import HeadPattern, load_head_pattern
from .owned import AttentionOwningLayer, OwnedAttentionCache


def query_heads_of(kv_heads: torch.Tensor, group: int) -> torch.Tensor:
    """Query-head indices [len(kv_heads) * group] of the given KV heads (HF ``repeat_kv`` layout: query head ``h``
    reads KV head ``h // group``), in order, so a GQA group stays contiguous."""
    return (kv_heads[:, None] * group + torch.arange(group, device=kv_heads.device)).flatten()


class SplitHeadsLayer(AttentionOwningLayer):
    """A layer that stores retrieval KV heads in full and streaming KV heads as sinks + a recent window, apart.

    Attributes
    ----------
    keys, values : torch.Tensor
        [B, R, T, D] K/V of the ``R`` retrieval heads: every token seen.
    stream_keys, stream_values : torch.Tensor
        [B, S, n, D] K/V of the ``S = Hkv - R`` streaming heads, ``n <= sink + window`` after every forward: the
        first ``sink`` tokens, then the ``window`` most recent ones (slot order = position order).
    comp_keys, comp_values : torch.Tensor or None
        [B, S, 1, D] RazorAttention's compensation token (mean K and mean V of every token the streaming heads
        dropped), with ``comp_count`` tokens behind it; ``None`` without compensation.

    Notes
    -----
    Each query of a streaming head attends the ``sink`` first tokens and the ``window`` tokens before it plus itself
    (``Streaming(sink, window + 1)``); with ``dense_prefill`` a multi-token forward's queries attend causally to
    everything held (the whole prompt, for one prefill) and only then is the window trimmed. Computed over slot indices, which equal positions up to a constant offset for
    every non-sink slot. The compensation slot joins every streaming query's softmax with weight ``comp_count``
    (an additive ``log(comp_count)`` bias, as if each dropped token had the mean key and value); tokens that leave the
    window *inside* one prefill chunk are folded in after that chunk.
    """

    def __init__(self, retrieval: tuple[int, ...], num_kv_heads: int, sink: int, window: int, compensation: bool,
                 dense_prefill: bool = False):
        super().__init__()
        self.dense_prefill = dense_prefill
        self.num_kv_heads = num_kv_heads
        self.retrieval = torch.tensor(sorted(retrieval), dtype=torch.long)
        self.streaming = torch.tensor([h for h in range(num_kv_heads) if h not in set(retrieval)], dtype=torch.long)
        self.sink, self.window, self.compensation = sink, window, compensation
        self.stream_keys = self.stream_values = None
        self.comp_keys = self.comp_values = None
        self.comp_count = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.retrieval, self.streaming = self.retrieval.to(self.device), self.streaming.to(self.device)
        B, _, _, D = key_states.shape
        Dv = value_states.shape[-1]
        R, S = len(self.retrieval), len(self.streaming)
        self.keys = key_states.new_empty(B, R, 0, D)
        self.values = value_states.new_empty(B, R, 0, Dv)
        self.stream_keys = key_states.new_empty(B, S, 0, D)
        self.stream_values = value_states.new_empty(B, S, 0, Dv)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append [B, Hkv, q, D] K/V to the two groups; return the retrieval group's [B, R, T, D] K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[1] != self.num_kv_heads:
            raise ValueError(f"expected {self.num_kv_heads} KV heads, got {key_states.shape[1]}")
        self.keys = torch.cat([self.keys, key_states.index_select(1, self.retrieval)], dim=-2)
        self.values = torch.cat([self.values, value_states.index_select(1, self.retrieval)], dim=-2)
        self.stream_keys = torch.cat([self.stream_keys, key_states.index_select(1, self.streaming)], dim=-2)
        self.stream_values = torch.cat([self.stream_values, value_states.index_select(1, self.streaming)], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        return self.keys, self.values

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        B, Hq, q, _ = query.shape
        self.check_unpadded(attention_mask, q, "retrieval_heads")
        group = Hq // self.num_kv_heads
        out = query.new_empty(B, Hq, q, self.values.shape[-1])
        if len(self.retrieval):
            qi = query_heads_of(self.retrieval, group)
            qr = query.index_select(1, qi)
            if q == 1:
                part = decode_attention(qr, self.keys, self.values, scaling=scaling)
            else:
                part = attention(qr, self.keys, self.values, causal=True, scaling=scaling)
            out.index_copy_(1, qi, part)
        if len(self.streaming):
            qi = query_heads_of(self.streaming, group)
            out.index_copy_(1, qi, self._streaming_attention(query.index_select(1, qi), scaling))
            self._trim()
        return out

    def _streaming_attention(self, qs: torch.Tensor, scaling: float) -> torch.Tensor:
        k, v = self.stream_keys, self.stream_values
        q, n = qs.shape[2], k.shape[2]
        if self.comp_keys is not None and self.comp_count > 0:
            slot = torch.arange(n, device=k.device)
            qa = torch.arange(n - q, n, device=k.device)[:, None]
            allowed = (slot <= qa) & ((slot < self.sink) | (qa - slot <= self.window))
            allowed = torch.cat([allowed.new_ones(q, 1), allowed], dim=-1)
            bias = torch.zeros(n + 1, device=k.device)
            bias[0] = math.log(self.comp_count)
            out, _ = masked_attend(qs, torch.cat([self.comp_keys, k], 2), torch.cat([self.comp_values, v], 2),
                                   allowed, scaling, bias)
            return out.to(qs.dtype)
        if q == 1:  # everything held is inside the window of the newest token
            return decode_attention(qs, k, v, scaling=scaling)
        if self.dense_prefill:  # RazorAttention: the prompt attends to everything held; eviction comes after
            return attention(qs, k, v, causal=True, scaling=scaling)
        return sparse_prefill_attention(qs, k, v, Streaming(self.sink, self.window + 1), scaling=scaling)

    def _trim(self) -> None:
        n = self.stream_keys.shape[2]
        keep = self.sink + self.window
        if n <= keep:
            return
        lo, hi = self.sink, n - self.window
        if self.compensation:
            dropped_k = self.stream_keys[:, :, lo:hi].float().sum(2, keepdim=True)
            dropped_v = self.stream_values[:, :, lo:hi].float().sum(2, keepdim=True)
            c, m = self.comp_count, hi - lo
            if self.comp_keys is None:
                self.comp_keys, self.comp_values = dropped_k / m, dropped_v / m
            else:
                self.comp_keys = (self.comp_keys.float() * c + dropped_k) / (c + m)
                self.comp_values = (self.comp_values.float() * c + dropped_v) / (c + m)
            self.comp_keys = self.comp_keys.to(self.dtype)
            self.comp_values = self.comp_values.to(self.dtype)
            self.comp_count = c + m
        self.stream_keys = torch.cat([self.stream_keys[:, :, :lo], self.stream_keys[:, :, hi:]], dim=2)
        self.stream_values = torch.cat([self.stream_values[:, :, :lo], self.stream_values[:, :, hi:]], dim=2)

    def stream_positions(self) -> torch.Tensor:
        """int64 [n] sequence positions of the streaming slots held."""
        n = self.stream_keys.shape[2] if self.stream_keys is not None else 0
        first = min(n, self.sink)
        return torch.cat([torch.arange(first), torch.arange(self.cumulative_length - (n - first),
                                                            self.cumulative_length)])

    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.stream_keys, self.stream_values, self.comp_keys,
                            self.comp_values) if isinstance(t, torch.Tensor)]

    def reset(self) -> None:
        super().reset()
        self.stream_keys = self.stream_values = self.comp_keys = self.comp_values = None
        self.comp_count = 0


@dataclass
class RetrievalHeads(KVMethod):
    """DuoAttention-style split (Xiao et al., 2024, arXiv 2410.10819): full KV for retrieval heads, sinks + recent
    window for streaming heads, per KV head.

    The head pattern (:class:`~mmaccel.longctx.head_pattern.HeadPattern`, a JSON file per model, found by
    :func:`mmaccel.longctx.head_finder.find_retrieval_heads`) lists the (layer, KV head) pairs that are retrieval
    heads. Each layer stores the two groups apart (:class:`SplitHeadsLayer`): ``R`` retrieval heads hold [B, R, T, D]
    K/V (every token), ``S`` streaming heads hold [B, S, <= sink + window, D]; so ``kv_cache_bytes`` falls by about
    the fraction of streaming heads once ``T >> sink + window``. Attention runs through :mod:`mmaccel.kernels` on
    what each group holds: dense for retrieval heads; for streaming heads a causal prefill over the prompt (default
    ``prefill="dense"``; ``"sparse"``: ``Streaming(sink, window + 1)`` through ``sparse_prefill_attention``) and
    ``decode_attention`` over sinks + window at decode, both groups in one model forward.

    Parameters
    ----------
    pattern : str or HeadPattern
        A shipped pattern name (``"micro-lm"``), a path to a pattern JSON file, or a pattern object.
    sink : int
        Initial tokens each streaming head keeps, >= 0 (default 4).
    window : int
        Recent tokens each streaming head keeps, >= 1 (default 256).
    fraction : float or None
        Re-threshold the pattern: the best-scored ``ceil(fraction * layers * kv_heads)`` pairs become the retrieval
        heads (default: the file's own set).
    compensation : bool
        Add RazorAttention's compensation token to the streaming heads (:class:`RazorAttention` turns it on).
    prefill : str
        How streaming heads attend during the prefill: ``"dense"`` (default: the whole prompt, then evict to sinks +
        window, as RazorAttention) or ``"sparse"`` (sinks + window, as DuoAttention; cheaper). Choices: dense, sparse.
        The default is the measured best: on smollm2-135m at 4k,
        ``retrieval_heads:pattern=smollm2-135m-gates:fraction=0.2:window=192`` answers 10/10 NIAH documents with dense
        prefill and 5/10 with sparse prefill (the streaming heads' sparse prefill loses the needle before the retrieval
        heads read it; ``benchmarks/results/longctx/smollm2_gates_sparse_4k/``). Sparse prefill saves prefill
        compute, not K/V held (both hold sinks + window per streaming head after the prefill).

    Notes
    -----
    With ``prefill="sparse"`` the prefill of streaming heads is itself sparse (each query sees sinks + window), as in
    DuoAttention; with ``"dense"`` (the default) the prompt attends fully and only the held cache is bounded. Chunked prefill
    (``generate(..., prefill_chunk_size=C)`` or the :class:`~mmaccel.longctx.chunked.Chunked` wrapper): each chunk's
    streaming queries see the held sinks + window plus the chunk, which for ``"sparse"`` is the unchunked result and
    for ``"dense"`` bounds what a streaming head's prompt query sees to sinks + window + its chunk. Padded batches, beam search and cropping raise.

    Each shipped pattern carries a card (:attr:`~mmaccel.longctx.head_pattern.HeadPattern.validation`) with its score
    on text it was not fitted on (figures: ``studies/calibration_transfer/``). ``smollm2-135m`` (training-free) does
    not transfer to prose it was not fitted on, and a cache built with it says so in its warnings;
    ``smollm2-135m-gates`` transfers.

    Raises
    ------
    ValueError
        On a bad hyper-parameter; in :meth:`make_cache`, for an unknown pattern file or a pattern made for another
        model (layer or head counts differ).
    """

    pattern: object = None
    sink: int = 4
    window: int = 256
    fraction: float | None = None
    compensation: bool = False
    prefill: str = "dense"

    method_name = "retrieval_heads"
    uses_hooks = False

    def __post_init__(self):
        if self.pattern is None or (isinstance(self.pattern, str) and not self.pattern):
            raise ValueError(f"{self.method_name}: pass pattern=NAME_OR_PATH (a head-pattern JSON), e.g. "
                             f"{self.method_name}:pattern=micro-lm")
        _check_int(self.method_name, "sink", self.sink, 0, "e.g. sink=4")
        _check_int(self.method_name, "window", self.window, 1, "e.g. window=256")
        if self.fraction is not None and (isinstance(self.fraction, bool) or not 0 <= self.fraction <= 1):
            raise ValueError(f"{self.method_name}: fraction must be in [0, 1], got {self.fraction!r}")
        if not isinstance(self.compensation, bool):
            raise ValueError(  # noqa: TRY004 - a bad spec value, reported like every other one
                f"{self.method_name}: compensation must be true or false, got {self.compensation!r}")
        if self.prefill not in ("sparse", "dense"):
            raise ValueError(f"{self.method_name}: prefill must be 'sparse' or 'dense', got {self.prefill!r}; "
                             f"e.g. {self.method_name}:prefill=dense")
        self._resolved: HeadPattern | None = None

    @property
    def prefill_is_full(self) -> bool:
        """True with ``prefill="dense"``: every head attends to the whole prompt and the streaming heads are trimmed
        after it, so a shared full-attention prefill serves it (:mod:`mmaccel.longctx.shared_prefill`)."""
        return self.prefill == "dense"

    def keep_shared(self, step) -> None:
        """Shared prefill: trim the holder layer's streaming heads to sinks + window (folding the dropped tokens
        into the compensation slot), as the layer does after its own dense prefill attention."""
        step.layer._trim()

    @property
    def pattern_label(self) -> str:
        """The pattern's name or path (``"<in-memory>"`` for a pattern object not loaded from a file)."""
        if isinstance(self.pattern, HeadPattern):
            return self.pattern.source or "<in-memory>"
        return str(self.pattern)

    @property
    def spec(self) -> str:
        return (f"{self.name}:pattern={self.pattern_label}:sink={self.sink}:window={self.window}:fraction={self.fraction}"
                f":compensation={self.compensation}:prefill={self.prefill}")

    def resolve(self, model: torch.nn.Module | None = None) -> HeadPattern:
        """The head pattern in use (``fraction`` applied), checked against ``model`` when given.

        Raises
        ------
        ValueError
            Unknown pattern, or a pattern for another model.
        """
        pattern = load_head_pattern(self.pattern)
        if self.fraction is not None:
            pattern = pattern.with_fraction(self.fraction)
        self._warnings = pattern.check_model(model.config) if model is not None else []
        if pattern.validation.get("transfers") is False:  # its card says so: the user sees it in the cache's warnings
            self._warnings.append(f"head pattern {self.pattern_label!r}: "
                                  f"{pattern.validation.get('summary', 'does not transfer to held-out data')} "
                                  f"({pattern.validation.get('record', 'no record')})")
        self._resolved = pattern
        return pattern

    def make_layer(self, layer_idx: int) -> SplitHeadsLayer:
        pattern = self._resolved or self.resolve()
        return SplitHeadsLayer(pattern.heads_of(layer_idx), pattern.num_kv_heads, self.sink, self.window,
                               self.compensation, dense_prefill=self.prefill == "dense")

    def make_cache(self, model: torch.nn.Module) -> OwnedAttentionCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done)."""
        self.resolve(model)
        cache = OwnedAttentionCache(model, self)
        for message in self._warnings:
            cache.warn(message)
        return cache

    def telemetry(self, cache) -> dict:
        """``method``, ``spec``, the hyper-parameters, ``seen_tokens``, ``retrieval_heads_per_layer``,
        ``kept_tokens_per_layer`` (mean held slots per KV head), ``evicted_tokens`` (seen - kept, summed over
        layers), ``kv_cache_bytes`` (both groups and the compensation tokens), ``bookkeeping_bytes``,
        ``kv_fraction`` (held slots / seen slots over all KV heads) and ``warnings``."""
        layers = [l for l in getattr(cache, "layers", []) if isinstance(l, SplitHeadsLayer)]
        seen = max((l.cumulative_length for l in layers), default=0)
        kept, held, total = [], 0, 0
        for l in layers:
            slots = len(l.retrieval) * held_tokens(l) + len(l.streaming) * (
                l.stream_keys.shape[2] if l.stream_keys is not None else 0)
            kept.append(round(slots / l.num_kv_heads, 3))
            held += slots
            total += l.num_kv_heads * l.cumulative_length
        pattern = self._resolved
        return {
            "method": self.name,
            "spec": self.spec,
            "pattern": self.pattern_label,
            "sink": self.sink,
            "window": self.window,
            "fraction": self.fraction,
            "compensation": self.compensation,
            "prefill": self.prefill,
            "retrieval_fraction": pattern.retrieval_fraction if pattern else None,
            "retrieval_heads_per_layer": [len(l.retrieval) for l in layers],
            "seen_tokens": seen,
            "kept_tokens_per_layer": kept,
            "evicted_tokens": round(sum(seen - k for k in kept), 3),
            "kv_fraction": held / total if total else 1.0,
            "kv_cache_bytes": kv_cache_bytes(cache),
            "bookkeeping_bytes": bookkeeping_bytes(cache),
            "warnings": list(getattr(cache, "warnings", [])),
        }


@dataclass
class RazorAttention(RetrievalHeads):
    """RazorAttention (Tang et al., 2024, arXiv 2407.15891): the retrieval-head split with a compensation token.

    As :class:`RetrievalHeads`, but ``compensation`` defaults to true (every streaming head keeps one extra slot, the
    mean key and mean value of the tokens it dropped, weighted in the softmax by their count) and ``prefill`` to
    ``"dense"`` (as for :class:`RetrievalHeads`): RazorAttention compresses the cache after a full-attention prefill.
    """

    compensation: bool = True

    method_name = "razor"
