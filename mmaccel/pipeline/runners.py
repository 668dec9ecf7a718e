"""Runners: how one composed method runs one generation.

A runner has ``timed_generate(model, input_ids, *, max_new_tokens, gen_kwargs, model_inputs=None, **extra) -> dict``
(``new_ids``, ``ttft_s``, ``decode_s`` in seconds, ``kv_cache_bytes_prefill`` / ``kv_cache_bytes_final`` in bytes,
``telemetry``). Speculative methods and transformers' peers (:mod:`mmaccel.speculative.harness`) are their own
runners; a KV-cache method runs through :class:`KVCacheRun`: ``model.generate`` with the method's fresh cache.

The split into time to first token and decode is the runner's own (it knows where prefill ends); measuring many
runs, memory and the vision tower's share is :mod:`mmaccel.eval.generation`'s.
"""
from __future__ import annotations

import math
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..kernels._common import synchronize
from ..kernels.hf import cache_kwarg
from ..longctx import kv_cache_bytes
from ..longctx.base import close_cache


class StepProbe(LogitsProcessor):
    """Timestamps the first generation step (the end of prefill) and records the K/V bytes the cache holds then.

    ``generate`` calls a logits processor once per new token, right after the forward that produced its logits.

    Parameters
    ----------
    cache : transformers.Cache
        The cache ``generate`` fills.
    device : torch.device
        Synchronised before the timestamp (CUDA).

    Attributes
    ----------
    first_step_time : float or None
        ``time.perf_counter()`` at the first call, seconds.
    kv_bytes_prefill : int or None
        :func:`mmaccel.longctx.kv_cache_bytes` at the first call (after any prefill-time compression), bytes.
    steps : int
        Calls so far (new tokens).
    """

    def __init__(self, cache, device: torch.device):
        self.cache, self.device = cache, device
        self.first_step_time: float | None = None
        self.kv_bytes_prefill: int | None = None
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.steps == 0:
            synchronize(self.device)
            self.first_step_time = time.perf_counter()
            self.kv_bytes_prefill = kv_cache_bytes(self.cache)
        self.steps += 1
        return scores


def check_temperature(temperature) -> float:
    """A sampling temperature as a float: ``0`` = greedy, a finite ``> 0`` = sampling.

    Raises
    ------
    ValueError
        For ``None``, a non-number, a negative value, NaN or infinity (one line naming the fix).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be >= 0 and finite (0 = greedy, > 0 = sampling), got {temperature!r}")
    return float(temperature)


def generation_kwargs(model, tokenizer, temperature: float = 0.0) -> dict:
    """The ``generate`` keyword arguments every run uses: greedy decoding (``temperature == 0``) or plain sampling at
    ``temperature`` (no top-k / top-p), stopping at EOS; EOS and pad ids come from the tokenizer when the model's
    generation config has none.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    tokenizer : tokenizer or None
    temperature : float
        ``0`` = greedy, ``> 0`` = sampling.

    Returns
    -------
    dict
        ``do_sample``, ``num_beams``, ``temperature``, ``top_p``, ``top_k``, ``eos_token_id``, ``pad_token_id``.

    Raises
    ------
    ValueError
        For a temperature that is negative, NaN or infinite (:func:`check_temperature`).
    """
    temperature = check_temperature(temperature)
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(gen_cfg, "pad_token_id", None)
    if pad is None and tokenizer is not None:
        pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    sampling = temperature > 0
    return {"do_sample": sampling, "num_beams": 1, "temperature": temperature if sampling else None, "top_p": None,
            "top_k": None, "eos_token_id": eos, "pad_token_id": pad}


class KVCacheRun:
    """How a KV-cache method runs one generation: ``model.generate`` with the method's fresh cache.

    Parameters
    ----------
    method : KVMethod
        Any method of :data:`mmaccel.longctx.METHODS` (``make_cache(model)``; ``telemetry(cache)`` if it has one).
    """

    def __init__(self, method):
        self.method = method

    def timed_generate(self, model, input_ids: torch.Tensor, *, max_new_tokens: int, gen_kwargs: dict,
                       model_inputs: dict | None = None) -> dict:
        """One ``generate`` from ``input_ids`` [1, L] (plus a VLM's ``model_inputs``, e.g. ``pixel_values``).

        Returns
        -------
        dict
            ``new_ids`` (list of int), ``ttft_s`` and ``decode_s`` (seconds, split at the first step),
            ``kv_cache_bytes_prefill`` and ``kv_cache_bytes_final`` (bytes), ``telemetry`` (the method's).
        """
        method, device = self.method, input_ids.device
        cache = method.make_cache(model)
        probe = StepProbe(cache, device)
        try:
            synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **cache_kwarg(model, cache, generate=True),
                max_new_tokens=max_new_tokens,
                logits_processor=LogitsProcessorList([probe]),
                **gen_kwargs,
                **(model_inputs or {}),
            )
            synchronize(device)
            t_end = time.perf_counter()
            first = probe.first_step_time if probe.first_step_time is not None else t_end
            return {
                "new_ids": out[0, input_ids.shape[1]:].tolist(),
                "ttft_s": first - t0,
                "decode_s": t_end - first,
                "kv_cache_bytes_prefill": probe.kv_bytes_prefill,
                "kv_cache_bytes_final": kv_cache_bytes(cache),
                "telemetry": method.telemetry(cache) if hasattr(method, "telemetry") else {},
            }
        finally:
            close_cache(cache)  # remove any hooks a failed run left on the model


def runner_for(method):
    """The object that runs one generation of ``method``: itself when it has ``timed_generate`` (speculative drafters
    and transformers peers, :mod:`mmaccel.speculative.harness`), else a :class:`KVCacheRun`."""
    return method if hasattr(method, "timed_generate") else KVCacheRun(method)
