"""Shared mechanics of the KV-cache methods: the evicting cache layer, the cache, top-k keep, byte accounting.

A KV-cache method (:class:`KVMethod`) is a small dataclass that says only what is new about it; everything that
touches transformers' ``Cache`` lives here once:

- :class:`EvictingLayer` -- a ``DynamicLayer`` that remembers the true sequence index of every slot it holds and can
  keep a subset of its slots per KV head (:meth:`EvictingLayer.keep`), really freeing the dropped K/V.
- :class:`KVMethodCache` -- a ``DynamicCache`` whose full-attention layers are :class:`EvictingLayer` s, plus an
  optional, self-removing "after prefill attention" hook per decoder layer (:meth:`KVMethodCache.observe_prefill`).
- :func:`topk_keep_indices`, :func:`mean_over_query_groups`, :func:`window_queries` -- the scoring helpers.
- :func:`kv_cache_bytes` -- bytes of the K/V tensors a cache really holds.

Positions and masks
-------------------
Keys are cached after RoPE, so an evicted cache keeps the true positions of what it holds. The new tokens must then
also get their true positions: ``generate`` derives ``position_ids`` from the attention mask and advances them by one
per step, independently of the cache length, and a hand-written loop that omits ``position_ids`` gets them from
``cache.get_seq_length()``, which for an :class:`EvictingLayer` is the number of tokens *seen* (like
``DynamicSlidingWindowLayer``), not the number held. ``get_mask_sizes`` returns ``(held + q_len, seen - held)``, so the
causal mask lets every query see every held slot plus the causal part of its own chunk.

Batch > 1: rows are compressed independently (per row and per KV head); all rows hold the same number of slots.
With left padding the 2-D padding mask is lined up with the *last* held slots (``get_mask_sizes``' offset), which is
right only when a method keeps a contiguous recent window. So SnapKV and StreamingLLM with sinks refuse padded
batches with a clear error (:func:`has_padding`); StreamingLLM with ``sink=0`` is exact with padding.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- byte accounting
def kv_cache_bytes(cache: Cache) -> int:
    """Bytes of the key and value tensors a cache actually holds.

    Parameters
    ----------
    cache : transformers.Cache
        Any cache whose layers keep ``.keys``/``.values`` tensors (``DynamicCache``, :class:`KVMethodCache`, ...).

    Returns
    -------
    int
        Sum of ``keys.nbytes + values.nbytes`` over all layers, in bytes; uninitialised layers count 0. Bookkeeping
        such as :attr:`EvictingLayer.positions` is not counted.
    """
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return int(total)


def has_padding(attention_mask) -> bool:
    """Whether a decoder layer's prepared 4-D attention mask hides any key from the last query (a padded batch).

    Parameters
    ----------
    attention_mask : torch.Tensor or None
        [B, 1, q, k] boolean (True = attend) or additive float mask, as attention modules receive it; anything
        else (``None`` for an unpadded SDPA batch) counts as unpadded.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return False
    last = attention_mask[..., -1, :]
    return bool((~last).any()) if last.dtype == torch.bool else bool((last != 0).any())


def held_tokens(layer) -> int:
    """Number of sequence slots a cache layer holds (0 if uninitialised)."""
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor) or keys.dim() < 2 or keys.numel() == 0:
        return 0
    return int(keys.shape[-2])


# --------------------------------------------------------------------------------------------------- scoring helpers
def mean_over_query_groups(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Average per-query-head scores within each GQA group, giving one score per KV head.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hq, L] scores per query head; ``Hq`` must be a multiple of ``num_kv_heads``. Query head ``h`` belongs to
        KV head ``h // (Hq // num_kv_heads)`` (the ``repeat_kv`` layout of HF models).
    num_kv_heads : int
        Number of key/value heads ``Hkv``.

    Returns
    -------
    torch.Tensor
        [B, Hkv, L], same dtype as ``scores``.

    Raises
    ------
    ValueError
        If ``Hq`` is not a multiple of ``num_kv_heads``.
    """
    B, Hq, L = scores.shape
    if Hq % num_kv_heads:
        raise ValueError(f"{Hq} query heads are not a multiple of {num_kv_heads} KV heads")
    return scores.reshape(B, num_kv_heads, Hq // num_kv_heads, L).mean(dim=2)


def topk_keep_indices(scores: torch.Tensor, keep: int, *, tail: int = 0) -> torch.Tensor:
    """Indices to keep per KV head: the ``keep`` best-scored slots of the prefix, then the last ``tail`` slots.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hkv, P] scores of the first ``P`` slots, higher = keep.
    keep : int
        How many prefix slots to keep per row and head, ``0 <= keep <= P``.
    tail : int
        Slots ``P .. P + tail - 1`` that are always kept (e.g. SnapKV's observation window).

    Returns
    -------
    torch.LongTensor
        [B, Hkv, keep + tail] slot indices, ascending (original order is preserved).

    Raises
    ------
    ValueError
        If ``keep`` is outside ``[0, P]`` or ``tail < 0``.
    """
    B, H, P = scores.shape
    if not 0 <= keep <= P or tail < 0:
        raise ValueError(f"cannot keep {keep} of {P} prefix slots (+{tail} tail slots)")
    top = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
    window = torch.arange(P, P + tail, device=scores.device).expand(B, H, tail)
    return torch.cat([top, window], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE helper, HF Llama convention: ``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def window_queries(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, window: int):
    """Recompute the post-RoPE queries of the last ``window`` tokens of an attention module's input.

    Works for attention modules with ``q_proj``, ``head_dim`` and an optional ``q_norm`` (Llama, Mistral, Qwen2/3,
    ...), with full-dimension RoPE in the rotate-half convention.

    Parameters
    ----------
    module : torch.nn.Module
        The ``self_attn`` module whose forward received ``hidden_states``.
    hidden_states : torch.Tensor
        [B, Lq, hidden] the attention input (after the input layer norm).
    position_embeddings : tuple of torch.Tensor
        ``(cos, sin)``, each [B or 1, Lq, D], as the model passed them to the module.
    window : int
        Number of trailing queries, ``1 <= window <= Lq``.

    Returns
    -------
    torch.Tensor
        [B, Hq, window, D] queries with RoPE applied, in the model's dtype.

    Raises
    ------
    ValueError
        If the module has no ``q_proj``/``head_dim`` or the RoPE does not cover the full head dimension.
    """
    if not hasattr(module, "q_proj") or not hasattr(module, "head_dim") or position_embeddings is None:
        raise ValueError(
            f"{type(module).__name__} has no q_proj/head_dim or got no position_embeddings; query-scored KV methods "
            "need a Llama-style attention module"
        )
    B = hidden_states.shape[0]
    q = module.q_proj(hidden_states[:, -window:]).view(B, window, -1, module.head_dim)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    if cos.shape[-1] != module.head_dim:
        raise ValueError(f"partial RoPE (rotary dim {cos.shape[-1]} < head_dim {module.head_dim}) is not supported")
    cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
    return q * cos + rotate_half(q) * sin


# ----------------------------------------------------------------------------------------------------- cache layer
class EvictingLayer(DynamicLayer):
    """A ``DynamicLayer`` that can drop slots per KV head while keeping the true positions of what it holds.

    Attributes
    ----------
    keys, values : torch.Tensor
        [B, Hkv, S, D] held K/V (keys after RoPE).
    positions : torch.LongTensor
        [B, Hkv, S] sequence index of every held slot (equal to its RoPE position for unpadded rows).
    cumulative_length : int
        Tokens seen so far; this is what :meth:`get_seq_length` returns.

    Notes
    -----
    :meth:`update` appends the new K/V, calls :meth:`after_update` (where a subclass may evict) and returns the K/V
    *before* eviction, so the tokens of the current forward attend to everything held before it plus their own
    chunk. Evictions cannot be undone, so ``crop`` (assisted decoding) raises.
    """

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cumulative_length = 0
        self.positions: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H = key_states.shape[:2]
        self.positions = torch.empty(B, H, 0, dtype=torch.long, device=key_states.device)

    @property
    def held(self) -> int:
        """Number of slots held (``S``)."""
        return held_tokens(self)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states``/``value_states`` [B, Hkv, q, D], maybe evict, return the pre-eviction K/V."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, q = key_states.shape[:3]
        new_pos = torch.arange(self.cumulative_length, self.cumulative_length + q, device=self.positions.device)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = keys, values
        self.positions = torch.cat([self.positions, new_pos.expand(B, H, q)], dim=-1)
        self.cumulative_length += q
        self.after_update(q)
        return keys, values

    def after_update(self, query_length: int) -> None:
        """Called after every update with the number of new tokens; override to evict. Default: keep all."""

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the given slots, per row and KV head, and free the rest.

        Parameters
        ----------
        indices : torch.LongTensor
            [B, Hkv, K] or [K] slot indices into the held sequence (ascending keeps the original order).
        """
        if indices.dim() == 1:
            indices = indices.expand(*self.keys.shape[:2], -1)
        gather = indices.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather)
        self.positions = self.positions.gather(2, indices)

    def get_seq_length(self) -> int:
        """Tokens seen so far (not the number held), so default position ids stay true after eviction."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(held + query_length, seen - held)``: every query sees all held slots and the causal part of its chunk."""
        held = self.held
        return held + query_length, self.cumulative_length - held

    def reset(self) -> None:
        super().reset()
        self.positions = None

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            f"{type(self).__name__} evicts tokens and cannot be cropped (e.g. by assisted/speculative decoding); "
            "use the 'full' KV-cache method there"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None and self.positions.numel():
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None and self.positions.numel():
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None and self.positions.numel():
            self.positions = self.positions[indices, ...]


# ----------------------------------------------------------------------------------------------------------- cache
PrefillObserver = Callable[[torch.nn.Module, EvictingLayer, torch.Tensor, tuple, object], None]


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's self-attention modules: modules with ``q_proj``, ``head_dim`` and an int ``layer_idx``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    found = [
        m
        for m in decoder.modules()
        if hasattr(m, "q_proj") and hasattr(m, "head_dim") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    return found


class KVMethodCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are built by a KV method, for one ``generate`` run.

    Sliding-window or other special layers of the model's config keep transformers' own layer classes.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model the cache will be used with (its decoder config decides the layer types).
    layer_factory : callable
        ``layer_factory(layer_idx) -> EvictingLayer`` for each full-attention layer.
    method : KVMethod, optional
        The method that built the cache (kept for telemetry).

    Notes
    -----
    Usable as a context manager; :meth:`close` removes any hooks this cache attached to the model.
    """

    def __init__(self, model: torch.nn.Module, layer_factory: Callable[[int], EvictingLayer], method=None):
        super().__init__(config=model.config)
        for i, layer in enumerate(self.layers):
            if type(layer) is DynamicLayer:
                self.layers[i] = layer_factory(i)
        self.method = method
        self._hooks: list = []

    def observe_prefill(self, model: torch.nn.Module, fn: PrefillObserver) -> None:
        """Call ``fn`` once per layer, right after that layer's first attention forward with this cache.

        Registers a forward hook (``with_kwargs=True``) on each decoder self-attention module of ``model`` (this
        instance only). Each hook fires once, when the module ran with ``past_key_values is self``; after the last
        layer has fired all hooks are removed. ``fn(module, layer, hidden_states, position_embeddings,
        attention_mask)`` receives the module's inputs; the layer already holds this forward's K/V.

        Raises
        ------
        ValueError
            If the model has no Llama-style attention modules for the cache's evicting layers.
        """
        modules = [m for m in attention_modules(model) if isinstance(self.layers[m.layer_idx], EvictingLayer)]
        if not modules:
            raise ValueError(
                f"found no self-attention modules with q_proj/head_dim/layer_idx in {type(model).__name__}; this "
                "KV-cache method needs a Llama-style decoder"
            )
        pending = {m.layer_idx for m in modules}

        def hook(module, args, kwargs, output):
            if "past_key_values" not in kwargs:
                raise RuntimeError(
                    f"{type(module).__name__} was called without a past_key_values keyword; cannot attach the cache"
                )
            if kwargs["past_key_values"] is not self or module.layer_idx not in pending:
                return
            pending.discard(module.layer_idx)
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            fn(
                module,
                self.layers[module.layer_idx],
                hidden,
                kwargs.get("position_embeddings"),
                kwargs.get("attention_mask"),
            )
            if not pending:
                self.close()

        self._hooks.extend(m.register_forward_hook(hook, with_kwargs=True) for m in modules)

    @property
    def hooks_attached(self) -> int:
        """Number of hooks this cache still has on the model."""
        return len(self._hooks)

    def close(self) -> None:
        """Remove every hook this cache attached to the model (idempotent)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __enter__(self) -> "KVMethodCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------- method
def _check_int(owner: str, name: str, value, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}; {fix}")


@dataclass
class KVMethod:
    """Base class of the KV-cache methods: a dataclass of hyper-parameters that builds a fresh cache per run.

    Use as ``model.generate(**inputs, past_key_values=method.make_cache(model))``.

    Subclasses set ``method_name`` and implement :meth:`make_layer`; methods that need the prefill queries also
    override :meth:`make_cache` to call :meth:`KVMethodCache.observe_prefill`.
    """

    method_name: ClassVar[str] = "kv-method"

    @property
    def name(self) -> str:
        """Registry name, e.g. ``"snapkv"``."""
        return self.method_name

    @property
    def spec(self) -> str:
        """Spec string that rebuilds this method, e.g. ``"snapkv:budget=256:window=32:kernel_size=7:pooling=avg"``."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)]
        return ":".join([self.name, *parts])

    def make_layer(self, layer_idx: int) -> EvictingLayer:
        """A fresh cache layer for full-attention layer ``layer_idx``."""
        raise NotImplementedError

    def make_cache(self, model: torch.nn.Module) -> Cache:
        """A fresh cache for one ``generate`` run of ``model``."""
        return KVMethodCache(model, self.make_layer, method=self)

    def telemetry(self, cache: Cache) -> dict:
        """JSON-serialisable facts about a cache after a run.

        Returns
        -------
        dict
            ``method``, ``spec``, the hyper-parameters, ``seen_tokens`` (tokens that went through the cache),
            ``kept_tokens_per_layer``, ``evicted_tokens`` (seen - held, summed over layers), ``kv_cache_bytes``.
        """
        layers = list(getattr(cache, "layers", []))
        kept = [held_tokens(layer) for layer in layers]
        seen = [int(layer.get_seq_length()) if getattr(layer, "is_initialized", False) else 0 for layer in layers]
        return {
            "method": self.name,
            "spec": self.spec,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "seen_tokens": max(seen, default=0),
            "kept_tokens_per_layer": kept,
            "evicted_tokens": int(sum(s - k for s, k in zip(seen, kept))),
            "kv_cache_bytes": kv_cache_bytes(cache),
        }
