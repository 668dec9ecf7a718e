"""Optimization-based retrieval-head finder: DuoAttention's per-head gates, trained on synthetic passkey documents.

Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads", 2024,
arXiv 2410.10819 (Section 3.2): every KV head mixes full and streaming attention,
``out = alpha * full + (1 - alpha) * streaming``, with ``alpha`` in [0, 1] trained so the model's hidden states on
passkey documents match full attention's, plus an L1 penalty pushing ``alpha`` to 0. The model stays frozen. Heads
that keep a large ``alpha`` are retrieval heads.

The gated attention runs through a registered attention function that only the decoder's attention modules of the
one model instance use, for the duration of training (per-module config copies, restored on exit; as in
:mod:`mmaccel.longctx.owned`).
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch
from transformers import AttentionInterface

from ..kernels import attention
from ..kernels.hf import attention_modules
from .head_pattern import HeadPattern, config_fingerprint

logger = logging.getLogger(__name__)

GATED_ATTENTION = "mmaccel_duo_gates"
GATE_ATTR = "_mmaccel_duo_gate"


def streaming_mask(q_len: int, k_len: int, sink: int, window: int, device) -> torch.Tensor:
    """bool [q_len, k_len]: causal, and each query sees the ``sink`` first keys plus itself and the ``window``
    keys before it (the streaming heads of :class:`~mmaccel.longctx.retrieval_heads.RetrievalHeads`)."""
    qa = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k = torch.arange(k_len, device=device)[None, :]
    return (k <= qa) & ((k < sink) | (qa - k <= window))


def gated_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered as :data:`GATED_ATTENTION`: per KV head ``alpha * full + (1 - alpha) * streaming`` attention.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module; its ``_mmaccel_duo_gate`` attribute is ``(alpha [Hkv], sink, window)``.
    query : torch.Tensor
        [B, Hq, L, D].
    key, value : torch.Tensor
        [B, Hkv, L, D].

    Returns
    -------
    (torch.Tensor, None)
        [B, L, Hq, D], differentiable in ``alpha``.

    Raises
    ------
    RuntimeError
        If the module has no gate (used outside :func:`gated_attention`) or gets a padded / cached input.
    """
    gate = getattr(module, GATE_ATTR, None)
    if gate is None:
        raise RuntimeError(f"{GATED_ATTENTION!r} attention used outside mmaccel.longctx.duo_gates.gated_attention")
    alpha, sink, window = gate
    Hq, L = query.shape[1], query.shape[2]
    Hkv = key.shape[1]
    if key.shape[2] != L:
        raise RuntimeError("gate training runs whole sequences without a cache")
    full = attention(query, key, value, causal=True, scaling=scaling, backend="sdpa")
    mask = streaming_mask(L, L, sink, window, query.device)[None, None]
    stream = attention(query, key, value, causal=True, scaling=scaling, attention_mask=mask, backend="sdpa")
    a = alpha.repeat_interleave(Hq // Hkv).to(query.dtype)[None, :, None, None]  # not clamped: keeps the grad at 0 and 1
    return (a * full + (1 - a) * stream).transpose(1, 2).contiguous(), None


AttentionInterface.register(GATED_ATTENTION, gated_attention_forward)


@contextlib.contextmanager
def gated_attention(model, alphas: torch.Tensor, sink: int, window: int):
    """Run ``model``'s decoder attention as gated full/streaming attention, per KV head, inside the block.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    alphas : torch.Tensor
        [num_layers, Hkv] gates in [0, 1] (a leaf tensor to train, or fixed values); used as they are (a clamp here
        would stop the gradient at 0 and 1), so keep them in range.
    sink, window : int
        The streaming heads' sinks and window.

    Raises
    ------
    ValueError
        If ``alphas`` does not have one row per attention module.
    """
    modules = attention_modules(model)
    if alphas.shape[0] != len(modules):
        raise ValueError(f"alphas has {alphas.shape[0]} rows for {len(modules)} attention layers")
    saved = {}
    try:
        for i, module in modules.items():
            saved[i] = module.config
            own = copy.copy(module.config)
            own._attn_implementation_internal = GATED_ATTENTION
            module.config = own
            setattr(module, GATE_ATTR, (alphas[i], sink, window))
        yield model
    finally:
        for i, config in saved.items():
            modules[i].config = config
            if hasattr(modules[i], GATE_ATTR):
                delattr(modules[i], GATE_ATTR)


def find_retrieval_heads_by_gates(
    model,
    tokenizer,
    *,
    lengths: tuple[int, ...] = (1024,),
    steps: int = 40,
    lr: float = 0.02,
    reg: float = 0.05,
    sink: int = 4,
    window: int = 64,
    supervise: int = 32,
    fraction: float = 0.25,
    seed: int = 0,
    model_name: str = "",
    haystack=None,
) -> HeadPattern:
    """DuoAttention's optimization-based finder (Xiao et al., 2024, arXiv 2410.10819): train per-KV-head gates.

    Each step builds one passkey document (:func:`mmaccel.data.haystack.make_niah_sample`, the length cycling over
    ``lengths``, the depth drawn uniformly, the answer appended), runs the frozen model once with full attention
    (no grad) and once with gated attention, and takes an Adam step on
    ``mean((h_full - h_gated)^2) over the last `supervise` positions and the hidden dims + reg * sum(alpha)`` (final
    hidden states;
    ``alpha`` clamped to [0, 1] after each step, starting at 1).

    Cost: two forwards and one backward of the model per step on a ``lengths`` document (micro-lm, 1,024 tokens,
    one CPU thread: ~1 s per step).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Frozen during the run (``requires_grad`` is restored after).
    tokenizer : a Hugging Face tokenizer
    lengths : tuple of int
        Document lengths in tokens.
    steps : int
        Optimizer steps, >= 1.
    lr, reg : float
        Adam learning rate and L1 weight (DuoAttention: 0.02 and 0.05).
    sink, window : int
        Streaming attention used during training.
    supervise : int
        Trailing positions whose hidden states are matched (the question and the answer), >= 1.
    fraction : float
        Fraction of (layer, KV head) pairs made retrieval heads, in [0, 1].
    seed : int
    model_name : str
    haystack : HaystackTokens or sequence of them, optional
        Filler text, taken in turn step by step (default: the fitting mix of
        :func:`mmaccel.data.haystack.calibration_haystacks`, which excludes the default NIAH haystack). Their names
        are kept in ``found_by["haystacks"]``.

    Returns
    -------
    HeadPattern
        ``scores`` = the trained gates, the best ``fraction`` as retrieval heads; ``found_by`` holds the settings and
        the loss per step.

    Raises
    ------
    ValueError
        On an argument out of range.
    """
    import random

    from ..data.haystack import haystack_mix, make_niah_sample

    if steps < 1 or supervise < 1 or not lengths or not 0 <= fraction <= 1 or lr <= 0 or reg < 0:
        raise ValueError("find_retrieval_heads_by_gates needs steps >= 1, supervise >= 1, lengths, lr > 0, reg >= 0 "
                         "and fraction in [0, 1]")
    modules = attention_modules(model)
    fp = config_fingerprint(model.config)
    mix = haystack_mix(tokenizer, haystack)
    alphas = torch.ones(len(modules), fp["num_key_value_heads"], device=model.device, requires_grad=True)
    optim = torch.optim.Adam([alphas], lr=lr)
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    rng = random.Random(f"duo-gates:{seed}")
    losses = []
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        for step in range(steps):
            sample = make_niah_sample(tokenizer, lengths[step % len(lengths)], rng.uniform(0.05, 0.95),
                                      seed=seed * 100_003 + step, haystack=mix[step % len(mix)])
            answer = tokenizer.encode(" " + sample.answer, add_special_tokens=False)
            ids = torch.tensor([sample.input_ids + answer], device=model.device)
            with torch.no_grad():
                target = decoder(ids).last_hidden_state[:, -supervise:]
            with gated_attention(model, alphas, sink, window):
                hidden = decoder(ids).last_hidden_state[:, -supervise:]
            distill = (hidden.float() - target.float()).pow(2).mean()
            loss = distill + reg * alphas.sum()  # alphas stay in [0, 1]: this is their L1 norm
            optim.zero_grad()
            loss.backward()
            optim.step()
            with torch.no_grad():
                alphas.clamp_(0, 1)
            losses.append(round(float(distill.detach()), 6))
            logger.info("duo gates step %d/%d: distill %.5f", step + 1, steps, losses[-1])
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
        model.train(was_training)
    scores = alphas.detach().cpu()
    pattern = HeadPattern(
        num_layers=len(modules), num_kv_heads=fp["num_key_value_heads"], num_attention_heads=fp["num_attention_heads"],
        scores=scores.tolist(), retrieval_heads=[], fingerprint=fp,
        model=model_name or str(getattr(model.config, "name_or_path", "") or ""),
        found_by={"finder": "optimization (DuoAttention gates)", "lengths": list(lengths), "steps": steps, "lr": lr,
                  "reg": reg, "sink": sink, "window": window, "supervise": supervise, "seed": seed,
                  "haystacks": [h.name for h in mix[:steps]],
                  "distill_loss": losses},
    )
    found = pattern.with_fraction(fraction)
    found.found_by = {**pattern.found_by, "fraction": fraction}
    return found


__all__ = ["find_retrieval_heads_by_gates", "gated_attention", "streaming_mask"]
