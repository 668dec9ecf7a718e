"""mmaccel's KV-cache methods against NVIDIA kvpress in one harness: same checkpoint, same tokens, same meter.

``python benchmarks/vs_kvpress.py --model smollm2-135m --lengths 2048 4096 --cases 5 --out runs/vs_kvpress``

kvpress (https://github.com/NVIDIA/kvpress) is the reference library of KV-cache "presses". Version 0.5.x needs
``transformers < 5.3`` and patches transformers' attention functions for the whole process when imported, while
mmaccel runs on transformers 5.2x. So the two sides never share a process:

- the **driver** (this script, in mmaccel's environment) builds the NIAH token sequences with
  :mod:`mmaccel.data.haystack` (built-in held-out prose, a "secret number" needle, the question at the end of the
  user's turn, the chat template when the tokenizer has one), runs mmaccel's methods on them, then starts
- the **worker** (this same file, ``--worker kvpress``) in a virtual environment the driver creates on first use
  (default ``runs/kvpress-venv``: ``torch==2.13.0`` -- the CPU wheel on this machine --, ``kvpress==0.5.5``,
  ``transformers<5.3``). The worker imports no part of the ``mmaccel`` package. It reads the cases as JSON and writes
  one JSON record per run; the peak-memory meter is mmaccel's own file (``mmaccel/eval/memory.py``, which needs only
  the standard library and torch), loaded by path, so both sides use the same meter.

Peak memory (``--memory-meter``): the default ``rss`` is each process's sampled RSS growth, which depends on the
process's history and on the library versions (on one stack the two sides' ``full`` -- the same ``generate`` with a
``DynamicCache`` -- measured 318 and 422 MiB at 4k). ``allocator`` sums torch's CPU allocations under the profiler:
exact tensor bytes, the CPU's ``max_memory_allocated``, and the two sides' ``full`` agree to 0.1 MiB even across
transformers versions, which is what makes the peaks comparable. Its per-op cost is inside the timings.

Versions: kvpress 0.5.5 reads ``cache_position`` from the attention modules' keyword arguments, which transformers
5.23 no longer passes (every press fails with ``KeyError: 'cache_position'``), so its side needs ``transformers<5.3``;
``--venv`` may name any environment with kvpress 0.5.5 (e.g. one made with ``--system-site-packages`` that adds only
``transformers==5.2.0``, ``tokenizers==0.22.2`` and kvpress, so both sides share the torch build).

The driver scores both sides with the same rule (:func:`mmaccel.data.haystack.score_answer`, exact match of the first
number) and merges the records into one table.

What each side compresses
-------------------------
mmaccel's methods compress the **whole prompt** at the end of prefill (``generate`` with the method's cache). kvpress's
pipeline (``KVPressTextGenerationPipeline``) compresses the **context** only and then appends the question,
uncompressed. Here the question sits inside the context (at the end of the user's turn, as RULER does), so the
uncompressed part is what follows it: the chat template's closing tokens and the answer prefix (``<|im_end|>
<|im_start|>assistant The secret number of the ... is`` for ChatML; the answer prefix alone without a template).
Both ways are run:

- ``whole`` -- kvpress's press as a context manager over ``model.generate`` on the whole prompt (kvpress's documented
  low-level use): the same thing mmaccel compresses;
- ``context`` -- kvpress's own pipeline code (``KVPressTextGenerationPipeline._forward``: prefill of the context under
  the press, then the closing tokens and greedy decoding with ``generate_answer``), fed the same token ids split at
  the closing tokens.

Kept counts are matched exactly: mmaccel's ``ratio=r`` keeps ``ceil(r * L)`` slots per layer and KV head of an
``L``-token prompt (``KVScorer.context_budget``); the driver passes that count for every case, and the worker picks the
``compression_ratio`` that makes kvpress keep the same number (``1 - r`` whenever ``r * L`` is a whole number; see
:func:`kvpress_compression_ratio`). In ``context`` mode the closing tokens are held too, so the context keeps that many
fewer and the cache holds the same total. SnapKV's hyper-parameters differ between the two libraries (mmaccel:
window 32, pooling kernel 7; kvpress: 64 and 5), so both settings run on both sides. Known remaining differences:
mmaccel's StreamingLLM also evicts during decoding (the reference behaviour); kvpress's compresses at prefill only.

Runs can be split: ``--merge DIR...`` adds the records of earlier ``--out`` folders made on the same prompts with the
same meter (checked), and ``--sides`` with no value runs nothing and only merges.

Outputs (``--out DIR``)
-----------------------
``cases.json``
    The token sequences and the worker's job (model path, dtype, threads, generation settings).
``records.jsonl``
    One record per (side, mode, method, ratio, case): the output, ``correct`` (strict) and ``correct_contains``,
    ``prefill_s`` (prompt start to the first token's logits), ``decode_s``, ``peak_memory_bytes`` (one meter),
    ``kv_cache_bytes`` (K/V held at the first token), ``kept_fraction`` (that over the full prompt's K/V bytes),
    threads, dtype, versions. A failed run has ``status="failed"`` and ``error``; the sweep goes on.
``kvpress_records.jsonl``
    The worker's raw records.
``table.md``, ``summary.json``
    The merged table (medians over the cases) and the same numbers as JSON.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("vs_kvpress")

KVPRESS_REQUIREMENTS = ("torch==2.13.0", "kvpress==0.5.5", "transformers>=4.56,<5.3", "optimum-quanto==0.2.7")
"""What the worker's virtual environment gets (torch 2.13.0: the CPU wheel this machine carries)."""
KVPRESS_VERSION = "0.5.5"

DEFAULT_MMACCEL_METHODS = (
    "full",
    "snapkv",
    "snapkv:window=64:kernel_size=5",
    "streaming",
    "pyramidkv",
    "adakv:method=snapkv,ratio={r}",
    "h2o",
)
"""mmaccel specs; each but ``full`` runs at every ratio: ``{r}`` is replaced by it, else ``:ratio=r`` is appended."""

DEFAULT_KVPRESS_PRESSES = (
    "full",
    "snapkv:window_size=32:kernel_size=7",
    "snapkv:window_size=64:kernel_size=5",
    "streaming:n_sink=4",
    "expected_attention",
)
"""kvpress specs (``name[:field=value...]``; names in :data:`KVPRESS_NAMES` or any kvpress class; ``adakv/NAME``
wraps the press in ``AdaKVPress``); each but ``full`` runs at every ratio and in both modes."""

KVPRESS_NAMES = {
    "snapkv": "SnapKVPress",
    "streaming": "StreamingLLMPress",
    "expected_attention": "ExpectedAttentionPress",
    "pyramidkv": "PyramidKVPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "observed_attention": "ObservedAttentionPress",
    "kvzip": "KVzipPress",
    "keydiff": "KeyDiffPress",
    "chunkkv": "ChunkKVPress",
    "criticalkv": "CriticalKVPress",
}
"""Short names of kvpress presses. Wrappers (``adakv``, ``chunkkv``, ``criticalkv``) take the press after the ``/``
with their own defaults (ChunkKV: 20-token chunks)."""

QUANTIZED_CACHE = {"qcache4": 4, "qcache2": 2}
"""Outermost spec names that run the press (or no press: ``qcache4`` alone) on transformers' ``QuantizedCache``
(optimum-quanto backend, ``nbits`` 4 or 2, its default group size and 128-token residual) instead of a
``DynamicCache``: ``qcache4/snapkv`` is kvpress's SnapKV composed with a 4-bit cache."""

MASKING_PRESSES = ("KVzipPress", "AdaKVPress", "CriticalAdaKVPress", "DuoAttentionPress")
"""kvpress presses that keep head-wise budgets by masking evicted keys (``module.masked_key_indices``) rather than
removing them: their cache holds every K/V byte of the prompt (what ``kept`` measures)."""

RULER_PRESSES = (
    "full",
    "kvzip",
    "chunkkv/snapkv",
    "keydiff",
    "expected_attention",
    "adakv/snapkv",
    "criticalkv/snapkv",
    "snapkv",
    "streaming:n_sink=4",
    "qcache4",
    "qcache4/snapkv",
)
"""kvpress's side of ``--task ruler`` by default: its strongest presses (KVzip, the maintainers' best; ChunkKV,
KeyDiff, ExpectedAttention, AdaKV, CriticalKV on SnapKV), SnapKV, StreamingLLM, and transformers' 4-bit quantized
cache alone and under SnapKV. DuoAttention is left out: its patterns or calibration data come from the model hub,
which this machine cannot reach."""

RULER_MMACCEL_METHODS = (
    "full",
    "chunkkv:method=snapkv,ratio={r}",
    "kvzip",
    "snapkv",
    "keydiff",
    "expected_attention",
    "streaming",
)
"""mmaccel's side of ``--task ruler`` by default; a quantized cache (``kvquant:bits=4``) is full attention underneath
and runs once, whatever the ratios."""

WARMUP_TOKENS = 1024
"""Length of the warm-up prompt (or the shortest length, if shorter): long enough that ``ratio=0.125`` keeps at least
kvpress's SnapKV window of 64 (mmaccel refuses a ratio that keeps fewer slots than the window)."""

MODES = ("whole", "context")
RULER_MODES = ("aware", "agnostic")
MODE_TEXT = {
    "whole": "whole prompt",
    "context": "context; closing tokens appended",
    "aware": "aware: prompt with the question",
    "agnostic": "agnostic: context, then the question",
}


# ============================================================================================ shared (no mmaccel)
def kvpress_compression_ratio(n_tokens: int, keep: int) -> float:
    """The ``compression_ratio`` that makes a kvpress scorer press keep exactly ``keep`` of ``n_tokens`` tokens.

    kvpress keeps ``max(1, int(n_tokens * (1 - compression_ratio)))`` (``kvpress.utils.compute_n_kept``). The plain
    ``1 - keep / n_tokens`` is returned when it gives ``keep`` (e.g. 0.875 for 256 of 2048, the same as mmaccel's
    ``ratio=0.125``); otherwise ``1 - (keep + 0.5) / n_tokens``, which float truncation cannot move off ``keep``.

    Parameters
    ----------
    n_tokens : int
        Tokens the press compresses (the whole prompt, or the context in the pipeline).
    keep : int
        Tokens to keep, ``1 <= keep``; ``keep >= n_tokens`` means no compression (0.0).

    Raises
    ------
    ValueError
        If ``keep < 1`` or ``n_tokens < 1``.
    """
    if keep < 1 or n_tokens < 1:
        raise ValueError(f"cannot keep {keep} of {n_tokens} tokens; need keep >= 1 and n_tokens >= 1")
    if keep >= n_tokens:
        return 0.0
    plain = 1.0 - keep / n_tokens
    if int(n_tokens * (1 - plain)) == keep:
        return plain
    return 1.0 - (keep + 0.5) / n_tokens


def parse_press_spec(spec: str) -> tuple[list[str], dict]:
    """Split a kvpress spec into its press names (outermost first) and the innermost press's fields.

    ``"adakv/snapkv:window_size=32:kernel_size=7"`` -> ``(["adakv", "snapkv"], {"window_size": 32, "kernel_size":
    7})``. Values are read as JSON when they parse (numbers, ``true``), else kept as strings.

    Raises
    ------
    ValueError
        For an empty spec or a part that is not ``field=value``.
    """
    head, *parts = spec.strip().split(":")
    names = [n.strip() for n in head.split("/") if n.strip()]
    if not names:
        raise ValueError(f"empty kvpress spec {spec!r}; e.g. 'snapkv:window_size=32'")
    fields = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep:
            raise ValueError(f"kvpress spec {spec!r}: {part!r} is not field=value")
        try:
            fields[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key.strip()] = raw.strip()
    return names, fields


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _load_average():
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


# ======================================================================================== worker (kvpress venv)
def _load_meter(path: str):
    """mmaccel's ``PeakMemory`` from its file, without importing the ``mmaccel`` package (stdlib + torch only)."""
    spec = importlib.util.spec_from_file_location("_mmaccel_peak_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PeakMemory


def _tensor_bytes(t) -> int:
    """Bytes of a tensor's storage; a tensor subclass (optimum-quanto's packed codes with their scales and shifts) is
    counted through ``__tensor_flatten__``, its inner tensors summed."""
    if t is None:
        return 0
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t).__name__ != "Tensor" and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _held_kv(cache) -> tuple[int, list[int]]:
    """K/V bytes a transformers cache holds and the tokens per layer (kvpress's caches hold whole, contiguous K/V
    tensors: gathered at compression, concatenated at every update, so storage is what they keep). A
    ``QuantizedCache`` layer counts its quantized K/V (codes, scales, shifts) and its full-precision residual."""
    total, tokens = 0, []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        qk, qv = getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)
        held = _tensor_bytes(qk) + _tensor_bytes(qv)
        if keys is not None and keys.numel():
            held += _tensor_bytes(keys) + _tensor_bytes(values)
        total += held
        n = int(keys.shape[-2]) if keys is not None and keys.dim() == 4 else 0
        tokens.append(n + (int(qk.shape[-2]) if qk is not None and qk.dim() == 4 else 0))
    return total, tokens


def _make_cache(spec: str, model):
    """A fresh cache for a kvpress spec: transformers' ``QuantizedCache`` (optimum-quanto) for a ``qcache4`` /
    ``qcache2`` spec, else a ``DynamicCache``."""
    from transformers import DynamicCache, QuantizedCache

    names, _ = parse_press_spec(spec)
    if names[0] in QUANTIZED_CACHE:
        return QuantizedCache(backend="quanto", config=model.config, nbits=QUANTIZED_CACHE[names[0]])
    return DynamicCache()


def _build_press(spec: str, compression_ratio: float):
    """A fresh kvpress press from a spec, its innermost scorer set to ``compression_ratio``; ``None`` for ``full``."""
    import kvpress

    names, fields = parse_press_spec(spec)
    names = [n for n in names if n not in QUANTIZED_CACHE]
    if names in ([], ["full"]):
        return None
    *wrappers, inner = names
    press = getattr(kvpress, KVPRESS_NAMES.get(inner, inner))(compression_ratio=compression_ratio, **fields)
    for wrapper in reversed(wrappers):
        press = getattr(kvpress, KVPRESS_NAMES.get(wrapper, "AdaKVPress" if wrapper == "adakv" else wrapper))(press)
    return press


def _press_fields(press) -> dict:
    """The press's dataclass fields that are plain values (the wrapped press as its class name)."""
    import dataclasses

    if press is None:
        return {}
    out = {}
    for f in dataclasses.fields(press):
        value = getattr(press, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = {"class": type(value).__name__, **_press_fields(value)}
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[f.name] = value
    return out


def _run_whole(model, ids, press, max_new_tokens: int, gen_kwargs: dict, cache) -> dict:
    """kvpress's press as a context manager over ``model.generate`` on the whole prompt (prefill compression).

    Not for ``KVzipPress``: it compresses when its context manager exits, after ``generate`` has answered."""
    import contextlib

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    first: dict = {}

    class _FirstLogits(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first:
                first["t"] = time.perf_counter()
                first["kv"], first["tokens"] = _held_kv(cache)
            return scores

    t0 = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new_tokens, logits_processor=LogitsProcessorList([_FirstLogits()]),
                             **gen_kwargs)
    t_end = time.perf_counter()
    return {"new_ids": out[0, ids.shape[1]:].tolist(), "t0": t0, "t_end": t_end, **first}


def _run_context(pipe, ids, n_closing: int, press, max_new_tokens: int, cache) -> dict:
    """kvpress's pipeline code: the context prefilled under the press, the closing tokens appended, greedy decoding.

    The first forward of the causal LM (the pipeline prefills through ``model.model``) is the closing tokens' one:
    the K/V held just before it is the compressed context's (``kv``, ``tokens``), its end marks the first token's
    logits; every forward's argmax is one generated token.
    """
    first: dict = {}
    new_ids: list[int] = []

    def pre_hook(module, args, kwargs):
        if "kv" not in first:
            first["kv"], first["tokens"] = _held_kv(cache)

    def hook(module, args, kwargs, output):
        first.setdefault("t", time.perf_counter())
        new_ids.append(int(output.logits[0, -1].argmax()))

    handles = [pipe.model.register_forward_pre_hook(pre_hook, with_kwargs=True),
               pipe.model.register_forward_hook(hook, with_kwargs=True)]
    try:
        t0 = time.perf_counter()
        pipe._forward({"context_ids": ids[:, :-n_closing], "questions_ids": [ids[:, -n_closing:]]},
                      max_new_tokens=max_new_tokens, press=press, cache=cache)
        t_end = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    return {"new_ids": new_ids, "t0": t0, "t_end": t_end, **first}


def case_plan(case: dict, mode: str, ratio) -> tuple[int, int | None]:
    """``(n_closing, keep)`` of a kvpress run: the tokens appended uncompressed after the press's prefill, and how
    many of the compressed tokens it keeps (``None``: no ratio, full).

    - ``whole``: nothing appended; the prompt keeps mmaccel's count.
    - ``context`` (NIAH): the closing tokens appended; the context keeps that many fewer, so the total matches.
    - ``aware`` (RULER): the prompt's last token appended (kvpress's pipeline needs a question; KVzip compresses
      only when its context manager exits, so it cannot run over ``generate``); the rest keeps one fewer than
      mmaccel's count of the whole prompt.
    - ``agnostic`` (RULER): the question appended; the context keeps mmaccel's count of the context
      (:func:`mmaccel.longctx.compress.compress` on the same context).

    Raises
    ------
    ValueError
        For an unknown mode, or ``context`` mode without closing tokens.
    """
    if mode == "whole":
        n_closing, keep = 0, None if ratio is None else case["keep"][str(ratio)]
    elif mode == "context":
        n_closing = case["n_closing"]
        if not n_closing:
            raise ValueError("no closing tokens found after the question: context mode needs them")
        keep = None if ratio is None else case["keep"][str(ratio)] - n_closing
    elif mode == "aware":
        n_closing, keep = 1, None if ratio is None else case["keep"]["aware"][str(ratio)] - 1
    elif mode == "agnostic":
        n_closing = case["n_question"]
        keep = None if ratio is None else case["keep"]["agnostic"][str(ratio)]
    else:
        raise ValueError(f"unknown mode {mode!r}; use one of {MODES + RULER_MODES}")
    return n_closing, keep


def _worker_record(job, case, spec, mode, ratio) -> dict:
    return {
        "side": "kvpress", "mode": mode, "method": spec, "ratio": ratio, "case": case["id"],
        "prompt_tokens": len(case["input_ids"]), "status": "ok", "error": None,
        "threads": job["threads"], "dtype": job["dtype"], "attn_implementation": job["attn_implementation"],
    }


def _kvpress_run(job, ctx, case, spec, mode, ratio, *, warmup_case=None) -> dict:
    """One measured kvpress run (after an unrecorded one on ``warmup_case`` when given); failures are recorded."""
    import torch

    rec = _worker_record(job, case, spec, mode, ratio)
    try:
        for c, measured in ((warmup_case, False), (case, True)):
            if c is None:
                continue
            ids = torch.tensor([c["input_ids"]], dtype=torch.long)
            n_closing, keep = case_plan(c, mode, ratio)
            n_compressed = ids.shape[1] - n_closing
            cr = 0.0 if keep is None else kvpress_compression_ratio(n_compressed, keep)
            press = _build_press(spec, cr)
            max_new = c.get("max_new_tokens") or job["max_new_tokens"]
            rec["load_avg_1m"] = _load_average()
            with torch.inference_mode(), ctx["PeakMemory"](torch.device("cpu"),
                                                                 cpu_meter=job.get("memory_meter", "rss")) as mem:
                cache = _make_cache(spec, ctx["model"])
                if mode == "whole":
                    run = _run_whole(ctx["model"], ids, press, max_new, job["gen_kwargs"], cache)
                else:
                    run = _run_context(ctx["pipe"], ids, n_closing, press, max_new, cache)
        n = len(run["new_ids"])
        decode_s = run["t_end"] - run["t"]
        rec.update(
            spec=spec if press is None else f"{spec}:compression_ratio={cr:.6g}", compression_ratio=cr,
            press_class=type(press).__name__ if press is not None else None,
            press_fields=_press_fields(press), n_closing=n_closing, output_ids=run["new_ids"], new_tokens=n,
            output_text=ctx["tokenizer"].decode(run["new_ids"], skip_special_tokens=True),
            prefill_s=run["t"] - run["t0"], decode_s=decode_s,
            tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            peak_memory_bytes=mem.peak, peak_memory_method=mem.method, kv_cache_bytes=run["kv"],
            kept_tokens_per_layer=run["tokens"],
        )
    except Exception as exc:  # noqa: BLE001 - a failed run is data; the sweep goes on
        logger.warning("kvpress %s %s ratio=%s case %s failed: %s: %s", spec, mode, ratio, case["id"],
                       type(exc).__name__, exc)
        rec.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    return rec


def worker_main(cases_path: str, out_path: str) -> None:
    """The kvpress side: every press x mode x ratio x case of the job in ``cases_path``, one JSON line each.

    Runs in the kvpress virtual environment; imports torch, transformers and kvpress, never ``mmaccel``.
    """
    from importlib.metadata import version

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    job = json.loads(Path(cases_path).read_text(encoding="utf-8"))
    torch.set_num_threads(job["threads"])
    versions = {p: version(p) for p in ("kvpress", "transformers", "torch")}
    logger.info("kvpress worker: %s, %d threads", versions, torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"]),
                                                 attn_implementation=job["attn_implementation"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    ctx = {
        "model": model, "tokenizer": tokenizer, "PeakMemory": _load_meter(job["memory_module"]),
        "pipe": kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu")),
    }
    ruler = job.get("task") == "ruler"
    runs = [(spec, mode, ratio) for spec in job["presses"]
            for mode in (job["modes"] if ruler or spec != "full" else ["whole"])
            for ratio in ([None] if parse_press_spec(spec)[0][-1] in ("full", *QUANTIZED_CACHE) else job["ratios"])]
    done = {(r["method"], r["mode"], r["ratio"], r["case"]) for r in _read_jsonl(Path(out_path))
            if r.get("status") == "ok"} if job.get("resume") else set()
    with open(out_path, "a" if job.get("resume") else "w", encoding="utf-8") as sink:
        for k, (spec, mode, ratio) in enumerate(runs):
            todo = [c for c in job["cases"] if (spec, mode, ratio, c["id"]) not in done]
            for i, case in enumerate(todo):
                rec = _kvpress_run(job, ctx, case, spec, mode, ratio,
                                   warmup_case=job["warmup_case"] if i == 0 else None)
                rec["versions"] = versions
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
            logger.info("kvpress [%d/%d] %s %s ratio=%s done", k + 1, len(runs), spec, mode, ratio)


# ============================================================================================== driver (mmaccel)
def ensure_venv(venv, requirements=KVPRESS_REQUIREMENTS) -> Path:
    """The kvpress virtual environment's python, creating the environment on first use.

    An existing environment is reused when its kvpress is :data:`KVPRESS_VERSION`; otherwise ``python -m venv`` and
    ``pip install`` of ``requirements`` (about 2 minutes; pip finds the local CPU torch wheel).

    Raises
    ------
    subprocess.CalledProcessError
        If the environment cannot be created or the install fails.
    """
    venv = Path(venv)
    python = venv / "bin" / "python"
    env = _worker_env()
    if python.exists():
        probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('kvpress'))"],
                               check=False, capture_output=True, text=True, env=env)
        if probe.returncode == 0 and probe.stdout.strip() == KVPRESS_VERSION:
            return python
    logger.info("creating %s with %s", venv, " ".join(requirements))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    subprocess.run([str(python), "-m", "pip", "install", *requirements], check=True, env=env)
    return python


def _worker_env() -> dict:
    """The environment of the kvpress side's processes: this one without ``PYTHONPATH`` (so nothing of mmaccel's
    environment is visible there), with the hub offline."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _is_full_attention(template: str) -> bool:
    """Whether an mmaccel template is full attention, alone or under wrappers (``chunked_ffn:chunk=512``)."""
    from mmaccel.longctx import FullAttention, build_method

    if "{r}" in template:
        return False
    method = build_method(template)
    while not isinstance(method, FullAttention) and hasattr(method, "method"):
        method = method.method
    return isinstance(method, FullAttention)


def mmaccel_specs(templates, ratios) -> list[tuple[str, str, float | None]]:
    """``(label, spec, ratio)`` for every mmaccel method template at every ratio (full attention, alone or under a
    wrapper such as ``chunked_ffn:chunk=512``, once, ratio ``None``).

    ``{r}`` in a template is replaced by the ratio; a template without it gets ``:ratio=r`` appended. The label is
    the template without its ratio (``"adakv:method=snapkv"``).
    """
    out = []
    for template in templates:
        if _is_full_attention(template):
            out.append((template, template, None))
            continue
        label = re.sub(r"[:,]ratio=\{r\}", "", template)
        for r in ratios:
            out.append((label, template.format(r=r) if "{r}" in template else f"{template}:ratio={r}", r))
    return out


def closing_token_count(tokenizer, sample, chat_template: bool) -> int | None:
    """How many tokens follow the question in a NIAH prompt: the chat template's closing tokens and the answer
    prefix (kvpress's pipeline appends them uncompressed); ``None`` if the prompt does not end with them."""
    from mmaccel.data.haystack import ANSWER_PREFIX_TEMPLATE, chat_wrapper_ids

    prefix = ANSWER_PREFIX_TEMPLATE.format(key=sample.key)
    if chat_template:
        tail = chat_wrapper_ids(tokenizer)[1] + tokenizer.encode(prefix, add_special_tokens=False)
    else:
        tail = tokenizer.encode(" " + prefix, add_special_tokens=False)
    return len(tail) if tail and sample.input_ids[-len(tail):] == tail else None


def build_cases(tokenizer, lengths, n_cases: int, ratios, *, seed: int = 0, chat_template="auto",
                haystack=None) -> dict:
    """The NIAH token sequences both sides run, as JSON-ready dicts.

    ``n_cases`` prompts per length, needle depths ``(i + 0.5) / n_cases``, sample seed ``seed + i``
    (:func:`mmaccel.data.haystack.make_niah_sample`); ``keep`` holds mmaccel's kept slots per layer and KV head at
    each ratio (``KVScorer.context_budget``), ``n_closing`` the tokens after the question. ``haystack``: ``None`` for
    the built-in held-out prose, or a text file / :class:`~mmaccel.data.haystack.HaystackTokens`
    (:func:`mmaccel.eval.niah.load_haystack`).

    Returns
    -------
    dict
        ``{"chat_template": bool, "cases": [...], "warmup_case": {...}}``; a case has ``id``, ``length``,
        ``depth``, ``seed``, ``input_ids``, ``answer``, ``key``, ``needle_position``, ``n_closing``, ``keep``.

    Raises
    ------
    ValueError
        For ``n_cases < 1``, a length too short for the needle and question, or a bad ratio.
    """
    from mmaccel.data.haystack import make_niah_sample, resolve_chat_template
    from mmaccel.eval.niah import load_haystack
    from mmaccel.longctx import build_method

    if n_cases < 1:
        raise ValueError(f"need at least one case per length, got {n_cases}")
    use_chat = resolve_chat_template(tokenizer, chat_template)
    budgets = {r: build_method(f"snapkv:ratio={r}") for r in ratios}
    hay = load_haystack(tokenizer, haystack)

    def as_case(case_id, sample, seed_):
        return {
            "id": case_id, "length": sample.length, "depth": sample.depth, "seed": seed_,
            "input_ids": list(sample.input_ids), "answer": sample.answer, "key": sample.key,
            "needle_position": sample.needle_position,
            "n_closing": closing_token_count(tokenizer, sample, use_chat),
            "keep": {str(r): m.context_budget(len(sample.input_ids)) for r, m in budgets.items()},
        }

    cases = [
        as_case(f"L{length}-{i}", make_niah_sample(tokenizer, int(length), (i + 0.5) / n_cases, seed=seed + i,
                                                   haystack=hay, chat_template=use_chat), seed + i)
        for length in lengths for i in range(n_cases)
    ]
    warm_length = min(min(int(n) for n in lengths), WARMUP_TOKENS)
    warm = as_case("warmup", make_niah_sample(tokenizer, warm_length, 0.5, seed=seed + 1000, haystack=hay,
                                              chat_template=use_chat), seed + 1000)
    return {"chat_template": use_chat, "cases": cases, "warmup_case": warm}


def build_ruler_cases(tokenizer, tasks, lengths, n: int, ratios, *, seed: int = 0, chat_template="auto",
                      haystack=None) -> dict:
    """The RULER samples both sides run (:func:`mmaccel.eval.ruler.build_samples`: the ids ``mmaccel ruler`` runs with
    the same tasks, lengths, ``n``, seed, chat template and haystack), as JSON-ready dicts.

    Returns
    -------
    dict
        ``{"chat_template": bool, "cases": [...], "warmup_case": {...}}``; a case has ``id`` (the sweep's sample key,
        ``task/L=length/i=index``), ``task``, ``length``, ``seed``, ``input_ids`` (context then question),
        ``n_question`` (the question's tokens, the tail), ``references``, ``metric``, ``max_new_tokens`` (RULER's
        per task) and ``keep``: ``{"aware": {ratio: slots}, "agnostic": {ratio: slots}}``, mmaccel's kept slots per
        layer and KV head of the whole prompt (aware) and of the context alone (agnostic).

    Raises
    ------
    ValueError
        As :func:`mmaccel.eval.ruler.build_samples`; a task with several questions per sample (the QA tasks).
    """
    from mmaccel.data.haystack import resolve_chat_template
    from mmaccel.data.ruler import make_ruler_sample, resolve_tasks
    from mmaccel.eval.ruler import build_samples
    from mmaccel.longctx import build_method

    use_chat = resolve_chat_template(tokenizer, chat_template)
    text = None if haystack is None else Path(haystack).read_text(encoding="utf-8")
    samples = build_samples(tokenizer, resolve_tasks(list(tasks)), lengths, n, seed=seed, haystack=text,
                            chat_template=use_chat)
    budgets = {r: build_method(f"snapkv:ratio={r}") for r in ratios}

    def as_case(key, sample):
        if len(sample.queries) != 1:
            raise ValueError(f"{sample.task} asks {len(sample.queries)} questions per sample; the peer runs one")
        q = sample.queries[0]
        ids = list(sample.context_ids) + list(q.question_ids)
        return {
            "id": key, "task": sample.task, "length": sample.length, "seed": sample.seed, "input_ids": ids,
            "n_question": len(q.question_ids), "references": list(q.references), "metric": sample.metric,
            "max_new_tokens": sample.max_new_tokens,
            "keep": {"aware": {str(r): m.context_budget(len(ids)) for r, m in budgets.items()},
                     "agnostic": {str(r): m.context_budget(len(sample.context_ids)) for r, m in budgets.items()}},
        }

    warm_length = min(min(int(x) for x in lengths), WARMUP_TOKENS)
    warm = make_ruler_sample(tokenizer, "niah_single_1", warm_length, seed=seed + 1000, haystack=text,
                             chat_template=use_chat)
    return {"chat_template": use_chat, "cases": [as_case(k, smp) for k, smp in samples.items()],
            "warmup_case": as_case("warmup", warm)}


def ruler_side_records(records: list[dict], specs, cases: list[dict]) -> list[dict]:
    """mmaccel RULER sweep records (``mmaccel ruler``'s ``results.jsonl``) as side records of this table: those of the
    job's cases (sample keys) and of ``specs`` (``(label, spec, ratio)`` of :func:`mmaccel_specs`), in both modes.

    Raises
    ------
    ValueError
        If a record of a case has another prompt length than the case (another tokenizer, chat template or seed).
    """
    by_spec = {spec: (label, ratio) for label, spec, ratio in specs}
    by_case = {c["id"]: c for c in cases}
    out = []
    for r in records:
        extra = r.get("extra") or {}
        case = by_case.get(extra.get("sample"))
        if case is None or r.get("method") not in by_spec:
            continue
        if r["status"] == "ok" and r.get("prompt_tokens") not in (None, len(case["input_ids"])):
            raise ValueError(f"the mmaccel record of {case['id']} has {r['prompt_tokens']} prompt tokens, the case "
                             f"{len(case['input_ids'])}: not the same samples (model, chat template, seed?)")
        label, ratio = by_spec[r["method"]]
        answers = extra.get("answers") or [{}]
        out.append({
            "side": "mmaccel", "mode": extra["mode"], "method": label, "spec": r["method"], "ratio": ratio,
            "case": case["id"], "prompt_tokens": r.get("prompt_tokens"), "status": r["status"],
            "error": r.get("error"), "new_tokens": r.get("new_tokens"),
            "output_text": answers[0].get("output_text", r.get("output_text")), "prefill_s": r.get("ttft_s"),
            "decode_s": r.get("decode_s"), "peak_memory_bytes": r.get("peak_memory_bytes"),
            "peak_memory_method": r.get("peak_memory_method"), "kv_cache_bytes": r.get("kv_cache_bytes_prefill"),
            "threads": r.get("threads"), "dtype": r.get("dtype"), "load_avg_1m": r.get("load_avg_1m"),
            "versions": None, "shared_prefill": bool(extra.get("shared_prefill")),
        })
    return out


def run_mmaccel_ruler_side(model, tokenizer, job: dict, methods, out: Path, *, tasks, n: int,
                           haystack=None) -> list[dict]:
    """mmaccel's methods on the job's RULER cases in both modes, each with its own prefill and the same peak-memory
    meter as the worker (:func:`mmaccel.eval.ruler.run_ruler`, ``shared_prefill=False``, resumable in ``out``)."""
    from mmaccel.eval.ruler import run_ruler

    specs = mmaccel_specs(methods, job["ratios"])
    result = run_ruler(model, tokenizer, [spec for _, spec, _ in specs], tasks=tasks, lengths=job["lengths"], n=n,
                       mode="both", seed=job["seed"], chat_template=job["chat_template"], out_dir=out,
                       haystack=None if haystack is None else Path(haystack).read_text(encoding="utf-8"),
                       resume=out.is_dir() and any(out.iterdir()), shared_prefill=False, progress=False)
    return ruler_side_records(result.records, specs, job["cases"])


def kv_bytes_per_token(config, dtype) -> int:
    """Bytes of K and V one prompt token takes in a full cache: ``2 x layers x Hkv x head_dim x itemsize``."""
    import torch

    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def run_mmaccel_side(model, tokenizer, job: dict, methods, progress: bool = True) -> list[dict]:
    """mmaccel's methods on the job's cases (:func:`mmaccel.eval.generation.generate_measured`), as side records."""
    import torch
    import transformers
    from tqdm.auto import tqdm

    from mmaccel.eval.generation import generate_measured

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    records = []
    specs = mmaccel_specs(methods, job["ratios"])
    bar = tqdm(total=len(specs) * len(job["cases"]), desc="mmaccel", unit="run", disable=not progress)
    for label, spec, ratio in specs:
        for i, case in enumerate(job["cases"]):
            rec = generate_measured(model, tokenizer, case["input_ids"], method=spec, label=spec,
                                    max_new_tokens=job["max_new_tokens"], warmup=1 if i == 0 else 0,
                                    warmup_ids=job["warmup_case"]["input_ids"],
                                    memory_meter=job.get("memory_meter", "rss"))
            records.append({
                "side": "mmaccel", "mode": "whole", "method": label, "spec": spec, "ratio": ratio,
                "case": case["id"], "prompt_tokens": rec.prompt_tokens, "status": rec.status, "error": rec.error,
                "output_ids": rec.output_ids, "new_tokens": rec.new_tokens, "output_text": rec.output_text,
                "prefill_s": rec.ttft_s, "decode_s": rec.decode_s, "tokens_per_s": rec.tokens_per_s,
                "peak_memory_bytes": rec.peak_memory_bytes, "peak_memory_method": rec.peak_memory_method,
                "kv_cache_bytes": rec.kv_cache_bytes_prefill, "telemetry": rec.telemetry, "threads": rec.threads,
                "dtype": job["dtype"], "attn_implementation": job["attn_implementation"],
                "load_avg_1m": rec.load_avg_1m, "versions": versions,
            })
            bar.update(1)
    bar.close()
    return records


def run_kvpress_side(python, job_path: Path, out_path: Path) -> int:
    """Run the worker in the kvpress environment; returns its exit code (its records are flushed run by run)."""
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", "kvpress", "--cases", str(job_path),
           "--out", str(out_path)]
    logger.info("kvpress worker: %s", " ".join(cmd))
    return subprocess.run(cmd, check=False, env=_worker_env(), cwd=Path(__file__).resolve().parents[1]).returncode


def score_records(records: list[dict], cases: list[dict], bytes_per_token: int) -> list[dict]:
    """Add ``length``, ``correct``, ``correct_contains`` and ``kept_fraction`` to records (and ``depth``, ``answer``
    for NIAH cases, ``task`` for RULER ones).

    NIAH: ``correct`` is the strict exact match of the first number, ``correct_contains`` the answer anywhere.
    RULER: ``correct`` is RULER's string match with the task's metric (in [0, 1];
    :func:`mmaccel.data.ruler.score`), ``correct_contains`` the same with ``part``. ``kept_fraction``: the K/V
    bytes held over a full cache of what the side compressed (the whole prompt; in ``agnostic`` mode the context).
    """
    from mmaccel.data.haystack import score_answer, score_answer_contains
    from mmaccel.data.ruler import score

    by_id = {c["id"]: c for c in cases}
    for r in records:
        case = by_id[r["case"]]
        ok = r["status"] == "ok"
        text = r.get("output_text") or ""
        if "references" in case:
            tokens = len(case["input_ids"]) - (case["n_question"] if r["mode"] == "agnostic" else 0)
            r.update(length=case["length"], task=case["task"],
                     correct=score(text, case["references"], case["metric"]) if ok else 0.0,
                     correct_contains=score(text, case["references"], "part") if ok else 0.0)
        else:
            tokens = case["length"]
            r.update(length=case["length"], depth=case["depth"], answer=case["answer"],
                     correct=ok and score_answer(text, case["answer"]),
                     correct_contains=ok and score_answer_contains(text, case["answer"]))
        kv = r.get("kv_cache_bytes")
        r["kept_fraction"] = kv / (tokens * bytes_per_token) if ok and kv is not None else None
    return records


def counterpart(record: dict) -> str | None:
    """The mmaccel label that compresses what a kvpress ``whole``-mode record did, from the press's own fields.

    ``full`` -> ``full``; ``SnapKVPress(window_size=W, kernel_size=K)`` -> ``snapkv:window=W:kernel_size=K`` (or
    ``snapkv`` for mmaccel's defaults 32 / 7); ``StreamingLLMPress(n_sink=S)`` -> ``streaming`` (S = 4) or
    ``streaming:sink=S``. ``None`` when there is no exact counterpart.
    """
    if record.get("mode") != "whole":
        return None
    cls, fields = record.get("press_class"), record.get("press_fields") or {}
    if record.get("method") == "full" and cls is None:
        return "full"
    if cls == "SnapKVPress":
        w, k = fields.get("window_size"), fields.get("kernel_size")
        return "snapkv" if (w, k) == (32, 7) else f"snapkv:window={w}:kernel_size={k}"
    if cls == "StreamingLLMPress":
        s = fields.get("n_sink")
        return "streaming" if s == 4 else f"streaming:sink={s}"
    return None


def unwrapped(label: str) -> str | None:
    """The mmaccel label a ``chunked_ffn`` row wraps (``"chunked_ffn:chunk=512:method=snapkv"`` -> ``"snapkv"``): the
    chunked feed-forward changes no kept slot, so its answers must equal that method's. ``None`` for other labels."""
    match = re.fullmatch(r"chunked_ffn:chunk=\d+:method=(.+)", label)
    return match.group(1).replace(",", ":") if match else None


def _row_key(r: dict) -> tuple:
    return r["side"], r["mode"], r["method"], r["ratio"]


def summarize(records: list[dict]) -> list[dict]:
    """One row per (side, mode, method, ratio): accuracy over successful runs, medians over cases, and for kvpress
    ``whole`` rows with an mmaccel counterpart (and mmaccel ``chunked_ffn`` rows, against the method they wrap), on
    how many cases both gave the same output text.

    Returns
    -------
    list of dict
        ``side``, ``mode``, ``method``, ``ratio``, ``correct``, ``n``, ``failed``, ``accuracy``,
        ``accuracy_contains``, ``kept_fraction``, ``kv_cache_bytes``, ``peak_memory_bytes``, ``prefill_s``,
        ``decode_s``, ``same_output`` (``[same, compared]`` or ``None``), ``counterpart``, ``errors`` (first 3).
    """
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(_row_key(r), []).append(r)
    outputs = {(r["side"], r["mode"], r["method"], r["ratio"], r["case"]): r.get("output_text")
               for r in records if r["status"] == "ok"}
    rows = []
    for key, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        mate = counterpart(rs[0]) if rs[0]["side"] == "kvpress" else unwrapped(rs[0]["method"])
        same = None
        if mate is not None:
            pairs = [(r.get("output_text"), outputs.get(("mmaccel", "whole", mate, r["ratio"], r["case"])))
                     for r in ok]
            pairs = [p for p in pairs if p[1] is not None]
            same = [sum(a == b for a, b in pairs), len(pairs)] if pairs else None
        rows.append({
            "side": key[0], "mode": key[1], "method": key[2], "ratio": key[3],
            "correct": sum(float(r["correct"]) for r in ok), "n": len(ok), "failed": len(rs) - len(ok),
            "accuracy": sum(float(r["correct"]) for r in ok) / len(ok) if ok else None,
            "accuracy_contains": sum(float(r["correct_contains"]) for r in ok) / len(ok) if ok else None,
            **{f: _median([r.get(f) for r in ok]) for f in ("kept_fraction", "kv_cache_bytes", "peak_memory_bytes",
                                                           "prefill_s", "decode_s")},
            "same_output": same, "counterpart": mate,
            "errors": list(dict.fromkeys(r["error"] for r in rs if r["error"]))[:3],
        })
    side_order = {("mmaccel", "whole"): 0, ("kvpress", "whole"): 1, ("kvpress", "context"): 2}
    mode_order = {m: i for i, m in enumerate(RULER_MODES)}
    rows.sort(key=lambda row: (mode_order.get(row["mode"], -1), row["ratio"] is not None, row["ratio"] or 0.0,
                               side_order.get((row["side"], row["mode"]), row["side"] != "mmaccel")))
    return rows


def dedupe(records: list[dict]) -> list[dict]:
    """One record per (side, mode, method, ratio, case): the last one (a resumed worker retries failed runs)."""
    last = {(r["side"], r["mode"], r["method"], r["ratio"], r["case"]): r for r in records}
    return list(last.values())


def equal_bytes(rows: list[dict], budgets=(0.25, 0.10), slack: float = 0.02) -> list[dict]:
    """The best row of each side per mode among those holding at most ``budget`` (x ``1 + slack``: ceilings and a
    quantized cache's scales) of a full cache's K/V bytes (median ``kept_fraction``).

    Returns
    -------
    list of dict
        ``mode``, ``budget``, ``side``, ``method``, ``ratio``, ``accuracy``, ``kept_fraction``, ``n``; a side with no
        row under the budget is absent. Rows with a failure or fewer cases than the most any row has are skipped.
    """
    most = max((r["n"] for r in rows), default=0)
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for budget in budgets:
            for side in ("mmaccel", "kvpress"):
                fit = [r for r in rows if r["mode"] == mode and r["side"] == side and r["accuracy"] is not None
                       and r["kept_fraction"] is not None and r["kept_fraction"] <= budget * (1 + slack)
                       and r["n"] == most and not r["failed"]]
                if fit:
                    best = max(fit, key=lambda r: r["accuracy"])
                    out.append({"mode": mode, "budget": budget, "side": side, "method": best["method"],
                                "ratio": best["ratio"], "accuracy": best["accuracy"],
                                "kept_fraction": best["kept_fraction"], "n": best["n"]})
    return out


def equal_bytes_markdown(best: list[dict]) -> str:
    """:func:`equal_bytes` as a markdown table: per mode and K/V budget, each side's best method and its accuracy."""
    lines = ["| mode | K/V bytes held <= | mmaccel best | accuracy | kvpress best | accuracy |",
             "|---|---:|---|---:|---|---:|"]
    for mode in dict.fromkeys(b["mode"] for b in best):
        for budget in dict.fromkeys(b["budget"] for b in best if b["mode"] == mode):
            cell = {b["side"]: b for b in best if b["mode"] == mode and b["budget"] == budget}
            parts = []
            for side in ("mmaccel", "kvpress"):
                b = cell.get(side)
                parts += ["-", "-"] if b is None else [
                    f"`{b['method']}`" + ("" if b["ratio"] is None else f" @{b['ratio']:g}") +
                    f" ({b['kept_fraction']:.3f})", f"{b['accuracy']:.3f}"]
            lines.append(f"| {mode} | {budget:.0%} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def table_markdown(rows: list[dict]) -> str:
    """The merged table: side, what it compresses, method, ratio, accuracy k/n, kept fraction, K/V MiB, peak MiB
    (medians), prefill s (median), same output as mmaccel, failed runs."""
    head = ["side", "compresses", "method", "ratio", "accuracy", "kept", "KV MiB", "peak MiB", "prefill s",
            "same as mmaccel", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 8) + "|"]
    for row in rows:
        same = row["same_output"]
        lines.append("| " + " | ".join([
            row["side"], MODE_TEXT.get(row["mode"], row["mode"]), f"`{row['method']}`",
            "-" if row["ratio"] is None else f"{row['ratio']:g}",
            f"{row['correct']:.3g}/{row['n']}", _fmt(row["kept_fraction"], ".3f"),
            _fmt(row["kv_cache_bytes"], ".2f", 2**20), _fmt(row["peak_memory_bytes"], ".1f", 2**20),
            _fmt(row["prefill_s"], ".2f"), "-" if same is None else f"{same[0]}/{same[1]}",
            str(row["failed"]) if row["failed"] else "",
        ]) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, records: list[dict], config: dict) -> dict:
    """Write ``records.jsonl``, ``table.md`` and ``summary.json``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    rows = summarize(records)
    summary = {"config": config, "rows": rows}
    text = _table_header(config) + "\n" + table_markdown(rows)
    if config.get("task") == "ruler":
        summary["equal_bytes"] = equal_bytes(rows)
        text += ("\n## At equal K/V bytes held (best of each side, all cases run)\n\n"
                 + equal_bytes_markdown(summary["equal_bytes"]) + "\n" + RULER_TABLE_NOTE)
    (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    (out / "table.md").write_text(text, encoding="utf-8")
    return summary


RULER_TABLE_NOTE = (
    "kvpress's KVzip, AdaKV and CriticalKV(AdaKV) keep head-wise budgets by masking evicted keys: they hold every K/V "
    "byte (`kept` ~1), so they cannot enter a 25% or 10% budget. kvpress's DuoAttention is not run: its "
    "attention patterns (or the calibration data to fit them) come from the model hub, which this machine cannot "
    "reach. kvpress runs through its pipeline's code in both modes (aware: the whole prompt but its last token "
    "compressed; agnostic: the context compressed, then the question), because KVzip compresses when its context "
    "manager exits.\n"
)


def _table_header(config: dict) -> str:
    kv = config.get("kvpress_versions") or {}
    mm = config.get("mmaccel_versions") or {}
    peak = {"rss": "RSS growth", "allocator": "torch's CPU allocations under the profiler, exact tensor bytes; the "
            "profiler's per-op cost is inside the timings"}[config.get("memory_meter", "rss")]
    what = (f"{config['n_cases']} RULER samples per task ({', '.join(config['tasks'])}), accuracy = RULER's string "
            "match (mean over samples)" if config.get("task") == "ruler" else f"{config['n_cases']} NIAH prompts")
    return (
        f"# mmaccel vs kvpress {kv.get('kvpress', '?')}: `{config['model']}`\n\n"
        f"{what} per length, lengths {config['lengths']}, {config['dtype']}, "
        f"{config['threads']} thread(s), greedy, {config['max_new_tokens']} new tokens at most; "
        f"chat template: {config['chat_template']}. mmaccel: torch {mm.get('torch', '?')}, transformers "
        f"{mm.get('transformers', '?')}; kvpress side: torch {kv.get('torch', '?')}, transformers "
        f"{kv.get('transformers', '?')} (own process). Kept counts match mmaccel's `ceil(ratio x prompt)`; `kept` = "
        "K/V bytes held at the first token / the full prompt's; peak = "
        f"{peak} (mmaccel's PeakMemory, both sides); prefill = prompt start to the first token's logits. "
        "`same as mmaccel`: identical answers to the "
        "mmaccel method with the same settings on the same prompts. Median 1-minute load average during the runs: "
        f"{config.get('load_avg_1m_median')} (timings under load are noisy; compare within one run).\n"
    )


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def merge_records(earlier: Path, job: dict) -> list[dict]:
    """The records of an earlier run's output folder, to merge into this run's table.

    Raises
    ------
    ValueError
        The folder lacks ``cases.json`` / ``records.jsonl``, or its cases (token ids) or memory meter differ from
        this run's: only runs on the same prompts and meter can share a table.
    """
    cases_path, records_path = earlier / "cases.json", earlier / "records.jsonl"
    if not cases_path.is_file() or not records_path.is_file():
        raise ValueError(f"--merge {earlier}: no cases.json and records.jsonl there; give an earlier --out folder")
    old = json.loads(cases_path.read_text(encoding="utf-8"))
    if [c["input_ids"] for c in old["cases"]] != [c["input_ids"] for c in job["cases"]]:
        raise ValueError(f"--merge {earlier}: its prompts differ from this run's; use the same --model, --lengths, "
                         "--cases, --seed and --chat-template")
    if old.get("memory_meter", "rss") != job["memory_meter"]:
        raise ValueError(f"--merge {earlier}: it measured peaks with --memory-meter {old.get('memory_meter', 'rss')}"
                         f", this run with {job['memory_meter']}")
    return _read_jsonl(records_path)


def driver_main(args) -> dict:
    """Build the cases, run mmaccel's side, run kvpress's side in its environment, merge and write the outputs."""
    import torch

    import mmaccel.eval.memory
    from mmaccel.models import load, resolve_model_path
    from mmaccel.pipeline import generation_kwargs, resolve_methods

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(Path(resolve_model_path(args.model)).resolve())
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load(model_path, device="cpu", dtype=dtype, attn_implementation="sdpa")
    ruler = args.task == "ruler"
    resolve_methods([spec for _, spec, _ in mmaccel_specs(args.mmaccel_methods, args.ratios)])  # errors up front
    for spec in args.kvpress_presses:
        parse_press_spec(spec)
    if ruler:
        built = build_ruler_cases(tokenizer, args.tasks, args.lengths, args.cases, args.ratios, seed=args.seed,
                                  chat_template=args.chat_template, haystack=args.haystack)
    else:
        built = build_cases(tokenizer, args.lengths, args.cases, args.ratios, seed=args.seed,
                            chat_template=args.chat_template, haystack=args.haystack)
    job = {
        "model": model_path, "dtype": args.dtype, "threads": args.threads, "attn_implementation": "sdpa",
        "max_new_tokens": args.max_new_tokens, "ratios": list(args.ratios), "modes": list(args.kvpress_modes),
        "presses": list(args.kvpress_presses), "memory_meter": args.memory_meter,
        "memory_module": str(Path(mmaccel.eval.memory.__file__).resolve()), "task": args.task,
        "lengths": [int(x) for x in args.lengths], "seed": args.seed, "resume": args.resume,
        "gen_kwargs": generation_kwargs(model, tokenizer), **built,
    }
    job_path = out / "cases.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    bytes_per_token = kv_bytes_per_token(model.config, dtype)

    records: list[dict] = []
    if ruler:
        from mmaccel.eval.sweep import read_sweeps

        specs = mmaccel_specs(args.mmaccel_methods, args.ratios)
        if args.mmaccel_ruler:
            records += ruler_side_records(read_sweeps(args.mmaccel_ruler).records, specs, job["cases"])
        if "mmaccel" in args.sides:
            records += run_mmaccel_ruler_side(model, tokenizer, job, args.mmaccel_methods, out / "mmaccel_ruler",
                                              tasks=args.tasks, n=args.cases, haystack=args.haystack)
    elif "mmaccel" in args.sides:
        records += run_mmaccel_side(model, tokenizer, job, args.mmaccel_methods)
    del model
    gc.collect()
    kv_path = out / "kvpress_records.jsonl"
    worker_rc = None
    if "kvpress" in args.sides:
        python = ensure_venv(args.venv)
        started = time.perf_counter()
        worker_rc = run_kvpress_side(python, job_path, kv_path)
        logger.info("kvpress side: exit code %s after %.0f s", worker_rc, time.perf_counter() - started)
        records += _read_jsonl(kv_path)
    for earlier in args.merge:
        records += merge_records(Path(earlier), job)
    records = score_records(dedupe(records), job["cases"], bytes_per_token)
    kv_versions = next((r["versions"] for r in records if r["side"] == "kvpress"), None)
    mm_versions = next((r["versions"] for r in records if r["side"] == "mmaccel"), None)
    config = {
        "model": model_path, "task": args.task, "tasks": [c for c in dict.fromkeys(
            c.get("task") for c in job["cases"]) if c], "mmaccel_ruler": [str(d) for d in args.mmaccel_ruler],
        "lengths": list(args.lengths), "n_cases": args.cases, "ratios": list(args.ratios),
        "threads": args.threads, "dtype": args.dtype, "memory_meter": args.memory_meter,
        "max_new_tokens": args.max_new_tokens, "seed": args.seed,
        "chat_template": job["chat_template"], "haystack": "builtin" if args.haystack is None else str(args.haystack),
        "mmaccel_methods": list(args.mmaccel_methods), "merged_from": [str(d) for d in args.merge],
        "kvpress_presses": list(args.kvpress_presses), "kvpress_modes": list(args.kvpress_modes),
        "kvpress_venv": str(args.venv), "kvpress_worker_exit_code": worker_rc, "mmaccel_versions": mm_versions,
        "kvpress_versions": kv_versions, "kv_bytes_per_token": bytes_per_token,
        "load_avg_1m_median": _median([r.get("load_avg_1m") for r in records]),
    }
    summary = write_outputs(out, records, config)
    if worker_rc not in (None, 0):
        logger.warning("the kvpress worker exited with %s: its missing runs are absent from the table", worker_rc)
    logger.info("wrote %s", out)
    return summary


def build_parser() -> argparse.ArgumentParser:
    """The driver's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="micro-lm", help="zoo name or local HF checkpoint folder (both sides load it)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="prompt lengths, tokens")
    p.add_argument("--cases", type=int, default=5, help="NIAH prompts per length")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.125, 0.25], help="kept fractions of the prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--memory-meter", default="rss", choices=["rss", "allocator"],
                   help="peak memory on both sides: the sampled RSS growth (default), or torch's CPU allocations "
                        "under the profiler (exact tensor bytes, comparable across processes; its per-op cost "
                        "inflates the timings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--haystack", type=Path, default=None, help="UTF-8 text file (default: built-in held-out prose)")
    p.add_argument("--venv", type=Path, default=Path("runs/kvpress-venv"),
                   help="kvpress virtual environment (created on first use)")
    p.add_argument("--out", type=Path, default=Path("runs/vs_kvpress"))
    p.add_argument("--task", default="niah", choices=["niah", "ruler"],
                   help="niah: the planted number (whole/context modes); ruler: RULER samples of `mmaccel ruler` "
                        "(aware/agnostic modes, --cases samples per task)")
    p.add_argument("--tasks", nargs="+", default=["all"], help="RULER tasks (--task ruler; default all 11)")
    p.add_argument("--mmaccel-methods", nargs="+", default=None,
                   help="mmaccel specs ({r}: the ratio); default per --task")
    p.add_argument("--kvpress-presses", nargs="+", default=None, help="kvpress specs; default per --task")
    p.add_argument("--kvpress-modes", nargs="+", default=None, choices=MODES + RULER_MODES,
                   help="default: whole context (niah), aware agnostic (ruler)")
    p.add_argument("--mmaccel-ruler", nargs="+", type=Path, default=[], metavar="DIR",
                   help="--task ruler: take mmaccel's records from these `mmaccel ruler --out` folders (same model, "
                        "seed, chat template; their samples that are cases here) instead of or beside --sides mmaccel")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished runs of an earlier call with the same --out (both sides)")
    p.add_argument("--sides", nargs="*", default=["mmaccel", "kvpress"], choices=["mmaccel", "kvpress"],
                   help="which sides run (none with --merge: only merge earlier folders into one table)")
    p.add_argument("--merge", nargs="+", type=Path, default=[], metavar="DIR",
                   help="earlier --out folders on the same prompts and meter whose records join this table")
    return p


def main(argv=None) -> int:
    """Entry point: the driver, or with ``--worker kvpress --cases FILE --out FILE`` the kvpress worker."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if "--worker" in argv:
        p = argparse.ArgumentParser(description="kvpress worker (run by the driver in the kvpress environment)")
        p.add_argument("--worker", choices=["kvpress"], required=True)
        p.add_argument("--cases", required=True, help="the job JSON the driver wrote")
        p.add_argument("--out", required=True, help="JSONL records to write")
        args = p.parse_args(argv)
        worker_main(args.cases, args.out)
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    ruler = args.task == "ruler"
    args.mmaccel_methods = args.mmaccel_methods or list(RULER_MMACCEL_METHODS if ruler else DEFAULT_MMACCEL_METHODS)
    args.kvpress_presses = args.kvpress_presses or list(RULER_PRESSES if ruler else DEFAULT_KVPRESS_PRESSES)
    args.kvpress_modes = args.kvpress_modes or list(RULER_MODES if ruler else MODES)
    wrong = [m for m in args.kvpress_modes if m not in (RULER_MODES if ruler else MODES)]
    if wrong:
        parser.error(f"--kvpress-modes {' '.join(wrong)} do not fit --task {args.task}; use "
                     f"{' '.join(RULER_MODES if ruler else MODES)}")
    summary = driver_main(args)
    print(table_markdown(summary["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
