"""Cache layers that compute their own attention: for K/V that is not one [B, Hkv, S, D] tensor per layer.

Some methods store K/V that a stock attention function cannot read: two head groups of different lengths
(DuoAttention's retrieval and streaming heads), a page table read sparsely at decode (Quest), or per-head slot counts
(AdaKV). For those, the cache layer is an :class:`AttentionOwningLayer`: ``update`` stores the new K/V, and
:meth:`AttentionOwningLayer.attend` computes the attention of the current forward from what the layer holds, through
:mod:`mmaccel.kernels` (``attention``, ``sparse_prefill_attention``, ``decode_attention``).

How the model reaches ``attend``, per instance and reversibly: an attention function is registered once in
transformers' ``AttentionInterface`` under :data:`OWNED_ATTENTION`. :class:`OwnedAttentionCache` gives each of the
model's decoder self-attention modules (of *this* model instance) a shallow copy of its config whose attention
implementation is that name, and a weak reference to its cache layer; the model-level config (and so the mask the
model builds) is untouched. :meth:`OwnedAttentionCache.close` (or ``with cache:``, an exception in a forward with the
cache, or garbage collection of the cache) restores the modules' configs and removes the references. Nothing is
patched on classes.
"""
from __future__ import annotations

import copy
import logging
import weakref

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer

from ..kernels import attention
from ..kernels.hf import (
    attention_modules,
    attention_variants,
    check_attention_kwargs,
    hooked_cache,
    refuse_attention_variants,
)
from .base import EvictingLayer, KVMethodCache, has_padding, no_method_layers_error

logger = logging.getLogger(__name__)

OWNED_ATTENTION = "mmaccel_owned_kv"
LAYER_ATTR = "_mmaccel_owned_layer"


def owned_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as :data:`OWNED_ATTENTION`: hands the forward to the module's cache layer.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module; :class:`OwnedAttentionCache` set a weak reference to its layer on it.
    query : torch.Tensor
        [B, Hq, q, D] post-RoPE queries of this forward.
    key, value : torch.Tensor
        Whatever the layer's ``update`` returned (ignored: the layer reads its own storage).
    attention_mask : object
        The mask the model built (only checked for padding at prefill).
    scaling : float, optional
        Softmax scale (default ``module.scaling``).

    Returns
    -------
    (torch.Tensor, None)
        [B, q, Hq, D] attention output and no weights.

    Notes
    -----
    A forward that does not run with the owning cache (``key`` is not the tensor the layer's ``update`` just
    returned: another cache, or none, while this one is still open) gets the module's original attention
    implementation (SDPA in place of eager).

    Raises
    ------
    RuntimeError
        In training with dropout, or if the module has no owning layer and no original implementation.
    NotImplementedError
        If the module passes an attention argument the layers do not apply (a softcap, sink logits:
        :func:`mmaccel.kernels.hf.check_attention_kwargs`); :class:`OwnedAttentionCache` refuses such models up front.
    """
    ref, original = getattr(module, LAYER_ATTR, (None, None))
    layer = ref() if ref is not None else None
    if layer is None or key is not layer.keys:
        # a forward with another cache (or none) while this cache is still open: the module's own attention
        if original is None:
            raise RuntimeError(f"layer {getattr(module, 'layer_idx', '?')} runs the {OWNED_ATTENTION!r} attention "
                               "outside the cache that set it up")
        return _original_attention(original)(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
    if dropout and module.training:
        raise RuntimeError("owned-attention KV caches are for inference: dropout in training is not supported")
    check_attention_kwargs(module, kwargs, "this owned-attention KV cache")
    scale = scaling if scaling is not None else getattr(module, "scaling", None)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    out = layer.attend(query, attention_mask, float(scale))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(OWNED_ATTENTION, owned_attention_forward)


def _original_attention(name: str):
    """The attention function registered as ``name`` (SDPA for eager, whose function lives in each model file)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, "eager", OWNED_ATTENTION):
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, sdpa_attention_forward)


class AttentionOwningLayer(DynamicLayer):
    """A cache layer that stores K/V its own way and computes the attention of each forward from it.

    Subclasses implement :meth:`update` (store the new K/V, return anything), :meth:`attend` and :meth:`kv_tensors`
    (for :func:`~mmaccel.longctx.base.kv_cache_bytes`), and may add :meth:`bookkeeping_tensors`.

    Attributes
    ----------
    cumulative_length : int
        Tokens seen so far (returned by :meth:`get_seq_length`, so default position ids stay true).
    """

    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cumulative_length = 0

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """[B, Hq, q, D] attention of this forward's queries over what the layer holds (after :meth:`update`)."""
        raise NotImplementedError

    def kv_tensors(self) -> list[torch.Tensor]:
        """The K/V tensors held (all of them count as K/V bytes)."""
        return [t for t in (self.keys, self.values) if isinstance(t, torch.Tensor)]

    def bookkeeping_tensors(self) -> list[torch.Tensor]:
        """Per-slot / per-page bookkeeping tensors (default none)."""
        return []

    def check_unpadded(self, attention_mask, query_length: int, owner: str) -> None:
        """Refuse a padded batch at prefill (``ValueError``): per-head storage cannot follow a shared padding mask."""
        if query_length > 1 and has_padding(attention_mask):
            raise ValueError(
                f"{owner} cannot run a left-padded batch (its per-head storage does not line up with the padding "
                "mask); run prompts one at a time or with equal lengths"
            )

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(seen + query_length, 0)``: the model's mask covers every true position; :meth:`attend` applies the
        method's own per-head rule."""
        return self.cumulative_length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(f"{type(self).__name__} cannot be cropped (assisted decoding); use the 'full' method there")

    def _no_reorder(self, *args, **kwargs) -> None:
        raise ValueError(f"{type(self).__name__} does not support beam search or batch reordering; use num_beams=1")

    reorder_cache = _no_reorder
    batch_repeat_interleave = _no_reorder
    batch_select_indices = _no_reorder

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0


class _ModuleOwnership:
    """Handle that gives one attention module the owned-attention config and its layer, and undoes it."""

    def __init__(self, module: torch.nn.Module, layer: AttentionOwningLayer):
        self.module = module
        self.config = module.config
        own = copy.copy(module.config)
        own._attn_implementation_internal = OWNED_ATTENTION  # this copy only; sub-configs are not touched
        module.config = own
        setattr(module, LAYER_ATTR, (weakref.ref(layer), self.config._attn_implementation))

    def remove(self) -> None:
        if self.module is None:
            return
        self.module.config = self.config
        if hasattr(self.module, LAYER_ATTR):
            delattr(self.module, LAYER_ATTR)
        self.module = None


class OwnedAttentionCache(KVMethodCache):
    """A :class:`~mmaccel.longctx.base.KVMethodCache` whose :class:`AttentionOwningLayer` s compute the attention.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The one model instance the cache is used with.
    method : KVMethod
        Builds the layers (``make_layer``); methods using this cache set ``uses_hooks = False``.
    attach : bool
        Hooks and module ownership (default); ``False`` builds the layers only (as :class:`KVMethodCache`).

    Raises
    ------
    ValueError
        If no decoder self-attention module of the model gets an owning layer, a module has no ``config``, or an owned
        module's attention has a logit softcap or attention sinks, which the owning layers do not apply
        (:func:`mmaccel.kernels.hf.refuse_attention_variants`).

    Notes
    -----
    Per instance and reversible (see the module docstring). Only one such cache may drive a model at a time: a
    second cache made for the same model while the first is open raises.
    """

    def __init__(self, model: torch.nn.Module, method, *, attach: bool = True):
        super().__init__(model, method, attach=attach)
        if not attach:  # layers only, for a shared prefill to fill (see KVMethodCache)
            return
        try:
            modules = self._owned_modules(model, method)
        except BaseException:
            self.close()  # a refusal leaves nothing attached (the base class may have hooked the modules already)
            raise
        for i, module in modules.items():
            self._hooks.append(_ModuleOwnership(module, self.layers[i]))
        ref = weakref.ref(self)

        def after_model(module, args, kwargs, output):
            cache = ref()
            if cache is not None and output is None and hooked_cache(kwargs) is cache:
                cache.close()  # the forward raised: give the modules back their own attention

        self._hooks.append(model.register_forward_hook(after_model, with_kwargs=True, always_call=True))

    def _owned_modules(self, model: torch.nn.Module, method) -> dict:
        """``{layer_idx: attention module}`` this cache will drive; the refusals of the class docstring."""
        modules = {i: m for i, m in attention_modules(model).items()
                   if i < len(self.layers) and isinstance(self.layers[i], AttentionOwningLayer)}
        if not modules:
            raise no_method_layers_error(model, self, method.name)
        refuse_attention_variants(modules, method.name)
        busy = [i for i, m in modules.items() if (getattr(m, LAYER_ATTR, (None, None))[0] or (lambda: None))()]
        if busy:
            raise ValueError(
                f"layers {busy} of this model are already driven by another open {method.name} cache; close it "
                "(or use `with cache:`) before making a new one"
            )
        missing = [i for i, module in modules.items() if not hasattr(module, "config")]
        if missing:
            raise ValueError(f"attention module of layer {missing[0]} has no config; cannot route its attention")
        return modules


class DecodeProbsLayer(EvictingLayer, AttentionOwningLayer):
    """An evicting layer that computes a decode step's attention itself and keeps its probabilities.

    For methods that score slots by the attention the new token gives them at every decode step (H2O's accumulated
    attention, Zhang et al., 2023, arXiv 2306.14048; TOVA, Oren et al., 2024, arXiv 2401.06104): the probabilities
    the output is computed from are the scores, so the step reads the keys once (one matmul, one fp32 softmax, one
    matmul) instead of running the model's attention and then recomputing the query's projection, RoPE and
    probabilities. A forward of more than one token (the prefill) runs :func:`mmaccel.kernels.attention` (causal)
    and keeps no probabilities. Used through :class:`DecodeProbsScorer`; under a plain
    :class:`~mmaccel.longctx.base.KVMethodCache` (a model with a softcap or sinks) the model's own attention runs
    and ``attend`` is never called.

    Attributes
    ----------
    decode_probs : torch.Tensor or None
        float32 [B, Hq, S]: the last one-token forward's attention probabilities over the ``S`` held slots (query
        head ``h`` reads KV head ``h // (Hq // Hkv)``); ``None`` after a prefill forward.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.decode_probs: torch.Tensor | None = None

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """[B, Hq, q, D] attention over the held slots; for ``q == 1`` also sets :attr:`decode_probs`.

        Raises
        ------
        ValueError
            A left-padded prefill (the methods using this layer refuse padding).
        """
        self.decode_probs = None
        B, Hq, q, D = query.shape
        if q > 1:
            self.check_unpadded(attention_mask, q, type(self).__name__)
            return attention(query, self.keys, self.values, causal=True, scaling=scaling)
        Hkv = self.keys.shape[1]
        grouped = query.float().reshape(B, Hkv, Hq // Hkv, D)
        probs = torch.softmax(torch.matmul(grouped, self.keys.float().transpose(-1, -2)).mul_(scaling), dim=-1)
        self.decode_probs = probs.reshape(B, Hq, -1)
        return torch.matmul(probs.to(self.values.dtype), self.values).reshape(B, Hq, 1, D)

    def reset(self) -> None:
        super().reset()
        self.decode_probs = None


class DecodeProbsScorer:
    """Mixin for a :class:`~mmaccel.longctx.base.KVScorer` whose decode-step score is the new token's attention
    (H2O, TOVA): its layers are :class:`DecodeProbsLayer` s (list it before the scorer base); the method reads
    ``step.layer.decode_probs`` (``None`` when the model's own attention ran: recompute)."""

    def make_layer(self, layer_idx: int) -> DecodeProbsLayer:
        """A fresh :class:`DecodeProbsLayer` for full-attention layer ``layer_idx``."""
        return DecodeProbsLayer()

    def make_cache(self, model: torch.nn.Module, *, speculative: bool = False) -> KVMethodCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done): an
        :class:`OwnedAttentionCache` (the layers compute attention and keep the probabilities), or the method's
        plain cache when an attention module of ``model`` has a logit softcap or sinks that the layers' own
        attention does not apply (:func:`mmaccel.kernels.hf.attention_variants`: the model's own attention runs
        and the method recomputes the probabilities), and for ``speculative=True`` (which the plain cache refuses
        for methods that evict while decoding).

        Raises
        ------
        ValueError
            As :class:`OwnedAttentionCache` and the method's own ``make_cache`` do.
        """
        if speculative or any(attention_variants(m) for m in attention_modules(model).values()):
            return super().make_cache(model, speculative=speculative)
        return OwnedAttentionCache(model, self)
