"""transformers integration: an ``"mmaccel"`` attention implementation that runs a loaded model on this layer.

Attach through the public seams only: ``AttentionInterface.register`` for the attention function and
``AttentionMaskInterface.register`` (with transformers' own ``sdpa_mask``) for the mask, then
``model.set_attn_implementation("mmaccel")`` or ``from_pretrained(..., attn_implementation="mmaccel")``.

Per-layer / per-head patterns (set by ``mmaccel.longctx`` and ``mmaccel.vision_tokens``) live on the attention module
*instances* for the duration of :func:`attention_patterns`; nothing is patched on classes and no global state is read.

Example
-------
>>> register_attention()
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mmaccel")
>>> with attention_patterns(model, {1: HeadPatterns((Dense(), Streaming(4, 256)) * 2)}):
...     out = model.generate(**inputs)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator, Mapping

import torch

from .decode import decode_attention
from .dense import attention, causal_mask
from .patterns import BlockSparse, Chunked, Dense, as_head_patterns, head_masks, make_rule
from .sparse_prefill import sparse_prefill_attention

logger = logging.getLogger(__name__)


def cache_kwarg(model, cache, *, generate: bool = False) -> dict:
    """``{name: cache}`` to pass a KV cache to ``model(...)`` or (``generate=True``) ``model.generate(...)``.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` in the models' ``forward`` and in ``generate`` (the old
    name still works until 6.0, with a deprecation warning); earlier 5.x versions, and models whose ``forward`` has no
    ``cache`` parameter, take ``past_key_values``.
    """
    return {_cache_name(type(model), generate): cache}


@functools.cache
def _cache_name(cls, generate: bool) -> str:
    if generate:  # generate takes **kwargs; the rename came with 5.24
        import transformers
        from packaging.version import Version

        return "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"
    forward = getattr(cls, "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


PATTERN_ATTR = "_mmaccel_patterns"

#: attention arguments an attention module may pass (Gemma 2's ``softcap``, gpt-oss's sink logits ``s_aux``) that the
#: attention code of mmaccel's owned-attention caches does not apply
UNAPPLIED_ARGUMENTS = ("softcap", "s_aux", "sinks")


def attention_variants(module: torch.nn.Module) -> dict[str, object]:
    """What an attention module computes beyond plain scaled-dot-product attention, read from the module and its
    config (never from a model name).

    Parameters
    ----------
    module : torch.nn.Module
        A decoder self-attention module (see :func:`attention_modules`).

    Returns
    -------
    dict
        ``{"softcap": cap}`` for an attention logit softcap (``attn_logit_softcapping``, Gemma 2: logits become
        ``cap * tanh(logits / cap)``), ``{"sinks": shape}`` for learned attention-sink logits (a ``sinks`` parameter,
        gpt-oss); empty for plain attention.
    """
    config = getattr(module, "config", None)
    found: dict[str, object] = {}
    cap = getattr(module, "attn_logit_softcapping", getattr(config, "attn_logit_softcapping", None))
    if cap is not None:
        found["softcap"] = float(cap)
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.Tensor):
        found["sinks"] = tuple(sinks.shape)
    return found


def refuse_attention_variants(modules: Mapping[int, torch.nn.Module], owner: str) -> None:
    """Refuse, before anything runs, models whose attention the caller's own attention code would compute wrongly.

    Parameters
    ----------
    modules : mapping of int to torch.nn.Module
        ``{layer_idx: attention module}`` whose attention ``owner`` computes itself.
    owner : str
        The method's name, for the message.

    Raises
    ------
    ValueError
        Naming the first layer with a softcap or attention sinks (:func:`attention_variants`), the value, and the fix.
    """
    for idx, module in modules.items():
        found = attention_variants(module)
        if found:
            what = ", ".join(f"{k}={v}" for k, v in found.items())
            raise ValueError(
                f"{owner} computes attention itself and does not apply layer {idx}'s attention {what} "
                "(attn_logit_softcapping / attention sinks); its output would be silently wrong. Use a method that "
                "keeps the model's own attention (full, streaming, snapkv, pyramidkv, h2o, tova, knorm, chunkkv)"
            )


def check_attention_kwargs(module: torch.nn.Module, kwargs: Mapping, owner: str) -> None:
    """Raise ``NotImplementedError`` if an attention forward passed an argument in :data:`UNAPPLIED_ARGUMENTS`
    (not ``None``): the last guard of an attention function that would drop it."""
    for name in UNAPPLIED_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"layer {getattr(module, 'layer_idx', '?')}: {owner} does not apply the attention argument "
                f"{name}={kwargs[name] if name == 'softcap' else '...'} this model passes; its output would be wrong"
            )


def _softcapped_attention(query, key, value, attention_mask, scaling, softcap: float, causal: bool) -> torch.Tensor:
    """Dense fp32 attention with Gemma 2's logit softcap, ``cap * tanh(q.k * scale / cap)``: [B, Hq, Lq, D].

    ``attention_mask``: a 4-D bool (True = attend) or additive mask, or None (``causal`` bottom-right mask or none).
    """
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1).float()
    v = value.repeat_interleave(group, dim=1).float()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = (query.float() @ k.transpose(-1, -2)) * scale
    logits = softcap * torch.tanh(logits / softcap)
    low = torch.finfo(logits.dtype).min
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attention_mask, low)
        else:
            logits = logits + attention_mask.float()
    elif causal:
        logits = logits.masked_fill(~causal_mask(query.shape[2], key.shape[2], query.device), low)
    return (logits.softmax(dim=-1) @ v).to(query.dtype)


def _plain_causal(mask: torch.Tensor, q_len: int, k_len: int) -> bool:
    """Whether a 4-D bool mask is only the (bottom-right) causal mask: no padding, nothing custom."""
    return mask.dtype == torch.bool and bool((mask == causal_mask(q_len, k_len, mask.device)).all())


def _decode_rule(pattern, k_len: int):
    """The token rule a decode step uses: block tables are a prefill device, so BlockSparse decodes densely, and a
    Chunked selection table that no longer covers the position keeps only the sinks and the current chunk."""
    if isinstance(pattern, BlockSparse):
        return make_rule(Dense(), k_len)
    if isinstance(pattern, Chunked) and pattern.selected is not None:
        n = -(-k_len // pattern.chunk_size)
        if pattern.selected.shape[0] != n:
            return make_rule(Chunked(pattern.chunk_size, pattern.sink), k_len)
    return make_rule(pattern, k_len)


def decode_indices(patterns: tuple, k_len: int, batch: int, device) -> torch.Tensor:
    """int64 [B, Hq, N] key positions each head reads for the next token (``-1`` pads), from the patterns."""
    k = torch.arange(k_len, device=device)
    qa = torch.tensor(k_len - 1, device=device)
    allowed = head_masks(patterns, qa, k, k_len, rule_of=_decode_rule)  # [Hq, Lk]
    n = int(allowed.sum(-1).max())
    order = torch.argsort((~allowed).to(torch.int64) * k_len + k, dim=-1)[:, :n]
    idx = torch.where(allowed.gather(1, order), order, -1)
    return idx[None].expand(batch, -1, -1)


def mmaccel_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered in ``AttentionInterface``.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module; its ``_mmaccel_patterns`` attribute (if any) selects sparse paths.
    query : torch.Tensor
        [B, Hq, Lq, D].
    key, value : torch.Tensor
        [B, Hkv, Lk, D] (GQA not repeated).
    attention_mask : torch.Tensor or None
        4-D bool mask from ``sdpa_mask`` or None (plain causal).
    scaling : float, optional
        Softmax scale.
    dropout : float
        Must be 0 while training (inference layer).

    Returns
    -------
    (torch.Tensor, None)
        [B, Lq, Hq, D] output and no attention weights.

    softcap : float, optional (in ``kwargs``)
        Attention logit softcap (Gemma 2): applied on the dense path (fp32 reference math); patterns refuse it.
    sliding_window : int, optional (in ``kwargs``)
        Applied through ``attention_mask`` (transformers builds the sliding mask with the registered ``sdpa_mask``).

    Raises
    ------
    NotImplementedError
        For dropout in training, patterns combined with a padding / custom mask or a softcap, or attention-sink
        logits (``s_aux``/``sinks``, :data:`UNAPPLIED_ARGUMENTS`).
    """
    if dropout and module.training:
        raise NotImplementedError("mmaccel attention is an inference layer: dropout is not supported in training")
    patterns = getattr(module, PATTERN_ATTR, None)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    B, Hq, Lq, _ = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    softcap = kwargs.pop("softcap", None)
    check_attention_kwargs(module, kwargs, "mmaccel attention")
    if softcap is not None:
        if patterns is not None:
            raise NotImplementedError(
                f"layer {getattr(module, 'layer_idx', '?')}: sparse attention patterns do not apply the attention "
                f"logit softcap ({softcap}) this model uses; drop the patterns on this model"
            )
        out = _softcapped_attention(query, key, value, attention_mask, scaling, float(softcap),
                                    bool(is_causal) and attention_mask is None)
        return out.transpose(1, 2).contiguous(), None
    if patterns is None:
        out = attention(query, key, value, causal=bool(is_causal) and attention_mask is None,
                        attention_mask=attention_mask, scaling=scaling)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and not _plain_causal(attention_mask, Lq, Lk):
        raise NotImplementedError(
            f"layer {getattr(module, 'layer_idx', '?')}: sparse attention patterns with padded or custom masks are not "
            "supported; run unpadded (batch 1 or equal lengths) or drop the patterns"
        )
    heads = as_head_patterns(patterns, Hq, Hkv)
    if Lq == 1:
        idx = decode_indices(heads, Lk, B, query.device)
        out = decode_attention(query, key, value, indices=idx, scaling=scaling)
    else:
        out = sparse_prefill_attention(query, key, value, heads, scaling=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_attention(name: str = "mmaccel") -> str:
    """Register :func:`mmaccel_attention_forward` and transformers' SDPA mask under ``name``; idempotent.

    Returns
    -------
    str
        ``name``, for ``attn_implementation=`` / ``set_attn_implementation``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, mmaccel_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _runs_mmaccel(impl) -> bool:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return isinstance(impl, str) and ALL_ATTENTION_FUNCTIONS._global_mapping.get(impl) is mmaccel_attention_forward


def hooked_cache(kwargs: Mapping) -> object | None:
    """The KV cache a hooked forward was called with, or ``None``.

    transformers up to 5.23 passes it to attention modules and decoders as ``past_key_values``; 5.24 renamed the
    attention modules' argument to ``cache``. Forward hooks (``with_kwargs=True``) read it through this one function
    so they fire under both.
    """
    cache = kwargs.get("past_key_values")
    return kwargs.get("cache") if cache is None else cache


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The self-attention modules of a model's language decoder, by layer index: the one finder of mmaccel.

    Used by :func:`attention_patterns` and by the KV-cache methods of :mod:`mmaccel.longctx`.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model, its decoder, or a language-model submodule. When the model has ``get_decoder()``, only
        the decoder is searched (so a VLM's vision tower is skipped).

    Returns
    -------
    dict of int to torch.nn.Module
        ``{layer_idx: module}`` for every module with an integer ``layer_idx`` and a ``head_dim`` (the attention
        modules of Llama, Mistral, Qwen2/3, Gemma, ... in transformers 5), in layer order. Empty if none.

    Raises
    ------
    ValueError
        If two modules share a ``layer_idx`` (e.g. a vision tower and a language model both searched); pass the
        language model (e.g. ``model.model.language_model``) instead.
    """
    root = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            root = get_decoder() or model
        except (AttributeError, NotImplementedError, ValueError):
            root = model
    found: dict[int, torch.nn.Module] = {}
    for mod in root.modules():
        idx = getattr(mod, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool) and hasattr(mod, "head_dim"):
            if idx in found:
                raise ValueError(
                    f"two attention modules have layer_idx {idx} (e.g. a vision tower and a language model); "
                    "pass the language model (e.g. model.model.language_model) instead"
                )
            found[idx] = mod
    return dict(sorted(found.items()))


@contextlib.contextmanager
def attention_patterns(model: torch.nn.Module, layers: Mapping[int, object]) -> Iterator[torch.nn.Module]:
    """Set sparse attention patterns on some layers of one model instance, and remove them on exit.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model (or its language-model submodule) running ``attn_implementation="mmaccel"``.
    layers : mapping of int to pattern or HeadPatterns
        ``{layer_idx: pattern}``; a bare pattern applies to every head of the layer.

    Yields
    ------
    torch.nn.Module
        ``model``.

    Raises
    ------
    ValueError
        For a layer index the model does not have, a pattern for the wrong number of heads, or ambiguous layers.
    """
    modules = attention_modules(model)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not _runs_mmaccel(impl):
        logger.warning("attention patterns are read only by the registered mmaccel implementation; model uses %r", impl)
    for idx, pattern in layers.items():
        if idx not in modules:
            raise ValueError(f"no attention layer {idx}; the model has layers {sorted(modules)}")
        cfg = modules[idx].config
        hq = getattr(cfg, "num_attention_heads", None)
        if hq is not None:
            as_head_patterns(pattern, hq, getattr(cfg, "num_key_value_heads", None) or hq)
    previous = {idx: getattr(modules[idx], PATTERN_ATTR, None) for idx in layers}
    try:
        for idx, pattern in layers.items():
            setattr(modules[idx], PATTERN_ATTR, pattern)
        yield model
    finally:
        for idx, old in previous.items():
            if old is None:
                if hasattr(modules[idx], PATTERN_ATTR):
                    delattr(modules[idx], PATTERN_ATTR)
            else:
                setattr(modules[idx], PATTERN_ATTR, old)
