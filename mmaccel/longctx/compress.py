"""Compress once, ask many: a KV-cache method compresses a context before any question is known, and each question
continues a copy of the compressed cache.

The query-agnostic setting of cache reuse (chat turns, RAG, kvpress's pipeline; KVzip, Kim et al., 2025,
arXiv 2505.23416, measures methods there): the prefill of the context is the method's own prefill, so a method that
scores with the last queries of the prompt (SnapKV's window) sees the end of the context, not the question.

>>> ctx = compress(build_method("snapkv:ratio=0.25"), model, context_ids)       # prefill + compression, once
>>> a1 = answer(model, ctx, question1_ids, max_new_tokens=32)                    # ctx.cache is never changed
>>> a2 = answer(model, ctx, question2_ids, max_new_tokens=32)

How a question is read
----------------------
:func:`answer` builds a fresh cache of the method (``method.make_cache(model)``: its hooks or owned attention),
copies the compressed state into it (tensors cloned), and feeds the question one token at a time -- decode steps,
exactly as the method treats generated tokens: a prefill-time method (SnapKV, KNorm, ...) does not compress again
(one multi-token forward would be a second prefill step and compress the held slots with the question's queries,
which is the query-aware setting); a decode-time method (H2O, TOVA, StreamingLLM) keeps its budget; Quest reads its
pages sparsely; KVQuant quantizes the new tokens as it does any decoded token. Then ``model.generate`` continues
from the last question token. Methods that declare ``needs_question = True`` (scoring that must see the question)
are refused by :func:`compress`.

:func:`compress_shared` gives several methods their compressed caches from one full-attention prefill of the context
(:class:`~mmaccel.longctx.shared_prefill.SharedPrefill`), the same caches their own prefills would give.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import Cache

from ..kernels._common import synchronize
from ..kernels.hf import cache_kwarg
from .base import KVMethod, close_cache
from .registry import build_method
from .shared_prefill import SharedPrefill

__all__ = ["Answer", "CompressedContext", "answer", "compress", "compress_shared", "needs_question"]


@dataclass
class CompressedContext:
    """A context compressed by one method: the cache after its prefill, with no hooks left on the model.

    Attributes
    ----------
    method : KVMethod
        The method that built and compressed the cache.
    cache : transformers.Cache
        The compressed cache (hooks removed); :func:`answer` copies it and never changes it.
    context_ids : torch.LongTensor
        [1, L] the context's token ids.
    compress_s : float or None
        Seconds of the method's own work in a shared prefill (:func:`compress_shared`); ``None`` from
        :func:`compress`, where the caller times the whole call.
    """

    method: KVMethod
    cache: Cache
    context_ids: torch.Tensor
    compress_s: float | None = None

    @property
    def context_length(self) -> int:
        """Tokens of the context (seen, not held)."""
        return int(self.context_ids.shape[1])


@dataclass
class Answer:
    """The output of :func:`answer`.

    Attributes
    ----------
    new_ids : list of int
        Generated token ids (after the question).
    question_s : float
        Seconds from the first question token to the first generated token (the question's time to first token).
    decode_s : float
        Seconds of the remaining ``len(new_ids) - 1`` tokens.
    kv_cache_bytes : int
        K/V bytes the copy held at the end (:func:`~mmaccel.longctx.kv_cache_bytes`).
    warnings : list of str
        The copy's warnings (e.g. a budget that ran as full attention).
    """

    new_ids: list
    question_s: float
    decode_s: float
    kv_cache_bytes: int
    warnings: list = field(default_factory=list)


def needs_question(method) -> bool:
    """Whether ``method`` (or a method it wraps) declares ``needs_question = True``: it cannot compress a context
    before the question is known."""
    while method is not None:
        if getattr(method, "needs_question", False) is True:
            return True
        method = getattr(method, "method", None)
    return False


def _resolve(method) -> KVMethod:
    method = build_method(method) if isinstance(method, str) else method
    if not isinstance(method, KVMethod):
        raise ValueError(f"compress takes a KV-cache method (an object of mmaccel.longctx or a spec such as "
                         f"'snapkv:ratio=0.25'), got {type(method).__name__}")
    if needs_question(method):
        raise ValueError(f"{method.name} scores the context with the question, so it cannot compress before the "
                         "question is known; run it query-aware (the question inside the prompt, --mode aware)")
    return method


def _ids(context_ids, model) -> torch.Tensor:
    ids = torch.as_tensor(context_ids, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"context_ids must be one non-empty sequence ([L] or [1, L]), got shape {tuple(ids.shape)}")
    return ids.to(getattr(model, "device", "cpu"))


def _prefill(model, ids: torch.Tensor, cache) -> None:
    """One forward of ``ids`` [1, L] with ``cache`` (logits of the last token only, where the model allows)."""
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **cache_kwarg(model, cache), **extra)



def compress(method, model, context_ids) -> CompressedContext:
    """Prefill ``context_ids`` through ``method.make_cache(model)``, so the method compresses at the end of the
    prefill, as it would with the question absent.

    Parameters
    ----------
    method : KVMethod or str
        A KV-cache method of :data:`mmaccel.longctx.METHODS` (object or spec).
    model : transformers.PreTrainedModel
        A decoder-only causal LM.
    context_ids : list of int or torch.Tensor [L] or [1, L]
        The context (batch size 1).

    Returns
    -------
    CompressedContext
        The compressed cache with its hooks removed (answer questions with :func:`answer`).

    Raises
    ------
    ValueError
        A spec that does not build, an object that is not a KV-cache method, a method with ``needs_question``
        (run it query-aware), empty or batched ``context_ids``; what the method's own prefill raises.
    """
    method = _resolve(method)
    ids = _ids(context_ids, model)
    cache = method.make_cache(model)
    try:
        with torch.inference_mode():
            _prefill(model, ids, cache)
    finally:
        close_cache(cache)
    return CompressedContext(method, cache, ids)


def compress_shared(methods, model, context_ids) -> list[CompressedContext]:
    """:func:`compress` for several methods with one full-attention prefill of the context
    (:class:`~mmaccel.longctx.shared_prefill.SharedPrefill`): each gets the cache its own prefill would give.

    Parameters
    ----------
    methods : list of KVMethod or str
        Methods with ``prefill_is_full`` (:func:`~mmaccel.longctx.shared_prefill.shares_prefill`).
    model, context_ids
        As :func:`compress`.

    Returns
    -------
    list of CompressedContext
        In the order of ``methods``; ``compress_s`` is each method's own work in the prefill (seconds).

    Raises
    ------
    ValueError
        As :func:`compress`, and for a method the shared prefill cannot serve (run it with :func:`compress`).
    """
    resolved = [_resolve(m) for m in methods]
    ids = _ids(context_ids, model)
    shared = SharedPrefill(resolved)
    leader = shared.make_cache(model)
    try:
        with torch.inference_mode():
            _prefill(model, ids, leader)
    finally:
        leader.close()
    with torch.inference_mode():
        shared.finish(model, ids)
    out = []
    for i, method in enumerate(resolved):
        cache = shared.decode_cache(i, model)
        close_cache(cache)  # the state stays; the hooks (or owned attention) go until a question is asked
        out.append(CompressedContext(method, cache, ids, compress_s=shared.compress_s[i]))
    return out


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def fresh_copy(compressed: CompressedContext, model) -> Cache:
    """A new cache of the method (hooks attached) holding a copy of ``compressed.cache``'s state: every tensor
    cloned, the layer objects the method's ``make_cache`` built kept (owned-attention modules point at them).

    Raises
    ------
    ValueError
        If the method's cache builds other layer types than the compressed cache holds.
    """
    cache = compressed.method.make_cache(model)
    for mine, held in zip(cache.layers, compressed.cache.layers):
        if type(mine) is not type(held):
            close_cache(cache)
            raise ValueError(f"{compressed.method.name}: its cache builds {type(mine).__name__} layers, the compressed "
                             f"cache holds {type(held).__name__}")
        mine.__dict__.update(_clone(held.__dict__))
    if hasattr(cache, "warnings"):
        cache.warnings.extend(w for w in getattr(compressed.cache, "warnings", []) if w not in cache.warnings)
    return cache


def _eos(model, kwargs: dict) -> set[int]:
    eos = kwargs.get("eos_token_id", getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def answer(model, compressed: CompressedContext, question_ids, max_new_tokens: int = 32,
           **generate_kwargs) -> Answer:
    """Ask one question of a compressed context: continue a copy of its cache, leaving ``compressed`` unchanged.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model the context was compressed with.
    compressed : CompressedContext
        From :func:`compress` or :func:`compress_shared`.
    question_ids : list of int or torch.Tensor [Q] or [1, Q]
        The question and whatever follows it up to the answer (chat template's assistant header, answer prefix).
    max_new_tokens : int
        Upper bound of generated tokens, >= 1 (stops early at EOS).
    **generate_kwargs
        Passed to ``model.generate`` (e.g. ``do_sample=False``, ``eos_token_id``, ``pad_token_id``).

    Returns
    -------
    Answer
        The new token ids, the question's time to first token and the decode time (seconds), the copy's K/V bytes.

    Raises
    ------
    ValueError
        ``max_new_tokens < 1``, empty or batched ``question_ids``, a cache that cannot be copied.

    Notes
    -----
    The question's tokens are decode steps of the method (see the module docstring), so with an unbounded budget the
    answer is plain greedy decoding of context + question (tested), up to the rounding of one-token forwards.
    """
    from .base import kv_cache_bytes

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = compressed.context_ids.device
    q = torch.as_tensor(question_ids, dtype=torch.long)
    q = (q[None] if q.dim() == 1 else q).to(device)
    if q.dim() != 2 or q.shape[0] != 1 or q.shape[1] == 0:
        raise ValueError(f"question_ids must be one non-empty sequence ([Q] or [1, Q]), got shape {tuple(q.shape)}")
    full = torch.cat([compressed.context_ids, q], dim=1)
    L = compressed.context_length
    cache = fresh_copy(compressed, model)
    try:
        with torch.inference_mode():
            synchronize(device)
            t0 = time.perf_counter()
            for t in range(q.shape[1] - 1):
                pos = L + t
                model(input_ids=q[:, t:t + 1], attention_mask=torch.ones(1, pos + 1, dtype=torch.long, device=device),
                      position_ids=torch.tensor([[pos]], device=device), use_cache=True, **cache_kwarg(model, cache))
            out = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=1,
                                 **cache_kwarg(model, cache, generate=True), **generate_kwargs)
            synchronize(device)
            question_s = time.perf_counter() - t0
            new_ids = out[0, full.shape[1]:].tolist()
            decode_s = 0.0
            if max_new_tokens > 1 and new_ids and new_ids[0] not in _eos(model, generate_kwargs):
                t1 = time.perf_counter()
                more = model.generate(out, attention_mask=torch.ones_like(out), max_new_tokens=max_new_tokens - 1,
                                      **cache_kwarg(model, cache, generate=True), **generate_kwargs)
                synchronize(device)
                decode_s = time.perf_counter() - t1
                new_ids = more[0, full.shape[1]:].tolist()
            return Answer(new_ids, question_s, decode_s, kv_cache_bytes(cache), list(getattr(cache, "warnings", [])))
    finally:
        close_cache(cache)
