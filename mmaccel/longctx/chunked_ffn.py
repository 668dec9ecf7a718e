"""Chunked feed-forward as a wrapper over any KV-cache method: every decoder layer's MLP runs over the sequence in
pieces of ``chunk`` tokens, so a long prefill never holds the whole prompt's MLP intermediates.

Kitaev, Kaiser and Levskaya, "Reformer: The Efficient Transformer", 2020, arXiv 2001.04451 (chunked feed-forward
layers; transformers' ``chunk_size_feed_forward``); Luo et al., "Mini-Sequence Transformer", 2024, arXiv 2407.15892.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KVMethodCache
from .chunked import ChunkWrapper


class ChunkedMLP(torch.nn.Module):
    """A token-wise feed-forward module run over its input's sequence axis in pieces of ``chunk`` tokens.

    Parameters
    ----------
    mlp : torch.nn.Module
        The decoder layer's feed-forward, called as ``mlp(hidden_states)`` on [B, L, D] and returning one tensor
        [B, L, D_out] (Llama, Mistral, Qwen2, Gemma and SmolLM MLPs).
    chunk : int
        Tokens per piece; an input of at most ``chunk`` tokens (every decode step) goes through ``mlp`` unchanged.

    Notes
    -----
    The pieces' outputs are written into one preallocated [B, L, D_out] tensor, so the peak of an MLP call is that
    output plus one piece's intermediates (for SwiGLU three [B, chunk, intermediate] tensors) instead of three
    [B, L, intermediate] ones. Exact because the feed-forward treats every token on its own; the matrix products
    run on fewer rows, which may change the last bits of a float.

    Raises
    ------
    TypeError
        At a forward, when ``mlp`` returns something other than one tensor (e.g. a mixture of experts that also
        returns router logits): such a block cannot be chunked this way.
    """

    def __init__(self, mlp: torch.nn.Module, chunk: int):
        super().__init__()
        self.mlp, self.chunk = mlp, chunk

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        length = hidden_states.shape[-2] if hidden_states.dim() >= 2 else 0
        if length <= self.chunk:
            return self.mlp(hidden_states)
        out = None
        for start in range(0, length, self.chunk):
            piece = self.mlp(hidden_states[..., start:start + self.chunk, :])
            if not isinstance(piece, torch.Tensor):
                raise TypeError(f"chunked_ffn: {type(self.mlp).__name__} returns {type(piece).__name__}, not one "
                                "tensor; only a token-wise MLP that returns its output can be chunked")
            if out is None:
                out = piece.new_empty((*piece.shape[:-2], length, piece.shape[-1]))
            out[..., start:start + piece.shape[-2], :] = piece
        return out


def feed_forward_owners(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``model`` (any module with both ``self_attn`` and an ``mlp`` module), in order; for a
    vision-language model this includes its language model's layers (and a vision tower's, if they are named so)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "mlp", None), torch.nn.Module) and hasattr(m, "self_attn")]


class _Restore:
    """A handle whose ``remove()`` puts a layer's own MLP back (kept in a cache's ``_hooks``)."""

    def __init__(self, layer: torch.nn.Module, wrapper: ChunkedMLP):
        self.layer, self.wrapper = layer, wrapper

    def remove(self) -> None:
        if self.layer.mlp is self.wrapper:
            self.layer.mlp = self.wrapper.mlp


@dataclass
class ChunkedFeedForward(ChunkWrapper):
    """Chunked feed-forward (Reformer, Kitaev et al., 2020, arXiv 2001.04451) over any method:
    ``chunked_ffn:chunk=512:method=snapkv,ratio=0.25``.

    While the cache is open, each decoder layer's ``mlp`` of this model instance is replaced by a
    :class:`ChunkedMLP` over it; :meth:`~mmaccel.longctx.base.KVMethodCache.close` (which every mmaccel run calls,
    also after a failure) and the cache's garbage collection put the layers' own MLPs back. Attention, the cache and
    the wrapped method's scoring see the whole prompt as before, so the kept slots and the output are those of the
    wrapped method alone (greedy outputs token-identical, tested); only the prefill's peak memory changes.

    On ``smollm2-135m`` at 4k (fp32, exact CPU allocations) the SwiGLU intermediates are three 24 MiB tensors per
    layer; chunking them to 512 tokens lowers SnapKV's (25%) prefill peak from 156 to 115 MiB, after which the peak is
    the last layer's attention (its RoPE temporaries). Compose with :class:`~mmaccel.longctx.chunked.Chunked` to
    bound attention activations too (that changes what scored methods keep).

    Parameters
    ----------
    method : KVMethod or str
        The wrapped method, or its spec with commas for colons (default ``full``).
    chunk : int
        Tokens per feed-forward piece, >= 1 (default 512).

    Raises
    ------
    ValueError
        A bad ``chunk``; a wrapped ``chunked_ffn`` (the MLPs are chunked once); from :meth:`make_cache`, a model with
        no decoder layer (``self_attn`` + ``mlp``) or one whose MLPs are already chunked by another open cache.
    TypeError
        At a forward, a feed-forward that does not return one tensor (see :class:`ChunkedMLP`).
    """

    chunk: int = 512

    method_name = "chunked_ffn"

    def make_cache(self, model: torch.nn.Module) -> KVMethodCache:
        """The wrapped method's cache (:meth:`~mmaccel.longctx.chunked.ChunkWrapper.wrapped_cache`), with every
        decoder layer's MLP chunked until the cache closes."""
        layers = feed_forward_owners(model)
        if not layers:
            raise ValueError(f"chunked_ffn: {type(model).__name__} has no decoder layer with self_attn and mlp "
                             "modules; run the method without chunked_ffn")
        if any(isinstance(layer.mlp, ChunkedMLP) for layer in layers):
            raise ValueError("chunked_ffn: this model's MLPs are already chunked by another open cache; close it "
                             "first (cache.close())")
        cache = self.wrapped_cache(model)
        for layer in layers:
            wrapper = ChunkedMLP(layer.mlp, self.chunk)
            layer.mlp = wrapper
            cache._hooks.append(_Restore(layer, wrapper))
        return cache
