"""mmaccel.longctx: KV-cache methods built as transformers ``Cache`` objects handed to ``generate``.

>>> method = build_method("snapkv:budget=256:window=32")
>>> out = model.generate(**inputs, past_key_values=method.make_cache(model))

``METHODS`` is the registry the CLI and the app list; adding a method is one file and one line here.

Methods whose K/V is not one [B, Hkv, S, D] tensor per layer (the retrieval-head split, Quest's pages, AdaKV's per-head
budgets, quantized K/V) compute their own attention through :mod:`mmaccel.longctx.owned`. Retrieval-head patterns
are JSON files per model (:mod:`mmaccel.longctx.head_pattern`), found by
:func:`mmaccel.longctx.head_finder.find_retrieval_heads`.
"""
from __future__ import annotations

from .adakv import AdaKV
from .base import (
    EvictingLayer,
    KVMethod,
    KVMethodCache,
    KVScorer,
    LayerStep,
    bookkeeping_bytes,
    kv_cache_bytes,
)
from .bilevel import BiLevel
from .chunked import Chunked
from .chunked_ffn import ChunkedFeedForward
from .chunkkv import ChunkKV
from .compress import CompressedContext, answer, compress, compress_shared
from .expected_attention import ExpectedAttention
from .full import FullAttention
from .h2o import H2O
from .head_pattern import HeadPattern, available_head_patterns, load_head_pattern
from .keydiff import KeyDiff
from .knorm import KNorm
from .kvquant import KVQuant
from .kvzip import KVzip
from .longheads import LongHeads
from .minference import MInference, MInferencePattern, search_patterns
from .pyramidkv import PyramidKV
from .quest import Quest
from .registry import METHODS, build_method
from .retrieval_heads import RazorAttention, RetrievalHeads
from .snapkv import SnapKV, snapkv_keep_indices, snapkv_scores
from .streaming import StreamingLLM
from .tova import TOVA

METHODS.update({
    "full": FullAttention,
    "streaming": StreamingLLM,
    "streamingllm": StreamingLLM,
    "snapkv": SnapKV,
    "pyramidkv": PyramidKV,
    "h2o": H2O,
    "tova": TOVA,
    "knorm": KNorm,
    "chunked": Chunked,
    "chunked_ffn": ChunkedFeedForward,
    "retrieval_heads": RetrievalHeads,
    "duo": RetrievalHeads,
    "razor": RazorAttention,
    # "quest" once tests/test_longctx.py stops using it as its example of an unknown name
    "quest": Quest,
    "adakv": AdaKV,
    "chunkkv": ChunkKV,
    "kvquant": KVQuant,
    "bilevel": BiLevel,
    "longheads": LongHeads,
    "keydiff": KeyDiff,
    "expected_attention": ExpectedAttention,
    "kvzip": KVzip,
    "minference": MInference,
})




__all__ = [
    "H2O",
    "METHODS",
    "TOVA",
    "AdaKV",
    "BiLevel",
    "ChunkKV",
    "Chunked",
    "ChunkedFeedForward",
    "CompressedContext",
    "EvictingLayer",
    "ExpectedAttention",
    "FullAttention",
    "HeadPattern",
    "KNorm",
    "KVMethod",
    "KVMethodCache",
    "KVQuant",
    "KVScorer",
    "KVzip",
    "KeyDiff",
    "LayerStep",
    "LongHeads",
    "MInference",
    "MInferencePattern",
    "PyramidKV",
    "Quest",
    "RazorAttention",
    "RetrievalHeads",
    "SnapKV",
    "StreamingLLM",
    "answer",
    "available_head_patterns",
    "bookkeeping_bytes",
    "build_method",
    "compress",
    "compress_shared",
    "kv_cache_bytes",
    "load_head_pattern",
    "search_patterns",
    "snapkv_keep_indices",
    "snapkv_scores",
]
