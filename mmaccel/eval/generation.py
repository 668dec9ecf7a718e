"""Measured generation: the one generation path every CLI command, eval and the app uses.

:func:`generate_measured` resolves the method to an object that runs one timed generation and returns one
:class:`RunRecord` with the same fields for every method (the harness contract of Spec-Bench, Xia et al., 2024,
arXiv 2401.07851): the output, timings in seconds, memory in bytes, and the method's telemetry. Three kinds of
method share that path:

- KV-cache methods (:data:`mmaccel.longctx.METHODS`, e.g. ``"snapkv:budget=256"``): ``model.generate`` with the
  method's fresh cache (timed by the probe below);
- speculative drafters (:data:`mmaccel.speculative.METHODS`, e.g. ``"draft:model=micro-draft"``,
  ``"prompt_lookup:max_ngram=3"``): :func:`mmaccel.speculative.speculative_generate`; ``ttft_s`` is its
  ``first_token_seconds`` and ``decode_s`` is ``total_seconds - first_token_seconds``;
- transformers' own speculative paths (:data:`mmaccel.speculative.PEERS`: ``"hf_assisted:model=micro-draft"``,
  ``"hf_prompt_lookup:num_tokens=10"``, ``"hf_early_exit:layers=15"``): ``model.generate(**kwargs)``, timed by
  forward hooks (:mod:`mmaccel.speculative.harness`).

Speculative records' telemetry holds the mean accepted length, the acceptance rate, draft/verify seconds and target
forward counts.

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

from ..longctx import METHODS as KV_METHODS
from ..longctx import build_method, kv_cache_bytes
from ..specs import parse_method_spec
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
        The method's own facts, JSON-serialisable: ``KVMethod.telemetry`` for KV-cache methods; for speculative
        methods and transformers peers the acceptance (``mean_accepted_length``, ``acceptance_rate``), forward counts
        (``target_forwards``, ``draft_forwards``) and the draft/verify time split in seconds (see
        :mod:`mmaccel.speculative.harness`).
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
def resolve_method(method, *, draft=None) -> tuple[Any, str]:
    """Turn ``None``, a spec string or a method object into ``(method, label)``.

    Parameters
    ----------
    method : None, str, mmaccel.longctx.KVMethod, mmaccel.speculative.Drafter or a speculative method object
        ``None`` means full attention; a string is a spec whose text becomes the label: a KV-cache method
        (``"snapkv:budget=256"``), an engine drafter (``"draft:model=micro-draft:k=4"``, ``"prompt_lookup"``) or a
        transformers peer (``"hf_prompt_lookup:num_tokens=10"``); an object is used as is (a bare ``Drafter`` is
        wrapped with its default draft length) and labelled by its registry name.
    draft : str or transformers.PreTrainedModel, optional
        The draft model of ``draft`` / ``hf_assisted`` specs that name no ``model=``.

    Raises
    ------
    ValueError
        For an unknown method name or bad arguments (the message lists KV-cache methods, drafters and peers).
    """
    from ..speculative import Drafter, build_speculative_method, speculative_method_names
    from ..speculative.harness import SpeculativeMethod

    if method is None:
        return build_method("full"), "full"
    if isinstance(method, str):
        name = parse_method_spec(method).name
        if name in KV_METHODS:
            return build_method(method), method.strip()
        if name in speculative_method_names():
            return build_speculative_method(method, draft=draft), method.strip()
        raise ValueError(
            f"unknown KV-cache method {name!r} (nor a speculative method); KV-cache methods: "
            f"{', '.join(sorted(KV_METHODS))}; speculative: {', '.join(speculative_method_names())} "
            "(syntax: name:key=value, e.g. snapkv:budget=256 or draft:model=micro-draft)"
        )
    if isinstance(method, Drafter):
        method = SpeculativeMethod(method)
    if not (hasattr(method, "make_cache") or hasattr(method, "timed_generate")):
        raise ValueError(f"{method!r} is not a KV-cache or speculative method (no make_cache / timed_generate); pass "
                         "a spec such as 'snapkv:budget=256' or 'draft:model=micro-draft'")
    return method, getattr(method, "name", type(method).__name__)


def resolve_methods(methods: Sequence, *, draft=None) -> list[tuple[Any, str]]:
    """:func:`resolve_method` for each entry, checked up front; duplicate labels get ``#2``, ``#3`` suffixes.

    ``draft`` is passed on to :func:`resolve_method`.

    Raises
    ------
    ValueError
        If ``methods`` is empty, or for the first unknown/badly configured method.
    """
    if isinstance(methods, str) or hasattr(methods, "make_cache") or hasattr(methods, "timed_generate"):
        methods = [methods]
    if not methods:
        raise ValueError("no methods given; pass at least one, e.g. 'full'")
    out, seen = [], {}
    for m in methods:
        obj, label = resolve_method(m, draft=draft)
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
def _generation_kwargs(model, tokenizer, temperature: float = 0.0) -> dict:
    """Greedy decoding (``temperature == 0``) or plain sampling at ``temperature`` that stops at EOS; EOS/pad from
    the tokenizer when the model's config has none."""
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


class _KVCacheRun:
    """How a KV-cache method runs one timed generation: ``model.generate`` with the method's fresh cache."""

    def __init__(self, method):
        self.method = method

    def timed_generate(self, model, input_ids: torch.Tensor, *, max_new_tokens: int, gen_kwargs: dict) -> dict:
        """One ``generate``; returns the new ids, TTFT/decode seconds, K/V bytes after prefill and at the end, and
        the method's telemetry."""
        method, device = self.method, input_ids.device
        cache = method.make_cache(model)
        probe = _StepProbe(cache, device)
        try:
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
            close = getattr(cache, "close", None)
            if callable(close):
                close()  # remove any hooks a failed run left on the model


def runner_for(method):
    """The object that runs one timed generation of ``method``: itself when it has ``timed_generate``
    (speculative drafters and transformers peers, :mod:`mmaccel.speculative.harness`), else a KV-cache run."""
    return method if hasattr(method, "timed_generate") else _KVCacheRun(method)


def _one_run(model, method, input_ids: torch.Tensor, max_new_tokens: int, gen_kwargs: dict) -> dict:
    """One timed generation of any method; returns timings, memory, K/V bytes, telemetry and the new ids."""
    device = input_ids.device
    with PeakMemory(device) as mem:
        run = runner_for(method).timed_generate(model, input_ids, max_new_tokens=max_new_tokens,
                                                gen_kwargs=gen_kwargs)
    n, decode_s = len(run["new_ids"]), run["decode_s"]
    run["tokens_per_s"] = (n - 1) / decode_s if n > 1 and decode_s and decode_s > 0 else None
    run["peak_memory_bytes"] = mem.peak
    run["peak_memory_method"] = mem.method
    return run


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
    temperature: float = 0.0,
    draft=None,
) -> RunRecord:
    """Generate from one prompt with a KV-cache, speculative or transformers-peer method and measure it.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Any Hugging Face causal LM; it is run under ``torch.inference_mode``.
    tokenizer : a Hugging Face tokenizer
        Decodes the output; supplies EOS/pad when the model's generation config has none.
    input_ids : str, list of int, torch.Tensor [L] or [1, L], or an object with ``input_ids``
        One prompt (batch size 1).
    method : None, str or a method object
        ``None`` = full attention; a spec: a KV-cache method (``"streaming:window=256"``; a fresh cache is built for
        every run with ``method.make_cache(model)``), an engine drafter (``"draft:model=micro-draft:k=4"``,
        ``"prompt_lookup"``, ``"jacobi"``) or a transformers peer (``"hf_assisted:model=micro-draft"``,
        ``"hf_prompt_lookup:num_tokens=10"``, ``"hf_early_exit:layers=15"``); or an object of one of those kinds
        (see :func:`resolve_method`).
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
    temperature : float
        ``0`` (default) = greedy; ``> 0`` = sampling at that temperature (the engine's lossless speculative
        sampling for drafters; ``generate(do_sample=True)`` otherwise).
    draft : str or transformers.PreTrainedModel, optional
        Draft model for ``draft`` / ``hf_assisted`` specs that name no ``model=``.

    Returns
    -------
    RunRecord
        ``status="ok"``, or ``status="failed"`` with ``error`` when a run raised (e.g. ``torch.OutOfMemoryError``, an
        input longer than the model handles): failures of a run are recorded, not raised, so sweeps go on.

    Raises
    ------
    ValueError
        Configuration errors, before any run: an unknown method or bad method arguments (e.g. a draft length
        ``k <= 0``), a draft model with another vocabulary or tokenizer, an empty or batched prompt,
        ``max_new_tokens < 1``, ``repeats < 1``, ``warmup < 0`` or ``temperature < 0``.
    """
    if max_new_tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need max_new_tokens >= 1, repeats >= 1 and warmup >= 0; got {max_new_tokens}, {repeats}, {warmup}"
        )
    if temperature is None or not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    method_obj, default_label = resolve_method(method, draft=draft)
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
    prepare = getattr(method_obj, "prepare", None)
    if callable(prepare) and hasattr(method_obj, "timed_generate"):  # speculative methods: load a draft once, check it against the target (ValueError)
        prepare(model, tokenizer)
    gen_kwargs = _generation_kwargs(model, tokenizer, temperature)
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
