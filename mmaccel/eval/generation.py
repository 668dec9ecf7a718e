"""Measured generation: the one generation path every CLI command, eval and the app uses.

:func:`generate_measured` runs greedy ``model.generate`` with a KV-cache method's fresh cache and returns one
:class:`RunRecord` with the same fields for every method (the harness contract of Spec-Bench, Xia et al., 2024,
arXiv 2401.07851): the output, timings in seconds, memory in bytes, and the method's telemetry.

Timing
------
A :class:`~transformers.LogitsProcessor` probe is called by ``generate`` once per new token, right after the forward
that produced its logits. Its first call therefore marks the end of prefill:

- ``ttft_s``: from the start of ``generate`` to the first probe call (prefill + the first logits), seconds.
- ``decode_s``: from the first probe call to the return of ``generate``, i.e. the ``new_tokens - 1`` decode
  forwards, seconds.
- ``tokens_per_s``: ``(new_tokens - 1) / decode_s`` (decode throughput; the first token is counted in TTFT);
  ``None`` when fewer than two tokens were generated.

On CUDA every timestamp is taken after ``torch.cuda.synchronize``. ``warmup`` unrecorded runs come first; the record
holds the median of ``repeats`` measured runs (each run's numbers are kept in ``RunRecord.samples``).

Memory
------
``peak_memory_bytes`` is the peak memory growth during one run, measured by :class:`mmaccel.eval.memory.PeakMemory`
(CUDA: ``max_memory_allocated``; CPU: sampled RSS growth -- see that module for what it does and does not see).

``kv_cache_bytes_prefill`` / ``kv_cache_bytes_final`` are the bytes of K/V tensors the cache really holds after
prefill (at the first probe call, i.e. after any prefill-time compression) and when ``generate`` returns
(:func:`mmaccel.longctx.kv_cache_bytes`).
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..longctx import build_method, kv_cache_bytes
from .memory import PeakMemory

logger = logging.getLogger(__name__)

_TIMED_FIELDS = ("ttft_s", "decode_s", "tokens_per_s", "peak_memory_bytes")


@dataclass
class RunRecord:
    """One measured generation run: the record every method, eval, table, JSON file and the app is built from.

    Attributes
    ----------
    method : str
        Label of the method, e.g. the spec as written (``"snapkv:budget=256"``).
    method_name : str or None
        Registry name (``"full"``, ``"snapkv"``, ...), used to find the baseline.
    status : {"ok", "failed"}
    error : str or None
        ``"ExceptionType: message"`` of a failed run.
    output_text : str
        Decoded new tokens (special tokens skipped).
    output_ids : list of int
        The new token ids.
    prompt_tokens, new_tokens : int
        Prompt length and number of generated tokens.
    ttft_s, decode_s : float or None
        Time to first token and decode time, seconds (medians over ``repeats``).
    tokens_per_s : float or None
        Decode throughput, ``(new_tokens - 1) / decode_s``, tokens per second.
    peak_memory_bytes : int or None
        Peak memory growth during the run, bytes; how it was measured is in ``peak_memory_method``.
    peak_memory_method : str
        ``"cuda_max_memory_allocated"``, ``"rss_delta_sampled"`` or ``"unavailable"``.
    kv_cache_bytes_prefill, kv_cache_bytes_final : int or None
        Bytes of K/V held after prefill and at the end, bytes.
    telemetry : dict
        The method's own facts (``KVMethod.telemetry``), JSON-serialisable.
    repeats, warmup : int
        Measured and warm-up runs behind the medians.
    device : str
        Device of the model, e.g. ``"cpu"`` or ``"cuda:0"``.
    dtype : str
        Dtype of the model's parameters, e.g. ``"torch.float32"``.
    threads : int
        ``torch.get_num_threads()`` during the run (CPU timings depend on it).
    load_avg_1m : float or None
        The machine's 1-minute load average when the run started (``os.getloadavg``): a busy machine explains slow
        timings. ``None`` where the OS has none.
    samples : list of dict
        Per measured run: ``ttft_s``, ``decode_s``, ``tokens_per_s``, ``peak_memory_bytes``.
    extra : dict
        Free-form, e.g. ``answer``/``correct``, NIAH ``length``/``depth``/``trial``.
    """

    method: str
    method_name: str | None = None
    status: str = "ok"
    error: str | None = None
    output_text: str = ""
    output_ids: list = field(default_factory=list)
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float | None = None
    decode_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    peak_memory_method: str = "unavailable"
    kv_cache_bytes_prefill: int | None = None
    kv_cache_bytes_final: int | None = None
    telemetry: dict = field(default_factory=dict)
    repeats: int = 0
    warmup: int = 0
    device: str = ""
    dtype: str = ""
    threads: int = 0
    load_avg_1m: float | None = None
    samples: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the run succeeded."""
        return self.status == "ok"

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of every field (``extra`` kept nested)."""
        return asdict(self)


# ------------------------------------------------------------------------------------------------------- methods
def resolve_method(method) -> tuple[Any, str]:
    """Turn ``None``, a spec string or a KV-cache method object into ``(method, label)``.

    Parameters
    ----------
    method : None, str or mmaccel.longctx.KVMethod
        ``None`` means full attention; a string is a spec (``"snapkv:budget=256"``), whose text becomes the label;
        an object is used as is and labelled by its registry name.

    Raises
    ------
    ValueError
        For an unknown method name or bad arguments (from :func:`mmaccel.longctx.build_method`).
    """
    if method is None:
        return build_method("full"), "full"
    if isinstance(method, str):
        return build_method(method), method.strip()
    if not hasattr(method, "make_cache"):
        raise ValueError(f"{method!r} is not a KV-cache method (no make_cache); pass a spec such as 'snapkv:budget=256'")
    return method, getattr(method, "name", type(method).__name__)


def resolve_methods(methods: Sequence) -> list[tuple[Any, str]]:
    """:func:`resolve_method` for each entry, checked up front; duplicate labels get ``#2``, ``#3`` suffixes.

    Raises
    ------
    ValueError
        If ``methods`` is empty, or for the first unknown/badly configured method.
    """
    if isinstance(methods, str) or hasattr(methods, "make_cache"):
        methods = [methods]
    if not methods:
        raise ValueError("no methods given; pass at least one, e.g. 'full'")
    out, seen = [], {}
    for m in methods:
        obj, label = resolve_method(m)
        seen[label] = seen.get(label, 0) + 1
        out.append((obj, label if seen[label] == 1 else f"{label}#{seen[label]}"))
    return out


def as_input_ids(inputs, tokenizer=None) -> torch.Tensor:
    """Normalise a prompt to a [1, L] long tensor.

    Parameters
    ----------
    inputs : str, list of int, torch.Tensor [L] or [1, L], or an object with ``input_ids`` (e.g. NIAHSample)
        A string is tokenised with ``tokenizer`` (special tokens added, as the tokenizer does by default).

    Raises
    ------
    ValueError
        For an empty prompt, a batch of more than one row, or a string without a tokenizer.
    """
    if hasattr(inputs, "input_ids") and not isinstance(inputs, (str, torch.Tensor)):
        inputs = inputs.input_ids
    if isinstance(inputs, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        inputs = tokenizer(inputs, return_tensors="pt")["input_ids"]
    ids = torch.as_tensor(inputs, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected one prompt ([L] or [1, L] token ids), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return ids


# ------------------------------------------------------------------------------------------------------- probes
def _sync(device: torch.device) -> None:
    """Wait for queued CUDA work on ``device`` (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepProbe(LogitsProcessor):
    """Timestamps each generation step; at the first (end of prefill) records the K/V bytes the cache holds."""

    def __init__(self, cache, device: torch.device):
        self.cache, self.device = cache, device
        self.first_step_time: float | None = None
        self.kv_bytes_prefill: int | None = None
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.steps == 0:
            _sync(self.device)
            self.first_step_time = time.perf_counter()
            self.kv_bytes_prefill = kv_cache_bytes(self.cache)
        self.steps += 1
        return scores


# ------------------------------------------------------------------------------------------------------- running
def _generation_kwargs(model, tokenizer) -> dict:
    """Greedy decoding that stops at EOS; EOS/pad from the tokenizer when the model's config has none."""
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(gen_cfg, "pad_token_id", None)
    if pad is None and tokenizer is not None:
        pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    return dict(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None, eos_token_id=eos,
                pad_token_id=pad)


def _one_run(model, method, input_ids: torch.Tensor, max_new_tokens: int, gen_kwargs: dict) -> dict:
    """One timed ``generate``; returns timings, memory, K/V bytes, telemetry and the new ids."""
    device = input_ids.device
    cache = method.make_cache(model)
    probe = _StepProbe(cache, device)
    try:
        with PeakMemory(device) as mem:
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                past_key_values=cache,
                max_new_tokens=max_new_tokens,
                logits_processor=LogitsProcessorList([probe]),
                **gen_kwargs,
            )
            _sync(device)
            t_end = time.perf_counter()
        new_ids = out[0, input_ids.shape[1]:].tolist()
        first = probe.first_step_time if probe.first_step_time is not None else t_end
        decode_s = t_end - first
        n = len(new_ids)
        return {
            "new_ids": new_ids,
            "ttft_s": first - t0,
            "decode_s": decode_s,
            "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "peak_memory_bytes": mem.peak,
            "peak_memory_method": mem.method,
            "kv_cache_bytes_prefill": probe.kv_bytes_prefill,
            "kv_cache_bytes_final": kv_cache_bytes(cache),
            "telemetry": method.telemetry(cache) if hasattr(method, "telemetry") else {},
        }
    finally:
        close = getattr(cache, "close", None)
        if callable(close):
            close()  # remove any hooks a failed run left on the model


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or ``None`` where the OS does not report one."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return None


def median_or_none(values):
    """Median of the non-``None`` values (an ``int`` when they all are ints); ``None`` if there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    med = statistics.median(values)
    return int(med) if all(isinstance(v, int) for v in values) else float(med)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def generate_measured(
    model,
    tokenizer,
    input_ids,
    *,
    method=None,
    label: str | None = None,
    max_new_tokens: int = 16,
    repeats: int = 1,
    warmup: int = 1,
    warmup_ids=None,
) -> RunRecord:
    """Greedy-generate from one prompt with a KV-cache method and measure it.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Any Hugging Face causal LM; it is run under ``torch.inference_mode``.
    tokenizer : a Hugging Face tokenizer
        Decodes the output; supplies EOS/pad when the model's generation config has none.
    input_ids : str, list of int, torch.Tensor [L] or [1, L], or an object with ``input_ids``
        One prompt (batch size 1).
    method : None, str or mmaccel.longctx.KVMethod
        ``None`` = full attention, a spec (``"streaming:window=256"``) or a method object. A fresh cache is built for
        every run with ``method.make_cache(model)``.
    label : str, optional
        Label for the record; default the spec text (or the method's registry name).
    max_new_tokens : int
        Upper bound of generated tokens; generation stops early at EOS.
    repeats : int
        Measured runs; timings and peak memory are their medians.
    warmup : int
        Unrecorded runs before the measured ones.
    warmup_ids : prompt, optional
        What the warm-up runs use (same forms as ``input_ids``), e.g. a short prompt so that warming up a long-context
        run does not cost a second full prefill. Default: ``input_ids`` itself.

    Returns
    -------
    RunRecord
        ``status="ok"``, or ``status="failed"`` with ``error`` when a run raised (e.g. ``torch.OutOfMemoryError``, an
        input longer than the model handles): failures of a run are recorded, not raised, so sweeps go on.

    Raises
    ------
    ValueError
        Configuration errors, before any run: an unknown method or bad method arguments, an empty or batched
        prompt, ``max_new_tokens < 1``, ``repeats < 1`` or ``warmup < 0``.
    """
    if max_new_tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need max_new_tokens >= 1, repeats >= 1 and warmup >= 0; got {max_new_tokens}, {repeats}, {warmup}"
        )
    method_obj, default_label = resolve_method(method)
    device = getattr(model, "device", torch.device("cpu"))
    ids = as_input_ids(input_ids, tokenizer).to(device)
    warm_ids = ids if warmup_ids is None else as_input_ids(warmup_ids, tokenizer).to(device)
    record = RunRecord(
        method=label or default_label,
        method_name=getattr(method_obj, "name", None),
        prompt_tokens=int(ids.shape[1]),
        repeats=repeats,
        warmup=warmup,
        device=str(device),
        dtype=str(next(model.parameters()).dtype) if hasattr(model, "parameters") else "",
        threads=torch.get_num_threads(),
    )
    gen_kwargs = _generation_kwargs(model, tokenizer)
    runs = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            if i == warmup:
                record.load_avg_1m = load_average()
            try:
                run = _one_run(model, method_obj, warm_ids if i < warmup else ids, max_new_tokens, gen_kwargs)
            except Exception as exc:  # noqa: BLE001 - a failed run is data; the sweep goes on
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                phase = "warm-up" if i < warmup else "measured"
                logger.warning("%s: %s run failed: %s", record.method, phase, _error_text(exc))
                record.status, record.error = "failed", _error_text(exc)
                return record
            if i >= warmup:
                runs.append(run)
    last = runs[-1]
    if any(r["new_ids"] != last["new_ids"] for r in runs):
        logger.warning("%s: greedy outputs differ between repeats; reporting the last one", record.method)
    record.output_ids = last["new_ids"]
    record.new_tokens = len(last["new_ids"])
    record.output_text = tokenizer.decode(last["new_ids"], skip_special_tokens=True) if tokenizer is not None else ""
    record.samples = [{k: r[k] for k in _TIMED_FIELDS} for r in runs]
    for k in _TIMED_FIELDS:
        setattr(record, k, median_or_none([r[k] for r in runs]))
    record.peak_memory_method = last["peak_memory_method"]
    record.kv_cache_bytes_prefill = last["kv_cache_bytes_prefill"]
    record.kv_cache_bytes_final = last["kv_cache_bytes_final"]
    record.telemetry = _jsonable(last["telemetry"])
    return record


def _jsonable(obj):
    """Telemetry made JSON-safe: tensors to lists, unknown objects to ``repr``."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)
