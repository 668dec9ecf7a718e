"""mmaccel.kernels: the one attention-kernel layer every module shares.

Plain functions, each with a PyTorch reference and a ``backend="auto" | "flash" | "flex" | "triton" | "sdpa" |
"reference"`` choice (see :mod:`mmaccel.kernels.backends`):

- :func:`attention`: dense attention with GQA, padding masks and packed variable-length batches.
- :func:`sparse_prefill_attention`: per-head sparse prefill (dense / streaming / chunked / block-sparse).
- :func:`decode_attention`: single-token decode over selected tokens or pages, split-K.
- :func:`attention_column_scores`: attention each key receives from a window of queries, O(L * block) memory.
- :func:`tree_attention`: token-tree verification for speculative decoding.
- :class:`PackedLinears`: CPU linear layers prepacked for oneDNN, so a few-token forward costs about one token's.
- :func:`register_attention` / :func:`attention_patterns`: run a transformers model on this layer.
"""
from .backends import available_backends
from .column_scores import attention_column_scores
from .decode import decode_attention, gather_pages
from .dense import attention
from .hf import attention_patterns, register_attention
from .packed_linear import PackedLinear, PackedLinears, packed_linear_available
from .patterns import BlockSparse, Chunked, Dense, HeadPatterns, Streaming
from .sparse_prefill import sparse_prefill_attention
from .tree import tree_attention

__all__ = [
    "BlockSparse",
    "Chunked",
    "Dense",
    "HeadPatterns",
    "PackedLinear",
    "PackedLinears",
    "Streaming",
    "attention",
    "attention_column_scores",
    "attention_patterns",
    "available_backends",
    "decode_attention",
    "gather_pages",
    "packed_linear_available",
    "register_attention",
    "sparse_prefill_attention",
    "tree_attention",
]
