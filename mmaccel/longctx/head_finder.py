"""Training-free retrieval-head finder: needle attention in synthetic passkey documents + copy/induction scores.

The signals of RazorAttention (Tang et al., "RazorAttention: Efficient KV Cache Compression Through Retrieval Heads",
2024, arXiv 2407.15891: echo and induction heads on repeated random tokens) and of DuoAttention's training-free
variant (Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", 2024,
arXiv 2410.10819: attention on the needle of passkey documents), per (layer, KV head) so the result fits GQA.

Attention is never materialised by the model: each attention module's forward is observed by a per-instance forward
hook that recomputes the queries it needs (:func:`mmaccel.longctx.base.window_queries`) and reads the post-RoPE keys
from the cache; needle mass comes from :func:`mmaccel.kernels.attention_column_scores`. The hooks are removed on
return, also on error.
"""
from __future__ import annotations

import logging
import random

import torch
from transformers import DynamicCache

from ..kernels import attention_column_scores
from ..kernels.dense import causal_mask
from ..kernels.hf import attention_modules, cache_kwarg
from .base import mean_over_query_groups, window_queries
from .head_pattern import HeadPattern, config_fingerprint

logger = logging.getLogger(__name__)


def _observe(model, input_ids: torch.Tensor, window: int, score_fn) -> list[torch.Tensor]:
    """One forward of ``input_ids`` [1, L]; per layer, ``score_fn(queries [1, Hq, window, D], keys [1, Hkv, L, D],
    scaling)`` -> [Hkv] float32. Returns the per-layer results in layer order. Sliding-window layers (Mistral,
    Gemma 2/3's local layers) score 0: they see only their window, and the retrieval-head methods act on
    full-attention layers only."""
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"found no self-attention modules in {type(model).__name__}; the head finder needs a "
                         "transformers decoder")
    results: dict[int, torch.Tensor] = {}
    cache = DynamicCache(config=model.config)

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        if getattr(layer, "is_sliding", False):  # a local layer keeps its window: no retrieval head, and untouched
            results[module.layer_idx] = torch.zeros(int(layer.keys.shape[1]))  # by the retrieval-head methods
            return
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        queries = window_queries(module, hidden, kwargs.get("position_embeddings"), window)
        keys = cache.layers[module.layer_idx].keys
        results[module.layer_idx] = score_fn(queries, keys, getattr(module, "scaling", None)).float().cpu()

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules.values()]
    try:
        with torch.no_grad():
            model(input_ids.to(model.device), **cache_kwarg(model, cache), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return [results[i] for i in sorted(results)]


def needle_scores(model, tokenizer, *, length: int, depth: float, seed: int = 0, haystack=None) -> torch.Tensor:
    """Per-head attention mass on the needle while the model reads out the answer, in one passkey document.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    tokenizer : a Hugging Face tokenizer
    length : int
        Prompt length in tokens (:func:`mmaccel.data.haystack.make_niah_sample`).
    depth : float
        Needle depth in [0, 1].
    seed : int
    haystack : mmaccel.data.haystack.HaystackTokens, optional
        The filler text (default: the held-out prose of :func:`~mmaccel.data.haystack.make_niah_sample`).

    Returns
    -------
    torch.Tensor
        [num_layers, Hkv] float32 in [0, 1]: attention probability on the needle sentence's tokens, averaged over
        the answer positions (the last prompt token and the answer's tokens but the last, teacher-forced) and over
        the query heads of each GQA group.
    """
    from ..data.haystack import make_niah_sample

    sample = make_niah_sample(tokenizer, length, depth, seed=seed, haystack=haystack)
    needle_len = len(tokenizer.encode(" " + sample.needles[0].text(), add_special_tokens=False))
    answer = tokenizer.encode(" " + sample.answer, add_special_tokens=False)
    ids = torch.tensor([sample.input_ids + answer])
    span = slice(sample.needle_position, sample.needle_position + needle_len)
    window = len(answer) + 1  # the last prompt token and every answer token; the last one predicts nothing

    def score(queries, keys, scaling):
        column = attention_column_scores(queries[:, :, :-1], keys[:, :, :-1], causal=True, reduce="mean",
                                         scaling=scaling)  # [1, Hq, L - 1]
        return mean_over_query_groups(column[..., span].sum(-1, keepdim=True), keys.shape[1])[0, :, 0]

    return torch.stack(_observe(model, ids, window, score))


def copy_scores(model, tokenizer, *, length: int = 128, seed: int = 0) -> torch.Tensor:
    """Per-head echo + induction attention on a random token sequence repeated twice.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    tokenizer : a Hugging Face tokenizer (its special ids are never drawn)
    length : int
        Length ``n`` of the random sequence, >= 2; the input is ``[BOS] x x`` (``2n + 1`` tokens with a BOS).
    seed : int

    Returns
    -------
    torch.Tensor
        [num_layers, Hkv] float32 in [0, 1]: for each query in the second copy (token ``x_i``), the attention on
        ``x_i``'s first occurrence (echo) plus on ``x_{i+1}``'s (induction), averaged over the queries and the query
        heads of each GQA group. Computed from the captured post-RoPE queries and keys.
    """
    if length < 2:
        raise ValueError(f"copy length must be >= 2, got {length}")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(f"copy:{seed}:{length}")
    x = [rng.choice(vocab) for _ in range(length)]
    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = torch.tensor([head + x + x])
    first = len(head)  # position of x_0 in the first copy
    i = torch.arange(length - 1)  # second-copy queries x_0 .. x_{n-2}

    def score(queries, keys, scaling):
        L = keys.shape[2]
        Hq, Hkv = queries.shape[1], keys.shape[1]
        q = queries[:, :, : length - 1].float()  # [1, Hq, n - 1, D]: positions first + n + i
        k = keys.float().repeat_interleave(Hq // Hkv, dim=1)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        logits = (q @ k.transpose(-1, -2)) * scale
        allowed = causal_mask(length, L, q.device)[: length - 1]
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)  # [1, Hq, n - 1, L]
        echo = probs[0, :, i, first + i]
        induction = probs[0, :, i, first + i + 1]
        per_q_head = (echo + induction).mean(-1)
        return mean_over_query_groups(per_q_head[None, :, None], Hkv)[0, :, 0]

    return torch.stack(_observe(model, ids, length, score))


def find_retrieval_heads(
    model,
    tokenizer,
    *,
    lengths: tuple[int, ...] = (1024,),
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
    samples: int = 2,
    copy_length: int = 128,
    copy_samples: int = 2,
    copy_weight: float = 0.5,
    fraction: float = 0.25,
    model_name: str = "",
    haystack=None,
) -> HeadPattern:
    """Find retrieval heads without training: needle attention in passkey documents and copy/induction scores.

    Training-free finder of DuoAttention (Xiao et al., 2024, arXiv 2410.10819) and RazorAttention (Tang et al.,
    2024, arXiv 2407.15891), per KV head. The score of head ``(l, h)`` is
    ``(1 - copy_weight) * needle + copy_weight * copy``, both attention probabilities in [0, 1] (:func:`needle_scores`
    averaged over ``lengths x depths x samples`` documents, :func:`copy_scores` over ``copy_samples`` sequences);
    the ``ceil(fraction * layers * kv_heads)`` best pairs are the retrieval heads.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only LM with Llama-style attention modules (``q_proj``, ``head_dim``, full RoPE).
    tokenizer : a Hugging Face tokenizer
    lengths : tuple of int
        Passkey document lengths in tokens.
    depths : tuple of float
        Needle depths in [0, 1].
    samples : int
        Documents per (length, depth), >= 1.
    copy_length : int
        Random-sequence length for the copy scores, >= 2.
    copy_samples : int
        Random sequences, >= 0 (0 with ``copy_weight = 0`` skips the copy scores).
    copy_weight : float
        Weight of the copy score, in [0, 1].
    fraction : float
        Fraction of (layer, KV head) pairs made retrieval heads, in [0, 1].
    model_name : str
        Label stored in the pattern (default: ``config.name_or_path``).
    haystack : HaystackTokens or sequence of them, optional
        Filler text of the passkey documents, taken in turn document by document (default: the fitting mix of
        :func:`mmaccel.data.haystack.calibration_haystacks`, which excludes the default NIAH haystack, so that the
        pattern can be validated on text it never saw). Their names are kept in ``found_by["haystacks"]``.

    Returns
    -------
    HeadPattern
        With ``scores``, the retrieval set, the model's config fingerprint, and in ``found_by`` the settings and the
        two score tables. ``.save(path)`` writes the JSON.

    Raises
    ------
    ValueError
        On an argument out of range or a model without attention modules.
    """
    if not lengths or not depths or samples < 1 or copy_samples < 0:
        raise ValueError("find_retrieval_heads needs lengths, depths, samples >= 1 and copy_samples >= 0")
    if not 0 <= copy_weight <= 1 or not 0 <= fraction <= 1:
        raise ValueError(f"copy_weight and fraction must be in [0, 1], got {copy_weight}, {fraction}")
    if copy_weight > 0 and copy_samples == 0:
        raise ValueError("copy_weight > 0 needs copy_samples >= 1")
    from ..data.haystack import haystack_mix

    mix = haystack_mix(tokenizer, haystack)
    docs = [(n, d, s) for n in lengths for d in depths for s in range(samples)]
    was_training = model.training
    model.eval()
    try:
        needle = torch.stack([
            needle_scores(model, tokenizer, length=n, depth=d, seed=s, haystack=mix[j % len(mix)])
            for j, (n, d, s) in enumerate(docs)
        ]).mean(0)
        copy = (torch.stack([copy_scores(model, tokenizer, length=copy_length, seed=s) for s in range(copy_samples)])
                .mean(0) if copy_samples else torch.zeros_like(needle))
    finally:
        model.train(was_training)
    scores = (1 - copy_weight) * needle + copy_weight * copy
    fp = config_fingerprint(model.config)
    L, H = scores.shape
    logger.info("retrieval-head scores (layer x KV head):\n%s", scores)
    pattern = HeadPattern(
        num_layers=L, num_kv_heads=H, num_attention_heads=fp["num_attention_heads"], scores=scores.tolist(),
        retrieval_heads=[], fingerprint=fp,
        model=model_name or str(getattr(model.config, "name_or_path", "") or ""),
        found_by={"finder": "training-free (needle attention + copy/induction)", "lengths": list(lengths),
                  "depths": list(depths), "samples": samples,
                  "haystacks": [h.name for h in mix[:len(docs)]], "copy_length": copy_length,
                  "copy_samples": copy_samples, "copy_weight": copy_weight,
                  "needle_scores": [[round(float(v), 6) for v in row] for row in needle],
                  "copy_scores": [[round(float(v), 6) for v in row] for row in copy]},
    )
    found = pattern.with_fraction(fraction)
    found.found_by = {**pattern.found_by, "fraction": fraction}
    if L != len(attention_modules(model)):
        raise ValueError(f"scored {L} layers but the model has {len(attention_modules(model))} attention modules")
    return found


__all__ = ["copy_scores", "find_retrieval_heads", "needle_scores"]
