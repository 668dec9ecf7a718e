"""Chunked prefill as a wrapper over any KV-cache method: the prompt goes through the model in fixed chunks.

Agrawal et al., "SARATHI: Efficient LLM Inference by Piggybacking Decodes with Chunked Prefills", 2023,
arXiv 2308.16369.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch

from ..kernels.hf import hooked_cache
from ..specs import resolve_nested
from .base import KVMethod, KVMethodCache, LayerStep, _check_int


def resolve_inner(method, owner: str) -> KVMethod:
    """A wrapped method from an object or a nested spec (``"snapkv,budget=64,window=8"``: commas for colons).

    Raises
    ------
    ValueError
        Neither a :class:`KVMethod` nor a spec, or an unknown nested method or argument.
    """
    from .registry import build_method

    return resolve_nested(method, KVMethod, build_method, owner, "snapkv,budget=256")


_SEQ_KWARGS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")


def language_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The text decoder a vision-language model calls with the merged ``inputs_embeds`` (``model.model.language_model``
    or ``model.language_model``: LLaVA, LLaVA-OneVision, Qwen2-VL), or ``None`` for a text-only model."""
    for owner in (getattr(model, "model", None), model):
        lm = getattr(owner, "language_model", None)
        if isinstance(lm, torch.nn.Module):
            return lm
    return None


def _prefill_splitter(ref, chunk: int, last_logits_only: bool):
    """The forward pre-hook that runs every forward with the cache ``ref()`` whose input is longer than ``chunk``
    tokens as chunks: all but the last are run here (``module(...)``, in order), the last is handed back as the
    forward's own input. ``last_logits_only``: the non-last chunks pass ``logits_to_keep=1``."""

    def split(module, args, kwargs):
        cache = ref()
        if cache is None or hooked_cache(kwargs) is not cache:
            return None
        kwargs = dict(kwargs)
        if args and isinstance(args[0], torch.Tensor) and "input_ids" not in kwargs:
            kwargs["input_ids"], args = args[0], args[1:]
        x = kwargs.get("input_ids")
        x = kwargs.get("inputs_embeds") if x is None else x
        length = int(x.shape[1])
        if length <= chunk:
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError("chunked prefill needs the 2-D [B, past + L] padding mask (or none); got a custom mask")
        past = int(mask.shape[1]) - length if mask is not None else 0

        def piece(start: int, end: int) -> dict:
            sub = dict(kwargs)
            for name in _SEQ_KWARGS:
                value = kwargs.get(name)
                if isinstance(value, torch.Tensor):
                    sub[name] = value[:, start:end] if name != "position_ids" else value[..., start:end]
            if isinstance(kwargs.get("cache_position"), torch.Tensor):
                sub["cache_position"] = kwargs["cache_position"][start:end]
            if mask is not None:
                sub["attention_mask"] = mask[:, : past + end]
            return sub

        starts = list(range(0, length, chunk))
        for start in starts[:-1]:
            extra = {"logits_to_keep": 1} if last_logits_only else {}
            module(*args, **{**piece(start, start + chunk), **extra})
        return args, piece(starts[-1], length)

    return split


@dataclass
class ChunkWrapper(KVMethod):
    """Base of the wrappers that run a wrapped method's prefill in pieces of ``chunk`` tokens
    (:class:`Chunked`, :class:`~mmaccel.longctx.chunked_ffn.ChunkedFeedForward`): the wrapped method's layers, hooks,
    padding rules and telemetry are used unchanged; a subclass writes ``make_cache``.

    Raises
    ------
    ValueError
        A ``chunk`` that is not an integer >= 1, or an unknown nested method.
    """

    method: object = "full"
    chunk: int = 1024

    def __post_init__(self):
        _check_int(self.method_name, "chunk", self.chunk, 1,
                   f"pass the chunk length in tokens, e.g. {self.method_name}:chunk=1024")
        self.method = resolve_inner(self.method, self.method_name)

    @property
    def uses_hooks(self) -> bool:
        return self.method.uses_hooks

    @property
    def padding_safe(self) -> bool:
        return self.method.padding_safe

    def make_layer(self, layer_idx: int):
        return self.method.make_layer(layer_idx)

    def on_step(self, step: LayerStep) -> None:
        self.method.on_step(step)

    def wrapped_cache(self, model: torch.nn.Module) -> KVMethodCache:
        """The wrapped method's own cache (``method.make_cache``: hook-driven or attention-owning alike); a method
        whose cache is a plain transformers cache (``full``) gets a :class:`KVMethodCache` of its layers, which can
        hold this wrapper's hooks (its ``_hooks``: objects with ``remove()``, removed when the cache closes)."""
        cache = self.method.make_cache(model)
        return cache if isinstance(cache, KVMethodCache) else KVMethodCache(model, self)

    def telemetry(self, cache) -> dict:
        """The wrapped method's telemetry, with ``method``/``spec`` of the wrapper and ``chunk``."""
        return {**self.method.telemetry(cache), "method": self.name, "spec": self.spec, "chunk": self.chunk,
                "inner_method": self.method.spec}

    @property
    def spec(self) -> str:
        return f"{self.name}:chunk={self.chunk}:method={self.method.spec.replace(':', ',')}"


@dataclass
class Chunked(ChunkWrapper):
    """Chunked prefill (SARATHI, Agrawal et al., 2023, arXiv 2308.16369) over any method: ``Chunked(SnapKV(), 1024)``.

    A forward pre-hook (this instance only) splits every forward with this cache whose input is longer than
    ``chunk`` into chunks of ``chunk`` tokens (the last one shorter) and runs them in order; the output of the last
    chunk is returned, which is all ``generate`` reads. Activations are bounded by the chunk, and so is the K/V held
    by a method that compresses at every prefill step.

    Where the split happens:

    - a text model: at the model's entry, on ``input_ids`` / ``inputs_embeds`` (the chunks but the last get
      ``logits_to_keep=1``);
    - a vision-language model (one with a ``language_model``: LLaVA, LLaVA-OneVision, Qwen2-VL): at the language
      model's entry, on the merged ``inputs_embeds`` [B, L, D], ``position_ids`` ([B, L] or M-RoPE's [n, B, L]) and
      the 2-D mask. The vision tower, the projector and any pre-LLM visual-token method
      (:class:`~mmaccel.vision_tokens.ImageReducer`: pooling, VisionZip, temporal ToMe, ...) run once on the whole
      prompt and only the LM prefill is chunked, so a prompt of many images (a video's frames) can be chunked
      anywhere, even inside an image. The hook is moved behind every other pre-hook of the language model at each
      forward of the model with this cache, so it splits what those hooks hand on (a reducer's reduced
      ``inputs_embeds`` with the kept tokens' original positions), whichever was attached first.

    Parameters
    ----------
    method : KVMethod or str
        The wrapped method, or its spec with commas for colons (``chunked:chunk=512:method=snapkv,budget=64``).
    chunk : int
        Tokens per prefill chunk, >= 1 (default 1024).

    Notes
    -----
    For ``full`` the greedy output is token-identical to unchunked prefill (on a VLM also under a pre-LLM
    visual-token method: identical to that method unchunked). For a scored method each chunk is one prefill step
    (see :mod:`mmaccel.longctx.base`): the held slots plus the chunk are compressed back to the budget, and SnapKV's
    "window" is the last ``window`` queries of the current chunk (the prompt's last tokens for the last chunk),
    choosing only among what earlier chunks kept. ``ratio`` budgets apply to the tokens seen so far. The same holds
    for ``generate(prefill_chunk_size=C)``.

    In-LLM visual-token pruning (FastV and other :class:`~mmaccel.vision_tokens.LayerPruner` s) ranks the whole
    prompt inside one prefill forward; under chunked prefill no forward holds the whole prompt and it prunes
    nothing: do not combine them.

    Raises
    ------
    ValueError
        On a bad ``chunk``, a wrapped method that cannot run chunked (``supports_chunking`` false), a forward with a
        mask other than the 2-D padding mask.
    """

    method_name = "chunked"

    def __post_init__(self):
        super().__post_init__()
        if not getattr(self.method, "supports_chunking", True):
            raise ValueError(
                f"chunked: {self.method.name} cannot run with chunked prefill ({self.method.chunking_error}); "
                "run it unchunked"
            )

    def make_cache(self, model: torch.nn.Module) -> KVMethodCache:
        """The wrapped method's cache (:meth:`ChunkWrapper.wrapped_cache`) plus the chunking pre-hook (on ``model``,
        or on its language model for a VLM), removed with the cache's hooks."""
        cache = self.wrapped_cache(model)
        ref = weakref.ref(cache)
        hooks = cache._hooks
        lm = language_model(model)
        if lm is None:
            last_logits_only = "logits_to_keep" in inspect.signature(model.forward).parameters
            hooks.append(model.register_forward_pre_hook(_prefill_splitter(ref, self.chunk, last_logits_only),
                                                         with_kwargs=True))
            return cache
        split = _prefill_splitter(ref, self.chunk, last_logits_only=False)
        held = [lm.register_forward_pre_hook(split, with_kwargs=True)]
        hooks.append(held[0])

        def move_last(module, args, kwargs):
            """Re-register the split hook so that it runs after every pre-hook the language model has now."""
            if ref() is None or hooked_cache(kwargs) is not ref() or held[0] not in hooks:
                return
            held[0].remove()
            hooks.remove(held[0])
            held[0] = lm.register_forward_pre_hook(split, with_kwargs=True)
            hooks.append(held[0])

        hooks.append(model.register_forward_pre_hook(move_last, with_kwargs=True))
        return cache
