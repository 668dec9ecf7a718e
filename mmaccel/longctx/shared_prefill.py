"""One full-attention prefill for many KV-cache methods: a fan-out that gives each method its own compressed cache.

SnapKV, PyramidKV, ChunkKV, KNorm, TOVA, H2O, StreamingLLM, AdaKV over them, KVQuant and Quest all run the same prefill
forward -- full attention over the prompt -- and differ only in what they keep of each layer's K/V afterwards (their
``prefill_is_full`` class attribute says so). :class:`SharedPrefill` runs that forward once: at every layer, after
attention, each method gets the layer's full K/V in its own cache layer and scores and keeps its share, exactly as its
own ``on_step`` would have in its own run. After one prefill there are N caches, each what that method's own prefill
would have produced, and each decodes on its own (:meth:`SharedPrefill.decode_cache`). KVzip too: its prefill forward
is full attention, and its reconstruction forwards run on its filled cache after the shared forward
(:meth:`SharedPrefill.finish`), as they run after its own.

>>> shared = SharedPrefill([SnapKV(budget=64), TOVA(budget=64)])
>>> out = model.generate(ids, past_key_values=shared.make_cache(model), max_new_tokens=1)  # the one prefill
>>> shared.finish(model, ids)  # what a member does after its forward (nothing here; KVzip reconstructs)
>>> cache = shared.decode_cache(0, model)  # SnapKV's cache, ready to decode from ids + out[:, -1:]

Memory: the full K/V of a layer lives only while that layer is fanned out (the leading cache drops it afterwards);
beyond that each method holds what it keeps, and a sliding-window layer its window. :func:`mmaccel.eval.shared.generate_shared` is the measured harness.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import Cache

from ..kernels._common import synchronize
from .base import EvictingLayer, KVMethod, KVMethodCache, LayerStep, close_cache


def shares_prefill(method) -> bool:
    """Whether ``method`` can be served by a shared full-attention prefill.

    Parameters
    ----------
    method : object
        A KV-cache method (:data:`mmaccel.longctx.METHODS`) or anything else.

    Returns
    -------
    bool
        True exactly when ``method.prefill_is_full`` is True: its prefill forward is full attention and it only
        compresses what it keeps (``full``, ``streaming``, ``snapkv``, ``pyramidkv``, ``h2o``, ``tova``, ``knorm``,
        ``chunkkv`` / ``adakv`` over them, ``kvquant``, ``quest``, ``kvzip``, and ``retrieval_heads`` / ``razor`` with
        their default ``prefill="dense"``). False for methods that change the prefill itself (``chunked``,
        ``chunked_ffn``, ``retrieval_heads:prefill=sparse``, ``bilevel``, ``longheads``, ``minference``) and for
        non-KV methods.
    """
    return isinstance(method, KVMethod) and getattr(method, "prefill_is_full", False) is True


@dataclass
class SharedPrefill(KVMethod):
    """The fan-out: one full-attention prefill whose every layer hands its K/V to each method's own cache layer.

    Parameters
    ----------
    methods : list of KVMethod
        The methods served, each with ``shares_prefill(method)`` True. Instances are used as they are (two
        instances of one class with other budgets are two members).

    Attributes
    ----------
    compress_s : list of float
        Per member, seconds spent in its own work during the last prefill (copying the layer's K/V into its cache
        layer, scoring and keeping), summed over layers; CUDA is synchronised around each.
    holders : list of KVMethodCache
        Per member, the cache its layers live in during the prefill (no hooks of its own); filled by
        :meth:`make_cache`, handed over by :meth:`decode_cache`.

    Raises
    ------
    ValueError
        If ``methods`` is empty or holds a method whose prefill is not full attention (naming it and the fix).

    Notes
    -----
    The leading cache (:meth:`make_cache`) is a :class:`~mmaccel.longctx.base.KVMethodCache` of plain
    :class:`~mmaccel.longctx.base.EvictingLayer` s, so the prefill's attention is the stock attention of a
    full-attention run. A member whose own cache computes attention itself (AdaKV, KVQuant, Quest:
    :mod:`mmaccel.longctx.owned`) computes the same full attention over the same K/V at prefill, through
    :func:`mmaccel.kernels.attention` -- equal in exact arithmetic, and bit-identical on the CPU (SDPA both ways; tested
    on micro-lm and a tiny GQA Llama). On CUDA that kernel may be flash-attn where the model runs SDPA, so those three
    can differ from their own runs by kernel rounding (not checked on a GPU yet). Sliding-window layers (Gemma 3,
    Qwen2 with ``layer_types``) are no method's to compress: every method's own run leaves them to transformers'
    ``DynamicSlidingWindowLayer``. The leading cache keeps them the same way, and each member's decode cache starts
    from the window they hold after the prefill (the same tensors, as its own run would hold them: a slice of the
    prefill's K/V until the next update, which :func:`~mmaccel.longctx.base.kv_cache_bytes` counts whole). A layer that is neither full attention nor a sliding window is
    refused.
    """

    methods: list = field(default_factory=list)

    method_name = "shared_prefill"

    def __post_init__(self):
        if not self.methods:
            raise ValueError("SharedPrefill needs at least one KV-cache method, e.g. SharedPrefill([SnapKV()])")
        refused = [getattr(m, "name", type(m).__name__) for m in self.methods if not shares_prefill(m)]
        if refused:
            raise ValueError(
                f"{', '.join(refused)}: not served by a shared prefill (the method changes the prefill itself, or is "
                "not a KV-cache method); run it on its own with generate_measured(..., method=...)"
            )
        self.holders: list[KVMethodCache] = []
        self.compress_s: list[float] = []
        self._device = None
        self._windows: dict[int, object] = {}  # the leader's sliding-window layers, by index, after the prefill

    @property
    def spec(self) -> str:
        return "shared_prefill:" + ",".join(m.spec for m in self.methods)

    def make_cache(self, model: torch.nn.Module, *, speculative: bool = False) -> KVMethodCache:
        """The leading cache for one prefill of ``model`` (pass it to ``generate(..., max_new_tokens=1)`` or a forward).

        Also builds a fresh holder cache per member and zeroes :attr:`compress_s`.

        Raises
        ------
        ValueError
            For ``speculative=True``, or a model with a layer that is neither full attention nor a sliding window.
        """
        if speculative:
            raise ValueError("a shared prefill has no speculative cache; decode each member's cache instead")
        self.holders = [m.prefill_holder(model) for m in self.methods]
        self._finished = False
        self.compress_s = [0.0] * len(self.methods)
        self._device = getattr(model, "device", None)
        leader = KVMethodCache(model, self)
        special = [i for i, layer in enumerate(leader.layers)
                   if not isinstance(layer, EvictingLayer) and not getattr(layer, "is_sliding", False)]
        if special:
            leader.close()
            raise ValueError(f"layers {special} of {type(model).__name__} are neither full-attention nor "
                             "sliding-window layers; a shared prefill cannot serve them: run each method alone")
        self._windows = {i: layer for i, layer in enumerate(leader.layers) if not isinstance(layer, EvictingLayer)}
        return leader

    def on_step(self, step: LayerStep) -> None:
        """Hand this layer's K/V [B, Hkv, S, D] to every member's own layer, let it keep its share, then drop it here.

        Raises
        ------
        ValueError
            On a second forward (decode or a second prefill chunk): the leading cache serves one prefill only.
        """
        if step.phase != "prefill" or step.layer.cumulative_length != step.query_length:
            raise ValueError("a SharedPrefill cache serves one prefill forward; decode with decode_cache(i, model), "
                             "and prefill in one forward (no prefill_chunk_size)")
        for i, (method, holder) in enumerate(zip(self.methods, self.holders)):
            synchronize(self._device)
            start = time.perf_counter()
            layer = holder.layers[step.layer_idx]
            layer.update(step.keys, step.values)
            method.keep_shared(LayerStep(holder, layer, step.layer_idx, step.module, step.hidden_states,
                                         step.position_embeddings, step.attention_mask, "prefill"))
            synchronize(self._device)
            self.compress_s[i] += time.perf_counter() - start
        lead = step.layer  # the full K/V of this layer is needed by no later layer: free it
        lead.keys, lead.values = lead.keys[..., :0, :], lead.values[..., :0, :]
        lead.positions = lead.positions[..., :0]

    def finish(self, model: torch.nn.Module, input_ids: torch.Tensor) -> None:
        """After the prefill forward of ``input_ids`` [B, L] (and after closing the leading cache): let every member
        finish its prefill as its own run would after its forward (:meth:`~mmaccel.longctx.base.KVMethod.
        finish_shared_prefill`: KVzip's reconstruction and eviction), with the leader's prefilled sliding windows in
        place of its empty ones (a forward it runs reads them; they must not be written in place). Its seconds are
        added to :attr:`compress_s`. Call it once, before :meth:`decode_cache`."""
        self._finished = True
        for i, (method, holder) in enumerate(zip(self.methods, self.holders)):
            if holder is None:
                continue
            for j, window in self._windows.items():  # the prefilled windows, as the member's own run holds them
                if window.keys is not None:
                    holder.layers[j] = window
            synchronize(self._device)
            start = time.perf_counter()
            method.finish_shared_prefill(holder, model, input_ids)
            synchronize(self._device)
            self.compress_s[i] += time.perf_counter() - start

    def decode_cache(self, index: int, model: torch.nn.Module) -> Cache:
        """Member ``index``'s cache, ready to decode: its own ``make_cache(model)`` holding what its prefill kept.

        Close it (``cache.close()`` where it has one) before making the next member's cache: caches that compute
        their own attention drive the model's modules one at a time.

        Parameters
        ----------
        index : int
            Position of the member in :attr:`methods`.
        model : torch.nn.Module
            The model the prefill ran on.

        Returns
        -------
        transformers.Cache
            The member's fresh cache whose layers took over the prefilled state (the same K/V tensors, positions,
            per-slot state and counters), and its warnings.

        Raises
        ------
        ValueError
            If no prefill ran since :meth:`make_cache`, ``index`` is out of range, or the member finishes its
            prefill after the forward (KVzip) and :meth:`finish` was not called.
        """
        if not 0 <= index < len(self.holders) or self.holders[index] is None:
            raise ValueError(f"no prefilled cache {index}: run the prefill with make_cache(model) first; each "
                             "member's cache is handed over once")
        method = self.methods[index]
        if not self._finished and type(method).finish_shared_prefill is not KVMethod.finish_shared_prefill:
            raise ValueError(f"{method.name} finishes its prefill after the forward: call finish(model, input_ids) "
                             "after the shared prefill, then decode_cache")
        holder, self.holders[index] = self.holders[index], None  # the decode cache alone holds the K/V from now on
        cache = self.methods[index].make_cache(model)
        for i, (mine, prefilled) in enumerate(zip(cache.layers, holder.layers)):
            window = self._windows.get(i)
            if window is not None and window.keys is not None:  # the leader's window after the prefill
                prefilled = window
            if type(mine) is not type(prefilled):
                close_cache(cache)
                raise ValueError(f"{self.methods[index].name}: its cache builds {type(mine).__name__} layers, the "
                                 f"prefill filled {type(prefilled).__name__}")
            # same objects: owned-attention modules keep their reference; a window's tensors are shared by the
            # members (never written in place: the sliding layer replaces them with a new tensor at its next update)
            mine.__dict__.update(prefilled.__dict__)
        if hasattr(cache, "warnings"):
            cache.warnings.extend(w for w in holder.warnings if w not in cache.warnings)
        return cache

