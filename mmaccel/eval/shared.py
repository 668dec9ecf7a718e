"""Measured generation of a group of KV-cache methods that share one full-attention prefill.

:func:`generate_shared` is :func:`mmaccel.eval.generation.generate_measured` for every method whose prefill is full
attention (:func:`mmaccel.longctx.shared_prefill.shares_prefill`): per run it prefills the prompt once
(:class:`~mmaccel.longctx.shared_prefill.SharedPrefill`, each method scoring and keeping its own copy of every
layer's K/V), then decodes each method's cache on its own with ``model.generate``. It returns one
:class:`~mmaccel.eval.generation.RunRecord` per method, with the output a separate run would give (greedy: token
identical, tested) and timings that say what they are.

Timing
------
On CUDA every timestamp is taken after ``torch.cuda.synchronize``.

- ``extra["shared_prefill_s"]``: the one prefill forward (``generate(..., max_new_tokens=1)`` with the fan-out cache,
  the first token's logits and choice included) minus every member's own work in it; the same for all records of a
  run, seconds.
- ``extra["compress_s"]``: this method's own work during the prefill (copying each layer's K/V into its cache,
  scoring, keeping), summed over layers, seconds.
- ``ttft_s`` = ``shared_prefill_s + compress_s``: the time to first token this method would have had with the
  prefill to itself; ``prefill_s`` equals it (text only, no vision tower).
- ``decode_s``: this method's own decode, ``generate`` from the prompt plus the first token over its prefilled cache
  (``new_tokens - 1`` forwards); ``tokens_per_s = (new_tokens - 1) / decode_s``.
- ``extra["shared_group_s"]``: the whole prefill forward with every member's work, and the members' work after it
  (KVzip's reconstruction): what the group paid once.

Every timing is the median over ``repeats`` runs after ``warmup`` unrecorded ones; per-run values are in
``samples``. ``kv_cache_bytes_prefill`` / ``kv_cache_bytes_final`` are :func:`mmaccel.longctx.kv_cache_bytes` of the
method's cache after the prefill and at the end, as ``generate_measured`` reports them.

Memory
------
Memory is measured in a run of its own: the meter's sampling thread and heap trim slow a CPU decode (measured:
full's decode from 30% to 22% of the roofline, StreamingLLM's ratio to full from 1.38 to 1.61), so with
``repeats >= 2`` the last repeat runs under the meter and its timings are not used (the others are timed unmetered);
with one repeat nothing is metered and the peaks are ``None``. The prefill forward belongs to the group, so a
metered run gives each record two peaks, bytes:

- ``extra["shared_prefill_peak_bytes"]``: the peak memory growth over the one shared prefill forward (the model's
  activations plus every member's copy, scoring and kept K/V), measured by :class:`~mmaccel.eval.memory.PeakMemory`
  (``extra["shared_prefill_peak_method"]`` says how); the same for all records of a run. A method run alone peaks
  at most at this during its prefill.
- ``peak_memory_bytes``: the peak of the method's *own* phase: the K/V its compression kept (exact tensor bytes,
  ``kv_cache_bytes_prefill``) plus the peak memory growth measured over its own decode (``extra["decode_peak_bytes"]``,
  :class:`~mmaccel.eval.memory.PeakMemory`: exact on CUDA, the sampled RSS on the CPU). ``peak_memory_method`` is
  ``"kv_kept+<meter>"`` (e.g. ``"kv_kept+rss_delta_sampled"``): comparable between members of shared runs, not with
  a run that measured its own prefill (``generate_measured``). The transient of the compression itself (a layer's
  scores, freed within that layer) is inside the shared prefill's peak, not in this one.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from ..kernels._common import synchronize
from ..kernels.hf import cache_kwarg
from ..longctx import build_method, kv_cache_bytes
from ..longctx.base import close_cache
from ..longctx.shared_prefill import SharedPrefill, shares_prefill
from ..pipeline import check_temperature, generation_kwargs, model_inputs_for
from .generation import RunRecord, _jsonable, load_average, median_or_none
from .memory import PeakMemory

logger = logging.getLogger(__name__)

_TIMED = ("ttft_s", "decode_s", "tokens_per_s", "prefill_s", "shared_prefill_s", "compress_s", "shared_group_s",
          "peak_memory_bytes", "decode_peak_bytes", "shared_prefill_peak_bytes")


def _resolve(methods) -> list[tuple[object, str]]:
    """``[(KVMethod, label)]`` from the ``methods`` argument; ``ValueError`` naming the fix for anything else."""
    if not isinstance(methods, (list, tuple)) or not methods:
        raise ValueError("methods must be a non-empty list of (method, label) pairs, e.g. [(SnapKV(budget=256), "
                         "'snapkv:budget=256')]")
    resolved = []
    for item in methods:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"each entry of methods is a (method, label) pair, got {item!r}")
        method, label = item
        method = build_method(method) if isinstance(method, str) else method
        if not shares_prefill(method):
            name = getattr(method, "name", type(method).__name__)
            raise ValueError(f"{label or name}: {name} does not share a full-attention prefill (it changes the prefill "
                             "itself, or is not a KV-cache method); measure it alone with generate_measured(..., "
                             "method=...)")
        resolved.append((method, str(label) if label else method.spec))
    return resolved


def _eos_ids(gen_kwargs: dict) -> set[int]:
    eos = gen_kwargs.get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _one_shared_run(model, members, ids: torch.Tensor, max_new_tokens: int, gen_kwargs: dict,
                    meter: bool = False) -> list[dict]:
    """One shared prefill of ``ids`` [1, L] and each member's decode; a dict per member (``error`` set if its decode
    raised). With ``meter`` the prefill and every decode run under :class:`PeakMemory` (whose sampling thread and
    heap trim slow a CPU decode: such a run's timings are not used). Raises what the shared prefill raises."""
    device = ids.device
    shared = SharedPrefill([m for m, _ in members])
    mask = torch.ones_like(ids)
    leader = shared.make_cache(model)
    try:
        with PeakMemory(device) if meter else contextlib.nullcontext() as group_mem:
            synchronize(device)
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **cache_kwarg(model, leader, generate=True),
                                 max_new_tokens=1, **gen_kwargs)
            synchronize(device)
            group_s = time.perf_counter() - t0
    finally:
        leader.close()
    shared_s = max(0.0, group_s - sum(shared.compress_s))
    with torch.no_grad(), PeakMemory(device) if meter else contextlib.nullcontext() as finish_mem:
        t0 = time.perf_counter()
        shared.finish(model, ids)  # after the forward (KVzip's reconstruction): added to that member's compress_s
        synchronize(device)
        group_s += time.perf_counter() - t0  # the group paid it too
    group_peak = max((p for p in (group_mem.peak, finish_mem.peak) if p is not None), default=None) if meter else None
    first = out[:, ids.shape[1]:]
    stop = max_new_tokens == 1 or int(first[0, 0]) in _eos_ids(gen_kwargs)
    continued = torch.cat([ids, first], dim=1)
    runs = []
    for i, (method, _) in enumerate(members):
        run = {"shared_prefill_s": shared_s, "compress_s": shared.compress_s[i], "shared_group_s": group_s,
               "shared_prefill_peak_bytes": group_peak,
               "shared_prefill_peak_method": group_mem.method if meter else "unavailable", "metered": meter,
               "error": None}
        run["ttft_s"] = run["prefill_s"] = shared_s + shared.compress_s[i]
        cache = None
        try:
            cache = shared.decode_cache(i, model)
            run["kv_cache_bytes_prefill"] = kv_cache_bytes(cache)
            new_ids = first[0].tolist()
            decode_s, decode_peak = 0.0, 0  # no decode (one token, or EOS first): no growth
            with PeakMemory(device) if meter else contextlib.nullcontext() as mem:
                if not stop:
                    synchronize(device)
                    t0 = time.perf_counter()
                    more = model.generate(continued, attention_mask=torch.ones_like(continued),
                                          **cache_kwarg(model, cache, generate=True),
                                          max_new_tokens=max_new_tokens - 1, **gen_kwargs)
                    synchronize(device)
                    decode_s = time.perf_counter() - t0
                    new_ids = more[0, ids.shape[1]:].tolist()
            if not meter:
                decode_peak = None
            elif not stop:
                decode_peak = mem.peak
            n = len(new_ids)
            run.update(decode_peak_bytes=decode_peak,
                       peak_memory_method=f"kv_kept+{mem.method}" if meter else "unavailable",
                       peak_memory_bytes=None if decode_peak is None else run["kv_cache_bytes_prefill"] + decode_peak)
            run.update(new_ids=new_ids, decode_s=decode_s,
                       tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                       kv_cache_bytes_final=kv_cache_bytes(cache),
                       telemetry=method.telemetry(cache) if hasattr(method, "telemetry") else {})
        except Exception as exc:  # noqa: BLE001 - a failed decode is its own record's, the others go on
            run["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            close_cache(cache)
        runs.append(run)
    return runs


def generate_shared(
    model,
    tokenizer,
    input_ids,
    *,
    methods: list,
    max_new_tokens: int = 16,
    repeats: int = 1,
    warmup: int = 1,
    warmup_ids=None,
    temperature: float = 0.0,
    raise_errors: bool = False,
) -> list[RunRecord]:
    """Generate from one prompt with every method of a group that shares one full-attention prefill, and measure it.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A Hugging Face causal LM whose decoder layers are all full attention; run under ``torch.inference_mode``.
    tokenizer : a Hugging Face tokenizer or None
        Decodes the outputs; supplies EOS/pad when the model's generation config has none.
    input_ids : str, list of int, torch.Tensor [L] or [1, L], or an object with ``input_ids``
        One text prompt (batch size 1), as :func:`~mmaccel.eval.generation.generate_measured` takes it.
    methods : list of (method, label)
        The group: KV-cache methods (objects or spec strings) with ``shares_prefill(method)`` True, and the label of
        each record (``None`` = the method's spec).
    max_new_tokens : int
        Upper bound of generated tokens per method, >= 1; each method stops early at EOS.
    repeats : int
        Measured runs, >= 1; timings are their medians.
    warmup : int
        Unrecorded runs before the measured ones, >= 0.
    warmup_ids : prompt, optional
        What the warm-up runs use (e.g. a short prompt). Default: ``input_ids``.
    temperature : float
        ``0`` = greedy (token-identical to separate runs); ``> 0`` = sampling (every method continues from the one
        sampled first token).
    raise_errors : bool
        Re-raise a failed run's exception instead of returning ``"failed"`` records.

    Returns
    -------
    list of RunRecord
        One per method, in the order of ``methods``: ``output_ids`` / ``output_text``, ``ttft_s``, ``prefill_s``,
        ``decode_s``, ``tokens_per_s`` (seconds, tokens per second; see the module docstring),
        ``kv_cache_bytes_prefill`` / ``kv_cache_bytes_final`` (bytes), ``peak_memory_bytes`` (the method's own
        phase: kept K/V plus its decode's measured growth, bytes; see the module docstring), the method's
        ``telemetry``, and in ``extra`` ``shared_prefill_s``, ``compress_s``, ``shared_group_s`` (seconds),
        ``shared_prefill_peak_bytes`` and ``decode_peak_bytes`` (bytes), ``shared_prefill=True`` and ``shared_with``
        (the group's labels). A failed shared prefill fails every record; a failed decode only its
        own; a method whose own cache cannot be made for the model (its ``make_cache`` raises: a refusal,
        out of memory) gets a ``"failed"`` record with that error before the prefill, and the prefill serves the
        others.

    Raises
    ------
    ValueError
        Before anything runs: ``methods`` empty or malformed, a method whose prefill is not full attention (use
        ``generate_measured`` for it), a bad spec, ``max_new_tokens < 1``, ``repeats < 1``, ``warmup < 0``,
        ``temperature < 0``, an empty or batched prompt, vision inputs (text only), or a model with a layer that is
        neither full attention nor a sliding window (:meth:`~mmaccel.longctx.shared_prefill.SharedPrefill.make_cache`);
        with ``raise_errors``, also a method's own refusal of the model.
    """
    if max_new_tokens < 1 or repeats < 1 or warmup < 0:
        raise ValueError(
            f"need max_new_tokens >= 1, repeats >= 1 and warmup >= 0; got {max_new_tokens}, {repeats}, {warmup}")
    check_temperature(temperature)
    members = _resolve(methods)
    ids, extra_inputs = model_inputs_for(model, input_ids, tokenizer)
    warm_ids = ids if warmup_ids is None else model_inputs_for(model, warmup_ids, tokenizer)[0]
    if extra_inputs:
        raise ValueError(f"generate_shared takes text prompts only, got {sorted(extra_inputs)}; measure vision-language "
                         "inputs with generate_measured")
    SharedPrefill([m for m, _ in members]).make_cache(model).close()  # a model it cannot serve raises here, up front
    refused = _refusals(model, members, raise_errors)
    device = getattr(model, "device", torch.device("cpu"))
    labels = [label for _, label in members]
    all_records = [RunRecord(method=label, method_name=m.name, prompt_tokens=int(ids.shape[1]), repeats=repeats,
                             warmup=warmup, device=str(device), dtype=str(next(model.parameters()).dtype),
                             threads=torch.get_num_threads(), extra={"shared_prefill": True, "shared_with": labels})
                   for m, label in members]
    for i, error in refused.items():
        all_records[i].status, all_records[i].error = "failed", error
    members = [m for i, m in enumerate(members) if i not in refused]
    records = [r for i, r in enumerate(all_records) if i not in refused]
    if not members:
        return all_records
    gen_kwargs = generation_kwargs(model, tokenizer, temperature)
    measured: list[list[dict]] = [[] for _ in members]
    with torch.inference_mode():
        for r in range(warmup + repeats):
            if r == warmup:
                for record in records:
                    record.load_avg_1m = load_average()
            try:
                # with 2+ repeats the last one measures memory and the others time (the meter slows a CPU decode)
                meter = repeats >= 2 and r == warmup + repeats - 1
                runs = _one_shared_run(model, members, warm_ids if r < warmup else ids, max_new_tokens, gen_kwargs,
                                       meter)
            except Exception as exc:
                if raise_errors:
                    raise
                logger.warning("shared prefill of %s failed: %s: %s", labels, type(exc).__name__, exc)
                for record in records:
                    if record.ok:
                        record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
                break
            for record, run, kept in zip(records, runs, measured):
                if run["error"] is not None and record.ok:
                    if raise_errors:
                        raise RuntimeError(f"{record.method}: {run['error']}")
                    logger.warning("%s: decode after the shared prefill failed: %s", record.method, run["error"])
                    record.status, record.error = "failed", run["error"]
                if r >= warmup and record.ok:
                    kept.append(run)
    for record, runs in zip(records, measured):
        if record.ok and runs:
            _fill(record, runs, tokenizer)
    return all_records


def _refusals(model, members, raise_errors: bool) -> dict[int, str]:
    """Members whose own cache cannot be made for ``model`` (a refusal, e.g. a method that computes attention
    itself on a model with an attention softcap, or an out-of-memory error), found before the shared prefill:
    ``{index: "ValueError: ..."}``. The error is the one the method raises alone; with ``raise_errors`` it is raised
    here."""
    refused = {}
    for i, (method, _) in enumerate(members):
        try:
            cache = method.make_cache(model)
        except Exception as exc:  # a refusal (ValueError, NotImplementedError), or out of memory: that member only
            if raise_errors:
                raise
            refused[i] = f"{type(exc).__name__}: {exc}"
            logger.warning("%s cannot make its cache for this model: %s", getattr(method, "name", "method"), exc)
            continue
        close_cache(cache)
    return refused


def _fill(record: RunRecord, runs: list[dict], tokenizer) -> None:
    """Outputs, medians and samples of one method's measured runs into its record."""
    last = runs[-1]
    if any(r["new_ids"] != last["new_ids"] for r in runs):
        logger.warning("%s: outputs differ between repeats; reporting the last one", record.method)
    record.output_ids = last["new_ids"]
    record.new_tokens = len(last["new_ids"])
    record.output_text = tokenizer.decode(last["new_ids"], skip_special_tokens=True) if tokenizer is not None else ""
    record.samples = [{**{k: r[k] for k in _TIMED}, "metered": r["metered"]} for r in runs]
    timed = [r for r in runs if not r["metered"]] or runs
    metered = [r for r in runs if r["metered"]]
    for k in ("ttft_s", "decode_s", "tokens_per_s", "prefill_s"):
        setattr(record, k, median_or_none([r[k] for r in timed]))
    for k in ("shared_prefill_s", "compress_s", "shared_group_s"):
        record.extra[k] = median_or_none([r[k] for r in timed])
    for k in ("shared_prefill_peak_bytes", "decode_peak_bytes"):
        record.extra[k] = median_or_none([r[k] for r in metered])
    record.extra["shared_prefill_peak_method"] = metered[-1]["shared_prefill_peak_method"] if metered else "unavailable"
    record.peak_memory_bytes = median_or_none([r["peak_memory_bytes"] for r in metered])
    record.peak_memory_method = metered[-1]["peak_memory_method"] if metered else "unavailable"
    record.kv_cache_bytes_prefill = last["kv_cache_bytes_prefill"]
    record.kv_cache_bytes_final = last["kv_cache_bytes_final"]
    record.telemetry = _jsonable(last["telemetry"])

