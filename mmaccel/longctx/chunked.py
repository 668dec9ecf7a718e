"""Chunked prefill as a wrapper over any KV-cache method: the prompt goes through the model in fixed chunks.

Agrawal et al., "SARATHI: Efficient LLM Inference by Piggybacking Decodes with Chunked Prefills", 2023,
arXiv 2308.16369.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch

from .base import KVMethod, KVMethodCache, LayerStep, _check_int


def resolve_inner(method, owner: str) -> KVMethod:
    """A wrapped method from an object or a nested spec (``"snapkv,budget=64,window=8"``: commas for colons)."""
    if isinstance(method, KVMethod):
        return method
    if isinstance(method, str):
        from . import build_method

        return build_method(method.replace(",", ":"))
    raise ValueError(f"{owner}: method must be a KV-cache method or a spec such as 'snapkv,budget=256', got {method!r}")


_SEQ_KWARGS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids")


@dataclass
class Chunked(KVMethod):
    """Chunked prefill (SARATHI, Agrawal et al., 2023, arXiv 2308.16369) over any method: ``Chunked(SnapKV(), 1024)``.

    A forward pre-hook on the model (this instance only) splits every forward with this cache whose input is longer
    than ``chunk`` into chunks of ``chunk`` tokens (the last one shorter) and runs them in order; the logits of the
    last chunk are returned, which is all ``generate`` reads. Activations are bounded by the chunk, and so is the
    K/V held by a method that compresses at every prefill step.

    Parameters
    ----------
    method : KVMethod or str
        The wrapped method, or its spec with commas for colons (``chunked:chunk=512:method=snapkv,budget=64``).
    chunk : int
        Tokens per prefill chunk, >= 1 (default 1024).

    Notes
    -----
    For ``full`` the greedy output is token-identical to unchunked prefill. For a scored method each chunk is one
    prefill step (see :mod:`mmaccel.longctx.base`): the held slots plus the chunk are compressed back to the budget,
    and SnapKV's "window" is the last ``window`` queries of the current chunk (the prompt's last tokens for the last
    chunk), choosing only among what earlier chunks kept. ``ratio`` budgets apply to the tokens seen so far. The same
    holds for ``generate(prefill_chunk_size=C)``.

    Raises
    ------
    ValueError
        On a bad ``chunk``, a wrapped method that cannot run chunked (``supports_chunking`` false), a forward with a
        mask other than the 2-D padding mask.
    """

    method: object = "full"
    chunk: int = 1024

    method_name = "chunked"

    def __post_init__(self):
        _check_int("chunked", "chunk", self.chunk, 1, "pass the prefill chunk length in tokens, e.g. chunk=1024")
        self.method = resolve_inner(self.method, "chunked")
        if not getattr(self.method, "supports_chunking", True):
            raise ValueError(
                f"chunked: {self.method.name} cannot run with chunked prefill ({self.method.chunking_error}); "
                "run it unchunked"
            )

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

    def make_cache(self, model: torch.nn.Module) -> KVMethodCache:
        """The wrapped method's own cache (``method.make_cache``: hook-driven or attention-owning alike) plus a
        chunking pre-hook on ``model``, removed with the cache's hooks. A method whose cache is a plain transformers
        cache (``full``) gets a :class:`KVMethodCache` of its layers, which can hold the hook."""
        cache = self.method.make_cache(model)
        if not isinstance(cache, KVMethodCache):
            cache = KVMethodCache(model, self)
        ref = weakref.ref(cache)
        chunk = self.chunk
        last_logits_only = "logits_to_keep" in inspect.signature(model.forward).parameters

        def split(module, args, kwargs):
            cache = ref()
            if cache is None or kwargs.get("past_key_values") is not cache:
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

        cache._hooks.append(model.register_forward_pre_hook(split, with_kwargs=True))
        return cache

    def telemetry(self, cache) -> dict:
        """The wrapped method's telemetry, with ``method``/``spec`` of the wrapper and ``chunk``."""
        return {**self.method.telemetry(cache), "method": self.name, "spec": self.spec, "chunk": self.chunk,
                "inner_method": self.method.spec}

    @property
    def spec(self) -> str:
        return f"chunked:chunk={self.chunk}:method={self.method.spec.replace(':', ',')}"
