"""Measured generation: the one measured path every CLI command, eval and the app uses.

:func:`generate_measured` has the composition layer (:func:`mmaccel.pipeline.compose_run`) resolve the method once
into a :class:`~mmaccel.pipeline.Composition`, times what it runs, and returns one
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

Composition
-----------
The same path runs the composed pipeline (:class:`mmaccel.Pipeline`): ``vision=`` (a visual-token method,
:data:`mmaccel.vision_tokens.METHODS`) is applied around every run with ``with vision.apply(model):``, and ``kv=``
stacks a KV-cache method under an engine drafter: its ``make_cache(model)`` is the cache the speculative engine
decodes into. Vision-language inputs (a processor's output: ``input_ids`` plus ``pixel_values``, ``image_sizes`` /
``image_grid_thw``, ...) go to ``generate`` as they are, and to the engine's prefill forward only.
:func:`mmaccel.pipeline.check_composition` refuses, up front, the pairs that cannot be exact together. All of that
is :mod:`mmaccel.pipeline`'s; this module adds the timers, the memory meter, the repeats and the record.
:func:`measure_pipeline` measures a :class:`mmaccel.Pipeline`.

Timing
------
A :class:`~transformers.LogitsProcessor` probe is called by ``generate`` once per new token, right after the forward
that produced its logits. Its first call therefore marks the end of prefill:

- ``ttft_s``: from the start of ``generate`` to the first probe call (prefill + the first logits), seconds.
- ``decode_s``: from the first probe call to the return of ``generate``, i.e. the ``new_tokens - 1`` decode
  forwards, seconds.
- ``tokens_per_s``: ``(new_tokens - 1) / decode_s`` (decode throughput; the first token is counted in TTFT);
  ``None`` when fewer than two tokens were generated.
- ``vision_encoder_s``: seconds inside the vision tower's forwards during the run (forward hooks on the tower of a
  vision-language model, removed on exit); ``None`` when the model has no tower or it did not run.
- ``prefill_s``: ``ttft_s - vision_encoder_s`` (``ttft_s`` without a tower): everything before the first token that
  is not the vision encoder -- projector, language-model prefill, the first logits.

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

import contextlib
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..kernels._common import synchronize
from ..models.parts import vision_tower
from ..pipeline import (
    Composition,
    check_temperature,
    check_vision_inputs,
    compose_run,
    generation_kwargs,
    model_inputs_for,
)
from .memory import PeakMemory, check_cpu_meter

logger = logging.getLogger(__name__)

_TIMED_FIELDS = ("ttft_s", "decode_s", "tokens_per_s", "peak_memory_bytes", "vision_encoder_s", "prefill_s")


_TIMED_FIELDS = ("ttft_s", "decode_s", "tokens_per_s", "peak_memory_bytes", "vision_encoder_s", "prefill_s")


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
    vision_encoder_s, prefill_s : float or None
        Seconds in the vision tower, and ``ttft_s`` minus them (medians; see the module docstring). ``vision_encoder_s``
        is ``None`` without a vision tower run.
    visual_tokens, visual_tokens_kept : int or None
        Visual tokens of the prompt before and after the visual-token method (summed over images; ``None`` without
        a vision method). The method's own facts are in ``telemetry["vision"]``.
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
        :mod:`mmaccel.speculative.harness`). A composed run adds ``telemetry["vision"]`` (the visual-token method's
        ``telemetry``) and, for a KV method under a speculative method, ``telemetry["kv"]`` (``KVMethod.telemetry``).
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
        Per measured run: ``ttft_s``, ``decode_s``, ``tokens_per_s``, ``peak_memory_bytes``, ``vision_encoder_s``,
        ``prefill_s``.
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
    vision_encoder_s: float | None = None
    prefill_s: float | None = None
    visual_tokens: int | None = None
    visual_tokens_kept: int | None = None
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


class _VisionTimer:
    """Seconds spent in the forwards of a model's vision tower, by per-instance forward hooks removed on exit.

    ``seconds`` is ``None`` when the model has no tower (:func:`mmaccel.models.parts.vision_tower`) or the tower did
    not run.
    """

    def __init__(self, model, device: torch.device):
        self.tower = vision_tower(model)
        self.device = device
        self.seconds: float | None = None
        self._starts: list[float] = []
        self._handles: list = []

    def _pre(self, module, args):
        synchronize(self.device)
        self._starts.append(time.perf_counter())

    def _post(self, module, args, output):
        synchronize(self.device)
        if self._starts:
            self.seconds = (self.seconds or 0.0) + time.perf_counter() - self._starts.pop()

    def __enter__(self):
        if self.tower is not None:
            self._handles = [self.tower.register_forward_pre_hook(self._pre),
                             self.tower.register_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _one_run(model, composed: Composition, input_ids: torch.Tensor, max_new_tokens: int, gen_kwargs: dict, *,
             model_inputs: dict | None = None, memory_meter: str = "rss") -> dict:
    """One timed generation of ``composed`` (:meth:`~mmaccel.pipeline.Composition.run` inside its visual-token
    method's hooks), with the vision-tower timer and the memory meter around it; returns the run's dict plus
    ``tokens_per_s``, ``peak_memory_bytes`` / ``peak_memory_method``, ``vision_encoder_s`` and ``prefill_s``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(composed.applied(model))
        timer = stack.enter_context(_VisionTimer(model, input_ids.device))
        with PeakMemory(input_ids.device, cpu_meter=memory_meter) as mem:
            run = composed.run(model, input_ids, max_new_tokens=max_new_tokens, gen_kwargs=gen_kwargs,
                               model_inputs=model_inputs)
    n, decode_s = len(run["new_ids"]), run["decode_s"]
    run["tokens_per_s"] = (n - 1) / decode_s if n > 1 and decode_s and decode_s > 0 else None
    run["peak_memory_bytes"] = mem.peak
    run["peak_memory_method"] = mem.method
    run["vision_encoder_s"] = timer.seconds
    run["prefill_s"] = None if run["ttft_s"] is None else run["ttft_s"] - (timer.seconds or 0.0)
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
    vision=None,
    kv=None,
    raise_errors: bool = False,
    memory_meter: str = "rss",
) -> RunRecord:
    """Generate from one prompt with a KV-cache, speculative or transformers-peer method -- optionally composed with
    a visual-token method and a KV method under the speculative one -- and measure it.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Any Hugging Face causal LM or vision-language model (LLaVA, Qwen2-VL); it is run under
        ``torch.inference_mode``.
    tokenizer : a Hugging Face tokenizer
        Decodes the output; supplies EOS/pad when the model's generation config has none.
    input_ids : str, list of int, torch.Tensor [L] or [1, L], an object with ``input_ids``, or a mapping
        One prompt (batch size 1). A mapping is a processor's output: ``input_ids`` [1, L] plus a VLM's
        ``pixel_values``, ``image_sizes`` / ``image_grid_thw``, ``mm_token_type_ids``, ... (see
        :func:`mmaccel.pipeline.split_inputs`); floating-point tensors are cast to the model's dtype.
    method : None, str or a method object
        ``None`` = full attention; a spec: a KV-cache method (``"streaming:window=256"``; a fresh cache is built for
        every run with ``method.make_cache(model)``), an engine drafter (``"draft:model=micro-draft:k=4"``,
        ``"prompt_lookup"``, ``"jacobi"``) or a transformers peer (``"hf_assisted:model=micro-draft"``,
        ``"hf_prompt_lookup:num_tokens=10"``, ``"hf_early_exit:layers=15"``); or an object of one of those kinds
        (see :func:`mmaccel.pipeline.resolve_method`), or a :class:`~mmaccel.pipeline.Composition`
        (then ``kv`` and ``vision`` are ``None``).
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
    vision : None, str or VisionTokenMethod
        A visual-token method (``"pooling:keep_ratio=0.25"``, :data:`mmaccel.vision_tokens.METHODS`), applied around
        every run with ``with vision.apply(model):``; its ``telemetry`` goes to ``record.telemetry["vision"]`` and
        the token counts to ``visual_tokens`` / ``visual_tokens_kept``. Needs image or video inputs.
    kv : None, str or KVMethod
        A KV-cache method. With a speculative ``method`` its fresh ``make_cache(model)`` is the engine's cache every
        run (``record.telemetry["kv"]``); with ``method=None`` it is the method itself.
    raise_errors : bool
        Re-raise the exception of a failed run instead of returning a ``"failed"`` record.
    memory_meter : {"rss", "allocator"}
        How ``peak_memory_bytes`` is measured off CUDA (:class:`~mmaccel.eval.memory.PeakMemory`'s ``cpu_meter``):
        the sampled process RSS (default), or torch's CPU allocations under the profiler, exact tensor bytes that
        compare across processes, but with the profiler's per-op cost inside the timings (use it for memory, not
        speed).

    Returns
    -------
    RunRecord
        ``status="ok"``, or ``status="failed"`` with ``error`` when a run raised (e.g. ``torch.OutOfMemoryError``, an
        input longer than the model handles): failures of a run are recorded, not raised, so sweeps go on.
        Timings include ``vision_encoder_s`` and ``prefill_s`` (see the module docstring).

    Raises
    ------
    ValueError
        Configuration errors, before any run: an unknown method or bad method arguments (e.g. a draft length
        ``k <= 0``), a draft model with another vocabulary or tokenizer, an empty or batched prompt,
        ``max_new_tokens < 1``, ``repeats < 1``, ``warmup < 0``, ``temperature < 0`` or an unknown
        ``memory_meter``; a composition that cannot be exact (:func:`mmaccel.pipeline.check_composition`), or ``vision`` without
        image/video inputs.
    UnsupportedModelError
        (a ``ValueError``) ``vision`` on a model the method does not support.
    """
    if max_new_tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need max_new_tokens >= 1, repeats >= 1 and warmup >= 0; got {max_new_tokens}, {repeats}, {warmup}"
        )
    check_temperature(temperature)
    check_cpu_meter(memory_meter, "memory_meter")
    composed = compose_run(method, kv=kv, vision=vision, draft=draft)
    composed.check(model)
    device = getattr(model, "device", torch.device("cpu"))
    ids, model_inputs = model_inputs_for(model, input_ids, tokenizer)
    check_vision_inputs(composed.vision_label, model_inputs)
    if warmup_ids is None:
        warm_ids, warm_inputs = ids, model_inputs
    else:
        warm_ids, warm_inputs = model_inputs_for(model, warmup_ids, tokenizer)
    record = RunRecord(
        method=label or composed.short_label,
        method_name=composed.method_name,
        prompt_tokens=int(ids.shape[1]),
        repeats=repeats,
        warmup=warmup,
        device=str(device),
        dtype=str(next(model.parameters()).dtype) if hasattr(model, "parameters") else "",
        threads=torch.get_num_threads(),
    )
    composed.prepare(model, tokenizer)  # speculative methods: load a draft once, check it against the target
    gen_kwargs = generation_kwargs(model, tokenizer, temperature)
    runs = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            if i == warmup:
                record.load_avg_1m = load_average()
            try:
                warm = i < warmup
                run = _one_run(model, composed, warm_ids if warm else ids, max_new_tokens, gen_kwargs,
                               model_inputs=warm_inputs if warm else model_inputs, memory_meter=memory_meter)
            except Exception as exc:
                if raise_errors:
                    raise
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
    record.visual_tokens = last.get("visual_tokens")
    record.visual_tokens_kept = last.get("visual_tokens_kept")
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


def measure_pipeline(pipeline, inputs, max_new_tokens: int = 32, *, images=None, videos=None,
                     temperature: float = 0.0, repeats: int = 1, warmup: int = 0, label: str | None = None,
                     raise_errors: bool = True) -> RunRecord:
    """A measured generation of a :class:`mmaccel.Pipeline`: :func:`generate_measured` of its composition.

    Parameters
    ----------
    pipeline : mmaccel.Pipeline
    inputs : str, token ids [L] or [1, L], or a mapping
        As :meth:`mmaccel.Pipeline.generate` (text with ``images``/``videos`` goes through the pipeline's processor).
    max_new_tokens : int
        Upper bound of new tokens, >= 1.
    images, videos : optional
        Media for a text prompt.
    temperature : float
        ``0`` = greedy; ``> 0`` = sampling.
    repeats, warmup : int
        Measured and unrecorded runs; timings are medians.
    label : str, optional
        The record's ``method``; default the pipeline's ``label`` (``"vision=... + kv=... + speculative=..."``).
    raise_errors : bool
        Re-raise a failed run's exception (default) instead of returning a ``"failed"`` record.

    Returns
    -------
    RunRecord
        ``output_ids`` / ``output_text``; ``ttft_s``, ``vision_encoder_s``, ``prefill_s``, ``decode_s`` (seconds),
        ``visual_tokens`` / ``visual_tokens_kept``, ``kv_cache_bytes_prefill`` / ``kv_cache_bytes_final`` (bytes) and
        ``telemetry`` (``telemetry["vision"]`` and ``telemetry["kv"]`` for the other pieces).

    Raises
    ------
    ValueError
        As :func:`generate_measured` (bad inputs or settings, before any run).
    """
    return generate_measured(
        pipeline.model, pipeline.tokenizer, pipeline.inputs(inputs, images, videos), method=pipeline.composed,
        label=label or pipeline.label, max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup,
        temperature=temperature, raise_errors=raise_errors,
    )
