"""RULER-style sweeps over KV-cache methods in both query modes: records, a summary, heatmaps and a Pareto plot.

The tasks are :mod:`mmaccel.data.ruler`'s (Hsieh et al., 2024, arXiv 2404.06654). Every method sees the same token
ids. Two query modes:

``aware``
    The question is inside the compressed prompt (``context_ids + question_ids`` prefilled together, then
    generated): :func:`~mmaccel.eval.generation.generate_measured`, or one shared full-attention prefill for the
    methods that allow it (:func:`~mmaccel.eval.sweep.run_measured_group`).
``agnostic``
    The context is compressed before any question is seen, then each question of the sample is asked of the same
    compressed cache (:func:`mmaccel.longctx.compress.compress` / ``compress_shared`` and ``answer``).

Output folder (the sweep harness, :func:`mmaccel.eval.sweep.sweep`: records appended and fsynced, ``resume``)
------------------------------------------------------------------------------------------------------------
``results.jsonl``
    One record per (method, task, length, sample, mode): the :class:`~mmaccel.eval.generation.RunRecord` fields
    (the first question's timings and K/V bytes) and in ``extra``: ``task``, ``length``, ``index``, ``mode``,
    ``sample_seed``, ``score`` (mean over the sample's questions of RULER's string match, in [0, 1]) and
    ``answers`` (per question: ``output_text``, ``references``, ``score``).
``summary.json``
    ``cells``: per (method, task, length, mode) ``accuracy`` (mean score), ``n`` (samples that ran), ``failed`` and
    the ratios to ``full`` on the same samples (medians over the samples): ``kv_bytes_ratio`` (K/V bytes held after
    the prefill), ``peak_memory_ratio`` (``None`` where the peak was not measured: shared prefills),
    ``ttft_ratio``, ``decode_ratio`` (seconds per decoded token). ``methods``: per method and mode the average
    accuracy over tasks and lengths and the median ``kv_bytes_ratio``. ``config``, ``sweep``.
``heatmap_<mode>_<length>.png``
    Accuracy, tasks (rows) x methods (columns).
``pareto.png``
    Average accuracy against K/V bytes held (ratio to full), one point per method and budget, per mode.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.ruler import RulerSample, load_qa_file, make_ruler_sample, resolve_tasks, score
from ..longctx import kv_cache_bytes
from ..longctx.compress import answer, compress, compress_shared, needs_question
from ..pipeline import generation_kwargs, resolve_methods
from .generation import RunRecord, generate_measured, load_average, median_or_none
from .memory import PeakMemory
from .sweep import (
    MANIFEST,
    RESULTS,
    SUMMARY,
    Cell,
    check_out_dir,
    read_records,
    run_measured_group,
    save_figure,
    shares_prefill,
    sweep,
    sweep_block,
    write_atomic,
    write_json,
)

logger = logging.getLogger(__name__)

MODES = ("aware", "agnostic")


@dataclass
class RulerResult:
    """The outcome of :func:`run_ruler`: ``records`` (as in ``results.jsonl``), ``summary`` (as in
    ``summary.json``) and ``out_dir``."""

    records: list
    summary: dict
    out_dir: Path | None = None


def resolve_modes(mode: str) -> list[str]:
    """``["aware"]``, ``["agnostic"]`` or both for ``"both"``.

    Raises
    ------
    ValueError
        For another mode.
    """
    if mode == "both":
        return list(MODES)
    if mode in MODES:
        return [mode]
    raise ValueError(f"unknown query mode {mode!r}; use aware, agnostic or both")


def with_full(methods: Sequence) -> list:
    """``methods`` with ``"full"`` first when no method is full attention (the ratios need it)."""
    resolved = resolve_methods(list(methods))
    if any(getattr(m, "name", None) == "full" for m, _ in resolved):
        return list(methods)
    return ["full", *methods]


def check_agnostic(methods: Sequence, modes: Sequence[str]) -> None:
    """Refuse, before anything loads, a method that cannot compress before the question in agnostic mode.

    Raises
    ------
    ValueError
        Naming the method and the fix (``--mode aware``, or leave it out).
    """
    if "agnostic" not in modes:
        return
    for method, label in resolve_methods(list(methods)):
        if needs_question(method):
            raise ValueError(f"{label} scores the context with the question, so it cannot compress before the "
                             "question is known: run it with --mode aware, or leave it out of an agnostic run")


def build_samples(tokenizer, tasks: Sequence[str], lengths: Sequence[int], n: int, *, seed: int = 0,
                  haystack: str | None = None, chat_template: bool = False, qa=None) -> dict[str, RulerSample]:
    """Every sample of a sweep, built (and so validated) before any run: sample ``i`` uses seed ``seed + i``.

    Returns
    -------
    dict
        ``"task/L=length/i=index"`` -> :class:`~mmaccel.data.ruler.RulerSample`, in index, task, length order, so
        that a sweep cut short (to be resumed) has covered every task and length with its first samples.

    Raises
    ------
    ValueError
        ``n < 1``, a bad length or task, a length too small for a task.
    """
    if n < 1:
        raise ValueError(f"--n must be >= 1 (samples per task and length), got {n}")
    if not lengths or any(int(x) < 1 for x in lengths):
        raise ValueError(f"lengths must be positive token counts, got {list(lengths)}")
    return {f"{t}/L={int(length)}/i={i}": make_ruler_sample(tokenizer, t, int(length), seed=seed + i,
                                                            haystack=haystack, chat_template=chat_template, qa=qa)
            for i in range(n) for t in tasks for length in lengths}


def _answers(sample: RulerSample, texts: Sequence[str]) -> tuple[float, list[dict]]:
    rows = [{"output_text": text, "references": q.references, "score": score(text, q.references, sample.metric)}
            for q, text in zip(sample.queries, texts)]
    return sum(r["score"] for r in rows) / len(rows), rows


def _finish(rec: RunRecord, sample: RulerSample, key: str, mode: str, seed: int, texts: Sequence[str]) -> dict:
    mean, rows = _answers(sample, texts) if rec.ok else (0.0, [])
    rec.extra.update(task=sample.task, length=sample.length, index=sample.seed - seed, sample=key, mode=mode,
                     sample_seed=sample.seed, chat_template=sample.chat_template, score=mean, answers=rows)
    return rec.to_dict()


def _agnostic_record(model, tokenizer, label: str, method, sample: RulerSample, ctx, answers, *, prefill_s: float,
                     peak, peak_method: str) -> RunRecord:
    first = answers[0]
    n_new = len(first.new_ids)
    return RunRecord(
        method=label, method_name=method.name, output_text=tokenizer.decode(first.new_ids, skip_special_tokens=True),
        output_ids=first.new_ids, prompt_tokens=sample.prompt_tokens, new_tokens=n_new,
        ttft_s=prefill_s + first.question_s, prefill_s=prefill_s, decode_s=first.decode_s,
        tokens_per_s=(n_new - 1) / first.decode_s if n_new > 1 and first.decode_s > 0 else None,
        peak_memory_bytes=peak, peak_memory_method=peak_method, kv_cache_bytes_prefill=kv_cache_bytes(ctx.cache),
        kv_cache_bytes_final=first.kv_cache_bytes,
        telemetry={"warnings": sorted({w for a in answers for w in a.warnings})}, repeats=1, warmup=0,
        device=str(getattr(model, "device", "cpu")), dtype=str(next(model.parameters()).dtype),
        threads=torch.get_num_threads(), load_avg_1m=load_average(),
        extra={"question_s": [a.question_s for a in answers], "compress_s": ctx.compress_s},
    )


def _texts(tokenizer, answers) -> list[str]:
    return [tokenizer.decode(a.new_ids, skip_special_tokens=True) for a in answers]


def _ratio(value, base):
    return value / base if value is not None and base else None


def _per_token(r: dict):
    n = r.get("new_tokens") or 0
    return r["decode_s"] / (n - 1) if n > 1 and r.get("decode_s") else None


def summarize(records: list[dict]) -> dict:
    """The summary of RULER records (see the module docstring for the fields).

    Returns
    -------
    dict
        ``{"cells": [...], "methods": {label: {mode: {"accuracy", "kv_bytes_ratio", "tasks"}}}}``.
    """
    full = {(r["extra"]["sample"], r["extra"]["mode"]): r for r in records
            if r.get("method_name") == "full" and r["status"] == "ok"}
    keys = list(dict.fromkeys((r["method"], r["extra"]["task"], r["extra"]["length"], r["extra"]["mode"])
                              for r in records))
    cells = []
    for label, task, length, mode in keys:
        rows = [r for r in records if (r["method"], r["extra"]["task"], r["extra"]["length"], r["extra"]["mode"]) ==
                (label, task, length, mode)]
        ok = [r for r in rows if r["status"] == "ok"]

        def ratios(get, ok=ok, mode=mode):
            return median_or_none([_ratio(get(r), get(full[(r["extra"]["sample"], mode)])) for r in ok
                                   if (r["extra"]["sample"], mode) in full])

        cells.append({
            "method": label, "task": task, "length": length, "mode": mode,
            "accuracy": sum(r["extra"]["score"] for r in ok) / len(ok) if ok else None,
            "n": len(ok), "failed": len(rows) - len(ok),
            "kv_bytes_ratio": ratios(lambda r: r.get("kv_cache_bytes_prefill")),
            "peak_memory_ratio": ratios(lambda r: r.get("peak_memory_bytes")),
            "ttft_ratio": ratios(lambda r: r.get("ttft_s")),
            "decode_ratio": ratios(_per_token),
        })
    methods: dict = {}
    for label in dict.fromkeys(c["method"] for c in cells):
        for mode in dict.fromkeys(c["mode"] for c in cells):
            mine = [c for c in cells if c["method"] == label and c["mode"] == mode and c["accuracy"] is not None]
            if mine:
                methods.setdefault(label, {})[mode] = {
                    "accuracy": sum(c["accuracy"] for c in mine) / len(mine),
                    "kv_bytes_ratio": median_or_none([c["kv_bytes_ratio"] for c in mine]),
                    "tasks": len({c["task"] for c in mine}),
                }
    return {"cells": cells, "methods": methods}


def ruler_table(summary: dict) -> str:
    """A markdown table: per method and mode, the average accuracy, K/V bytes and TTFT ratios, then per task."""
    cells = summary["cells"]
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    head = "| method | mode | avg | KV ratio | " + " | ".join(tasks) + " |"
    lines = [head, "|" + "---|" * (4 + len(tasks))]
    for label, modes in summary["methods"].items():
        for mode, m in modes.items():
            per = []
            for t in tasks:
                accs = [c["accuracy"] for c in cells if c["method"] == label and c["mode"] == mode and c["task"] == t
                        and c["accuracy"] is not None]
                per.append(f"{sum(accs) / len(accs):.2f}" if accs else "-")
            kv = "-" if m["kv_bytes_ratio"] is None else f"{m['kv_bytes_ratio']:.2f}"
            lines.append(f"| {label} | {mode} | {m['accuracy']:.3f} | {kv} | " + " | ".join(per) + " |")
    return "\n".join(lines)


def write_plots(out: Path, summary: dict) -> list[Path]:
    """``heatmap_<mode>_<length>.png`` (tasks x methods) and ``pareto.png``; returns the paths."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = summary["cells"]
    labels = list(dict.fromkeys(c["method"] for c in cells))
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    paths = []
    for mode in dict.fromkeys(c["mode"] for c in cells):
        for length in dict.fromkeys(c["length"] for c in cells):
            grid = np.full((len(tasks), len(labels)), np.nan)
            for c in cells:
                if c["mode"] == mode and c["length"] == length and c["accuracy"] is not None:
                    grid[tasks.index(c["task"]), labels.index(c["method"])] = c["accuracy"]
            fig = Figure(figsize=(max(5.0, 2.5 + 1.1 * len(labels)), max(3.0, 1.2 + 0.4 * len(tasks))), dpi=100)
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
            ax.set_facecolor("#d0d0d0")
            image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
            for (y, x), v in np.ndenumerate(grid):
                ax.text(x, y, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
            ax.set_yticks(range(len(tasks)), tasks, fontsize=7)
            ax.set_title(f"RULER accuracy, {mode}, {length} tokens")
            fig.colorbar(image, ax=ax, label="accuracy")
            fig.tight_layout()
            paths.append(save_figure(fig, out / f"heatmap_{mode}_{length}.png"))
    fig = Figure(figsize=(6.5, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for mode, marker in zip(MODES, ("o", "s")):
        pts = [(m[mode]["kv_bytes_ratio"], m[mode]["accuracy"], label) for label, m in summary["methods"].items()
               if mode in m and m[mode]["kv_bytes_ratio"] is not None]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=mode)
            for x, y, label in pts:
                ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("K/V bytes held after prefill (ratio to full)")
    ax.set_ylabel("RULER average accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(save_figure(fig, out / "pareto.png"))
    return paths


def run_ruler(
    model,
    tokenizer,
    methods: Sequence,
    tasks: Sequence[str] = ("all",),
    lengths: Sequence[int] = (4096,),
    n: int = 10,
    *,
    mode: str = "both",
    seed: int = 0,
    haystack: str | None = None,
    qa_file=None,
    chat_template: bool = False,
    max_new_tokens: int | None = None,
    warmup: int = 1,
    out_dir=None,
    resume: bool = False,
    overwrite: bool = False,
    shared_prefill: bool = True,
    progress: bool | None = None,
    report=None,
) -> RulerResult:
    """Run a RULER sweep: every method (``full`` added when missing) on every (task, length, sample) in each query
    mode, through the sweep harness.

    Parameters
    ----------
    model, tokenizer
        A Hugging Face causal LM and its tokenizer.
    methods : sequence of str or KVMethod
        KV-cache method specs (``"snapkv:ratio=0.25"``).
    tasks : sequence of str
        Task names of :data:`mmaccel.data.ruler.TASKS`, ``all`` (the eleven synthetic ones, and the QA tasks with
        ``qa_file``) or ``niah``.
    lengths : sequence of int
        Prompt budgets in tokens.
    n : int
        Samples per task and length (sample ``i`` has seed ``seed + i``).
    mode : {"aware", "agnostic", "both"}
    haystack : str, optional
        Text of the essay haystack (default: the built-in prose).
    qa_file : path, optional
        SQuAD or HotpotQA JSON for ``qa_1`` / ``qa_2`` (:func:`mmaccel.data.ruler.load_qa_file`).
    chat_template : bool
        Whether the prompts are wrapped in the tokenizer's chat template (resolve it with
        :func:`mmaccel.data.haystack.resolve_chat_template`).
    max_new_tokens : int, optional
        Generated tokens per question; default each task's RULER length (128 for NIAH, 30 vt, 120 cwe, 50 fwe, 32
        QA).
    warmup : int
        Unrecorded warm-up runs per method and mode on a short prompt, once.
    out_dir, resume, overwrite
        The sweep folder and what to do when it is not empty (:func:`mmaccel.eval.sweep.check_out_dir`).
    shared_prefill : bool
        One full-attention prefill per prompt (aware) or per context (agnostic) for the methods that allow it.
    progress : bool or None
    report : callable ``(summary) -> None``, optional
        Called before ``summary.json`` is written (the CLI prints :func:`ruler_table`).

    Returns
    -------
    RulerResult

    Raises
    ------
    ValueError, FileNotFoundError
        Before any run: an unknown method, task or mode, a method that cannot run agnostic, a QA task without a QA
        file, a bad QA file, a length too small for a task, a bad ``out_dir``. A failed cell is a
        ``status="failed"`` record and the sweep goes on.
    """
    modes = resolve_modes(mode)
    methods = with_full(methods)
    resolved = resolve_methods(methods)
    check_agnostic(methods, modes)
    qa = load_qa_file(qa_file) if qa_file is not None else None
    names = resolve_tasks(tasks, qa_available=qa is not None)
    samples = build_samples(tokenizer, names, lengths, n, seed=seed, haystack=haystack, chat_template=chat_template,
                            qa=qa)
    warm = make_ruler_sample(tokenizer, "niah_single_1", 256, seed=seed, chat_template=chat_template)
    gen_kwargs = generation_kwargs(model, tokenizer, 0.0)
    labels = [label for _, label in resolved]
    config = {"methods": labels, "tasks": names, "lengths": [int(x) for x in lengths], "n": n, "modes": modes,
              "seed": seed, "haystack": "builtin" if haystack is None else "custom",
              "qa_file": None if qa_file is None else str(qa_file), "chat_template": chat_template,
              "max_new_tokens": max_new_tokens, "warmup": warmup, "shared_prefill": shared_prefill}
    cells = [Cell(label, key, {"task": s.task, "length": s.length, "index": s.seed - seed, "mode": md,
                               "sample_seed": s.seed},
                  group=f"shared-{md}" if shared_prefill and shares_prefill(method) else None, payload=(m, key, md))
             for m, (method, label) in enumerate(resolved) for key, s in samples.items() for md in modes]
    warmed: set = set()

    def new_tokens(sample: RulerSample) -> int:
        return max_new_tokens or sample.max_new_tokens

    def warm_up(ms: list[int], md: str) -> None:
        todo = [m for m in ms if (m, md) not in warmed]
        for _ in range(warmup if todo else 0):
            for m in todo:
                if md == "agnostic":
                    answer(model, compress(resolved[m][0], model, warm.context_ids), warm.queries[0].question_ids,
                           4, **gen_kwargs)
                else:
                    generate_measured(model, tokenizer, warm.input_ids(), method=resolved[m][0], max_new_tokens=4,
                                      repeats=1, warmup=0)
        warmed.update((m, md) for m in ms)

    def aware(ms: list[int], key: str) -> list[dict]:
        sample = samples[key]
        per_q = []
        for qi in range(len(sample.queries)):
            ids = sample.input_ids(qi)
            if len(ms) > 1:
                per_q.append(run_measured_group(model, tokenizer, ids, [resolved[m] for m in ms],
                                                max_new_tokens=new_tokens(sample), repeats=1, warmup=0))
            else:
                method, label = resolved[ms[0]]
                per_q.append([generate_measured(model, tokenizer, ids, method=method, label=label,
                                                max_new_tokens=new_tokens(sample), repeats=1, warmup=0)])
        out = []
        for j in range(len(ms)):
            rec = per_q[0][j]
            bad = next((r[j] for r in per_q if not r[j].ok), None)
            if bad is not None:
                rec.status, rec.error = "failed", bad.error
            out.append(_finish(rec, sample, key, "aware", seed, [r[j].output_text for r in per_q]))
        return out

    def agnostic(ms: list[int], key: str) -> list[dict]:
        sample = samples[key]
        out = []
        if len(ms) > 1:
            t0 = time.perf_counter()
            ctxs = compress_shared([resolved[m][0] for m in ms], model, sample.context_ids)
            shared_s = max(0.0, time.perf_counter() - t0 - sum(c.compress_s for c in ctxs))
            for m, ctx in zip(ms, ctxs):
                method, label = resolved[m]
                answers = [answer(model, ctx, q.question_ids, new_tokens(sample), **gen_kwargs)
                           for q in sample.queries]
                rec = _agnostic_record(model, tokenizer, label, method, sample, ctx, answers,
                                       prefill_s=shared_s + ctx.compress_s, peak=None, peak_method="unavailable")
                rec.extra.update(shared_prefill=True, shared_prefill_s=shared_s)
                out.append(_finish(rec, sample, key, "agnostic", seed, _texts(tokenizer, answers)))
            return out
        method, label = resolved[ms[0]]
        meter = PeakMemory(getattr(model, "device", torch.device("cpu")))
        with meter:
            t0 = time.perf_counter()
            ctx = compress(method, model, sample.context_ids)
            prefill_s = time.perf_counter() - t0
            answers = [answer(model, ctx, q.question_ids, new_tokens(sample), **gen_kwargs) for q in sample.queries]
        rec = _agnostic_record(model, tokenizer, label, method, sample, ctx, answers, prefill_s=prefill_s,
                               peak=meter.peak, peak_method=meter.method)
        return [_finish(rec, sample, key, "agnostic", seed, _texts(tokenizer, answers))]

    def run_group(group: list[Cell]) -> list[dict]:
        ms = [c.payload[0] for c in group]
        _, key, md = group[0].payload
        warm_up(ms, md)
        return (aware if md == "aware" else agnostic)(ms, key)

    def run(cell: Cell) -> dict:
        return run_group([cell])[0]

    def summarize_all(records: list[dict]) -> dict:
        summary = summarize(records)
        summary["config"] = dict(config)
        return summary

    result = sweep(cells, run, out=out_dir, resume=resume, overwrite=overwrite, summarize=summarize_all,
                   report=report, write_extra=lambda out, summary, records: write_plots(out, summary),
                   run_group=run_group, config=config, progress=progress, desc="ruler")
    return RulerResult(records=result.records, summary=result.summary, out_dir=result.out_dir)


def merge_ruler(in_dirs: Sequence, out, *, overwrite: bool = False) -> RulerResult:
    """One summary, heatmaps and Pareto plot from several RULER sweep folders (finished or still running), with their
    records gzipped (``results.jsonl.gz``).

    Sweeps of other methods on the same samples each hold their own ``full`` (it is always run); a cell found in
    several folders (same method, sample and mode) is taken from the first folder that has it, so ``full`` counts
    once. ``summary["sweep"]`` says how many of the folders' expected cells were found; ``summary["config"]`` is the
    first folder's, with ``merged_from`` and every folder's methods.

    Parameters
    ----------
    in_dirs : sequence of path
        ``mmaccel ruler --out`` folders; a torn last record of a running sweep is skipped.
    out : path
        A new or empty folder (or ``overwrite``), not one of ``in_dirs``.

    Returns
    -------
    RulerResult

    Raises
    ------
    FileNotFoundError
        A folder without ``results.jsonl`` (nor ``.gz``).
    ValueError
        ``out`` is one of ``in_dirs`` or not empty without ``overwrite``; the folders ran different samples (seed,
        chat template, haystack).
    """
    import gzip
    import json

    out = Path(out)
    if any(Path(d).resolve() == out.resolve() for d in in_dirs):
        raise ValueError(f"--out {str(out)!r} is one of the folders merged; pass another folder")
    check_out_dir(out, overwrite=overwrite)
    records: dict = {}
    expected: dict = {}
    configs = []
    for d in map(Path, in_dirs):
        path = next((d / n for n in (RESULTS, RESULTS + ".gz") if (d / n).is_file()), None)
        if path is None:
            raise FileNotFoundError(f"{d} holds no results.jsonl; pass folders written by `mmaccel ruler --out`")
        for r in read_records(path):
            records.setdefault(r.get("cell_id"), r)
        if (d / MANIFEST).is_file():
            manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
            expected.update(dict.fromkeys(manifest.get("cells", [])))
            configs.append(manifest.get("config", {}))
    same = {"seed", "chat_template", "haystack", "qa_file"}
    if len({json.dumps({k: c.get(k) for k in same}, sort_keys=True) for c in configs}) > 1:
        raise ValueError("the folders ran different samples (seed, chat template, haystack or QA file differ); "
                         "merge only sweeps of the same samples")
    rows = list(records.values())
    summary = summarize(rows)
    summary["config"] = {**(configs[0] if configs else {}), "merged_from": [str(d) for d in in_dirs],
                         "methods": list(dict.fromkeys(m for c in configs for m in c.get("methods", [])))}
    summary["sweep"] = sweep_block(len(expected) or len(rows), rows)
    write_atomic(out / "results.jsonl.gz", gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode(),
                                                         mtime=0))
    write_json(out / SUMMARY, summary)
    write_plots(out, summary)
    return RulerResult(records=rows, summary=summary, out_dir=out)
