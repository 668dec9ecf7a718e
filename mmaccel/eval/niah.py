"""Needle-in-a-Haystack sweeps over KV-cache methods: records, a summary and one heatmap per method.

Follows Needle-in-a-Haystack (Kamradt, 2023) and RULER's single-needle retrieval (Hsieh et al., 2024,
arXiv 2404.06654) for local Hugging Face causal LMs: a key-value fact is planted at a relative depth of a document of
a given token length, the question at the end asks for the value, and the answer is scored by exact match
(:func:`mmaccel.data.haystack.score_answer`). Every method sees exactly the same prompts.

Output folder
-------------
The sweep runs on :func:`mmaccel.eval.sweep.sweep`: methods interleaved per prompt, every record appended and
fsynced as it finishes, a non-empty folder refused unless ``resume`` (skip the finished cells) or ``overwrite``.

``results.jsonl``
    One :class:`~mmaccel.eval.generation.RunRecord` per (method, length, depth, trial), appended and fsynced as soon
    as it exists, so nothing is lost if a later run dies. ``cell_id`` names the cell; ``extra`` holds ``length``,
    ``depth``, ``trial``, ``sample_seed``, ``key``, ``answer``, ``needle_position``, ``chat_template``, ``correct``
    (strict: the first number of the answer is the needle; the headline) and ``correct_contains`` (the needle appears
    in the answer, kvpress's rule).
``sweep.json``
    The sweep's configuration and its cell ids (what ``--resume`` checks, what a merge expects).
``summary.json``
    Per method: overall accuracy (strict and contains); per length the same with medians of TTFT, tokens/s, peak
    memory, K/V bytes after prefill and the K/V ratio after prefill against ``full`` on the same prompts; and per
    length x depth cell the accuracy, counts and medians. ``"sweep"``: cells expected, found, failed, ``complete``.
``heatmap_<method>.png``
    Accuracy over length (x) x depth (y), one per method.

Sharded sweeps
--------------
Under ``accelerate launch`` (or ``torchrun``) with N > 1 processes, unit ``i`` of the interleaved cell list goes to
process ``i % N`` (:func:`~mmaccel.eval.sweep.shard_cells`). Every process builds the same list and the same documents
from the seed, appends its records to ``shard-{k}-of-{N}/results.jsonl``, waits for the others, and the main process
writes the files above, in the single-process order, so they equal a one-process run's except for timings and
``config["shards"]``. The output folder must be shared by the processes (one machine, or a shared file system).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..data.haystack import (  # noqa: F401 - check_haystack_file: re-exported
    NEEDLE_TEMPLATE,
    HaystackTokens,
    NIAHLengthError,
    NIAHSample,
    check_haystack_file,
    make_niah_sample,
    min_niah_length,
    resolve_chat_template,
    score_answer,
    score_answer_contains,
)
from ..pipeline import resolve_methods
from .generation import generate_measured, median_or_none
from .memory import check_cpu_meter
from .sweep import (  # noqa: F401 - process_state, shard_cells, shard_dir, BARRIER_TIMEOUT: re-exported
    BARRIER_TIMEOUT,
    Cell,
    merge_sweeps,
    process_state,
    run_measured_group,
    save_figure,
    shard_cells,
    shard_dir,
    shares_prefill,
    sweep,
)
from .sweep import (
    read_sweeps as _read_sweep_dirs,
)

logger = logging.getLogger(__name__)

_MEDIAN_FIELDS = {
    "ttft_s": "ttft_s",
    "tokens_per_s": "tokens_per_s",
    "peak_memory_bytes": "peak_memory_bytes",
    "kv_cache_bytes": "kv_cache_bytes_final",
}


def load_haystack(tokenizer, haystack=None, min_tokens: int | None = None) -> HaystackTokens | None:
    """Resolve ``haystack`` into token ids.

    Parameters
    ----------
    haystack : None, str, os.PathLike or HaystackTokens
        ``None``: the built-in held-out prose (returns ``None``, so the shared default is used). A path: a UTF-8 text
        file of at most :data:`~mmaccel.data.haystack.MAX_HAYSTACK_BYTES` (64 MiB).
    min_tokens : int, optional
        The longest prompt's length: only the file's prefix that holds it is read and tokenized
        (:meth:`HaystackTokens.from_file`), so a long file costs what the sweep needs. Default: the whole file.

    Raises
    ------
    FileNotFoundError
        If the haystack file does not exist.
    IsADirectoryError
        If it is a directory.
    ValueError
        If the file holds no text, is binary or not UTF-8, is not a regular file, or is over the size cap.
    """
    if haystack is None or isinstance(haystack, HaystackTokens):
        return haystack
    return HaystackTokens.from_file(tokenizer, haystack, min_tokens)


def check_templates(needle_template: str, question_template: str) -> None:
    """Check that the needle names ``{key}`` and ``{value}`` and the question names ``{key}`` (and not the value).

    Raises
    ------
    ValueError
        With the template that is wrong and what it must contain.
    """
    for name, template, need in (("needle", needle_template, ("{key}", "{value}")), ("question", question_template,
                                                                                       ("{key}",))):
        missing = [p for p in need if p not in template]
        if missing:
            raise ValueError(f"the {name} template {template!r} must contain {' and '.join(missing)}")
    if "{value}" in question_template:
        raise ValueError(f"the question template {question_template!r} must not contain the answer ({{value}})")


def build_samples(
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    *,
    seed: int = 0,
    haystack=None,
    needle_template: str = NEEDLE_TEMPLATE,
    question_template: str | None = None,
    chat_template: bool = False,
) -> list[tuple[int, NIAHSample]]:
    """All NIAH prompts of a sweep, built (and so validated) before any run.

    Trial ``t`` uses sample seed ``seed + t``; the same arguments give the same prompts. ``chat_template`` wraps each
    prompt in the tokenizer's chat template (:func:`~mmaccel.data.haystack.make_niah_sample`).

    Returns
    -------
    list of (trial, NIAHSample)
        In length, depth, trial order.

    Raises
    ------
    ValueError
        For ``trials < 1``, an empty or non-positive length list, a depth outside [0, 1], a length too small for the
        needle and question (:class:`~mmaccel.data.haystack.NIAHLengthError`: the message gives a length that holds
        every depth and trial), a bad template, or a haystack file that is binary, not UTF-8 or over 64 MiB.
    FileNotFoundError, IsADirectoryError
        If ``haystack`` names a missing file, or a directory.
    """
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if not lengths or any(int(n) < 1 for n in lengths):
        raise ValueError(f"lengths must be positive token counts, got {list(lengths)}")
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise ValueError(f"depths must be fractions in [0, 1], got {list(depths)}")
    if question_template is not None:
        check_templates(needle_template, question_template)
    else:
        check_templates(needle_template, "{key}")
    hay = load_haystack(tokenizer, haystack, max(int(n) for n in lengths) + 1)
    try:
        return [
            (
                trial,
                make_niah_sample(
                    tokenizer,
                    int(length),
                    float(depth),
                    seed=seed + trial,
                    haystack=hay,
                    needle_template=needle_template,
                    question_template=question_template,
                    chat_template=chat_template,
                ),
            )
            for length in lengths
            for depth in depths
            for trial in range(trials)
        ]
    except NIAHLengthError as exc:  # advise a length that holds every depth and trial of the sweep, not just one
        minimum = min_niah_length(tokenizer, [float(d) for d in depths], [seed + t for t in range(trials)],
                                  start=exc.length + 1, needle_template=needle_template,
                                  question_template=question_template, chat_template=chat_template)
        raise NIAHLengthError(exc.length, exc.fixed, minimum) from None


def check_samples(samples: Sequence, lengths: Sequence[int], depths: Sequence[float], trials: int, *,
                  chat_template: bool) -> list[tuple[int, NIAHSample]]:
    """Check prebuilt prompts against a sweep's arguments: exactly one ``(trial, NIAHSample)`` per (length, depth,
    trial), in :func:`build_samples`' order, laid out with the sweep's chat-template setting.

    Returns
    -------
    list of (trial, NIAHSample)

    Raises
    ------
    ValueError
        Naming the first mismatch and the fix (build them with ``build_samples`` and the same arguments).
    """
    expected = [(int(n), float(d), t) for n in lengths for d in depths for t in range(trials)]
    samples = list(samples)
    fix = "; build them with build_samples(...) and the same lengths, depths, trials and chat template"
    if len(samples) != len(expected):
        raise ValueError(f"samples holds {len(samples)} prompts, the sweep needs {len(expected)} "
                         f"(lengths x depths x trials){fix}")
    for i, (item, (length, depth, trial)) in enumerate(zip(samples, expected)):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], NIAHSample)):
            raise ValueError(f"samples[{i}] is not a (trial, NIAHSample) pair{fix}")
        t, sample = item
        if (sample.length, sample.depth, t) != (length, depth, trial):
            raise ValueError(f"samples[{i}] is (length {sample.length}, depth {sample.depth:g}, trial {t}), the sweep "
                             f"expects (length {length}, depth {depth:g}, trial {trial}) there{fix}")
        if bool(sample.chat_template) != bool(chat_template):
            raise ValueError(f"samples[{i}] was built with chat_template={sample.chat_template}, the sweep runs with "
                             f"{bool(chat_template)}{fix}")
    return [(int(t), sample) for t, sample in samples]


@dataclass
class NIAHResult:
    """The outcome of :func:`run_niah`.

    Attributes
    ----------
    records : list of dict
        ``RunRecord.to_dict()`` per run, as in ``results.jsonl``.
    summary : dict
        As in ``summary.json``.
    out_dir : pathlib.Path or None
    heatmaps : dict
        Method label -> PNG path.
    process_index, num_processes : int
        This process and the number of processes of a sharded sweep (``0`` and ``1`` for one process). In a sharded
        sweep the main process (index 0) holds the merged records and summary; the others hold their shard's, and
        their ``out_dir`` is the shard folder.
    """

    records: list
    summary: dict
    out_dir: Path | None = None
    heatmaps: dict = field(default_factory=dict)
    process_index: int = 0
    num_processes: int = 1

    def accuracy(self, method: str) -> float | None:
        """Overall accuracy of one method over its successful runs (``None`` if none succeeded)."""
        return self.summary["methods"][method]["accuracy"]


def _accuracy(rows: list[dict], key: str = "correct") -> float | None:
    ok = [r for r in rows if r["status"] == "ok"]
    return sum(bool(r["extra"].get(key)) for r in ok) / len(ok) if ok else None


def _kv_ratios_prefill(records: list[dict]) -> dict[tuple, float]:
    """Per (method, length, depth, trial): K/V bytes after prefill over ``full``'s on the same prompt."""
    def key(r):
        return r["extra"]["length"], r["extra"]["depth"], r["extra"].get("trial")

    full = {
        key(r): r["kv_cache_bytes_prefill"]
        for r in records if r.get("method_name") == "full" and r["status"] == "ok" and r.get("kv_cache_bytes_prefill")
    }
    out = {}
    for r in records:
        if r["status"] == "ok" and key(r) in full and r.get("kv_cache_bytes_prefill") is not None:
            out[(r["method"], *key(r))] = r["kv_cache_bytes_prefill"] / full[key(r)]
    return out


def summarize(records: list[dict], lengths: Sequence[int], depths: Sequence[float]) -> dict:
    """Aggregate NIAH records per method, per length, and per length x depth cell.

    Accuracy is the fraction of *successful* runs that answered correctly (``None`` where every run failed); failed
    runs are counted separately in ``failed``. ``accuracy`` is strict (first number = needle), ``accuracy_contains``
    the lenient rule. ``kv_ratio_prefill`` is the median, over the prompts, of the method's K/V bytes after prefill
    divided by ``full``'s on the same prompt (``None`` when the sweep has no ``full``).

    Returns
    -------
    dict
        ``{"methods": {label: {"accuracy", "accuracy_contains", "n", "failed", "by_length": [{"length", "accuracy",
        "accuracy_contains", "n", "failed", "kv_ratio_prefill", "median_kv_cache_bytes_prefill", "median_ttft_s",
        "median_tokens_per_s", "median_peak_memory_bytes"}], "cells": [{"length", "depth", "accuracy",
        "accuracy_contains", "n", "failed", "median_ttft_s", "median_tokens_per_s", "median_peak_memory_bytes",
        "median_kv_cache_bytes"}]}}}``
    """
    ratios = _kv_ratios_prefill(records)
    methods: dict[str, dict] = {}
    labels = list(dict.fromkeys(r["method"] for r in records))
    for label in labels:
        mine = [r for r in records if r["method"] == label]
        cells, by_length = [], []
        for length in lengths:
            at_len = [r for r in mine if r["extra"]["length"] == length]
            ok = [r for r in at_len if r["status"] == "ok"]
            by_length.append({
                "length": length,
                "accuracy": _accuracy(at_len),
                "accuracy_contains": _accuracy(at_len, "correct_contains"),
                "n": len(ok),
                "failed": len(at_len) - len(ok),
                "kv_ratio_prefill": median_or_none([
                    ratios.get((label, r["extra"]["length"], r["extra"]["depth"], r["extra"].get("trial"))) for r in ok
                ]),
                "median_kv_cache_bytes_prefill": median_or_none([r.get("kv_cache_bytes_prefill") for r in ok]),
                "median_ttft_s": median_or_none([r["ttft_s"] for r in ok]),
                "median_tokens_per_s": median_or_none([r["tokens_per_s"] for r in ok]),
                "median_peak_memory_bytes": median_or_none([r["peak_memory_bytes"] for r in ok]),
            })
            for depth in depths:
                cell = [r for r in at_len if r["extra"]["depth"] == depth]
                ok = [r for r in cell if r["status"] == "ok"]
                entry = {
                    "length": length,
                    "depth": depth,
                    "accuracy": _accuracy(cell),
                    "accuracy_contains": _accuracy(cell, "correct_contains"),
                    "n": len(ok),
                    "failed": len(cell) - len(ok),
                }
                for name, key in _MEDIAN_FIELDS.items():
                    entry[f"median_{name}"] = median_or_none([r[key] for r in ok])
                cells.append(entry)
        ok = [r for r in mine if r["status"] == "ok"]
        methods[label] = {
            "accuracy": _accuracy(mine),
            "accuracy_contains": _accuracy(mine, "correct_contains"),
            "n": len(ok),
            "failed": len(mine) - len(ok),
            "by_length": by_length,
            "cells": cells,
        }
    return {"methods": methods}


def safe_label(label: str) -> str:
    """A file-name-safe version of a method label (``snapkv:budget=256`` -> ``snapkv_budget-256``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label.replace("=", "-")).strip("_") or "method"


def plot_heatmap(cells: list[dict], lengths: Sequence[int], depths: Sequence[float], title: str, path) -> Path:
    """Draw accuracy over length (x) x depth (y) as a PNG, each cell annotated; cells whose runs all failed, or that
    were not run (a merged sweep), are grey and say so.

    Parameters
    ----------
    cells : list of dict
        ``summary["methods"][label]["cells"]``.
    path : str or os.PathLike
        Output PNG.

    Returns
    -------
    pathlib.Path
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5.0, 1.8 + 0.9 * len(lengths)), max(3.0, 1.4 + 0.5 * len(depths))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    fig.colorbar(draw_heatmap(ax, cells, lengths, depths, title), ax=ax, label="accuracy")
    fig.tight_layout()
    return save_figure(fig, path)


def draw_heatmap(ax, cells: list[dict], lengths: Sequence[int], depths: Sequence[float], title: str):
    """Draw the accuracy heatmap of :func:`plot_heatmap` into a matplotlib ``ax``; return the image (for a
    colorbar). Cells whose runs all failed, or that were not run, are grey and say so."""
    import numpy as np

    grid = np.full((len(depths), len(lengths)), np.nan)
    for c in cells:
        if c["accuracy"] is not None:
            grid[list(depths).index(c["depth"]), list(lengths).index(c["length"])] = c["accuracy"]
    ax.set_facecolor("#d0d0d0")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for c in cells:
        y, x = list(depths).index(c["depth"]), list(lengths).index(c["length"])
        if c["accuracy"] is not None:
            text = f"{c['accuracy']:.2f}"
        else:
            text = "failed" if c.get("failed") else "not run"
        ax.text(x, y, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    return image


WARMUP_TOKENS = 256


def warmup_sample(tokenizer, *, seed: int = 0, chat_template: bool = False, haystack=None,
                  needle_template: str = NEEDLE_TEMPLATE, question_template: str | None = None) -> NIAHSample:
    """A short NIAH prompt (:data:`WARMUP_TOKENS` tokens) laid out like the real ones, for warm-up runs."""
    return make_niah_sample(tokenizer, WARMUP_TOKENS, 0.5, seed=seed,
                            haystack=load_haystack(tokenizer, haystack, WARMUP_TOKENS + 1),
                            needle_template=needle_template, question_template=question_template,
                            chat_template=chat_template)


def _forward_flops(config, length: int) -> float:
    """Approximate forward FLOPs of a decoder over ``length`` tokens: 2 x params x tokens + causal attention."""
    hidden = getattr(config, "hidden_size", 0) or 0
    layers = getattr(config, "num_hidden_layers", 0) or 0
    inter = getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden
    params = layers * (4 * hidden * hidden + 3 * hidden * inter)
    return 2.0 * params * length + 2.0 * layers * hidden * length * length


def estimate_sweep_seconds(model, tokenizer, lengths: Sequence[int], runs_per_length: int, *,
                           max_new_tokens: int, chat_template: bool = False) -> dict:
    """Estimate how long a NIAH sweep takes on this machine, from one timed short prompt.

    A :data:`WARMUP_TOKENS`-token prompt is generated once untimed and once timed (4 new tokens); its prefill time is
    scaled by the decoder's forward FLOPs at each length (linear layers plus the quadratic causal attention) and its
    per-token decode time by the bytes read per step. It is a rough guide, printed before a long sweep.

    Returns
    -------
    dict
        ``{"runs", "estimated_s", "calibration": {"tokens", "ttft_s", "decode_s_per_token"}}`` (seconds).
    """
    sample = warmup_sample(tokenizer, chat_template=chat_template)
    rec = generate_measured(model, tokenizer, sample.input_ids, max_new_tokens=4, warmup=1, repeats=1)
    config = getattr(model, "config", None)
    if not rec.ok or rec.ttft_s is None or config is None:
        return {"runs": runs_per_length * len(lengths), "estimated_s": None, "calibration": {}}
    per_tok = (1.0 / rec.tokens_per_s) if rec.tokens_per_s else rec.ttft_s / WARMUP_TOKENS
    base = _forward_flops(config, WARMUP_TOKENS)
    hidden = getattr(config, "hidden_size", 1)
    layers = getattr(config, "num_hidden_layers", 1)
    step_base = _forward_flops(config, 1) + 4.0 * layers * hidden * WARMUP_TOKENS
    total = 0.0
    for n in lengths:
        prefill = rec.ttft_s * _forward_flops(config, n) / base
        decode = max_new_tokens * per_tok * (_forward_flops(config, 1) + 4.0 * layers * hidden * n) / step_base
        total += runs_per_length * (prefill + decode)
    return {
        "runs": runs_per_length * len(lengths),
        "estimated_s": total,
        "calibration": {"tokens": WARMUP_TOKENS, "ttft_s": rec.ttft_s, "decode_s_per_token": per_tok},
    }


def _cell_key(record: dict) -> tuple:
    """(method label, length, depth, trial) of a record: what identifies a cell of a sweep."""
    return record["method"], record["extra"]["length"], record["extra"]["depth"], record["extra"].get("trial")


def _write_heatmaps(out: Path, summary: dict, labels: Sequence[str], lengths: Sequence[int],
                    depths: Sequence[float]) -> dict:
    """One heatmap per label, each written atomically; returns label -> path."""
    return {label: plot_heatmap(summary["methods"][label]["cells"], lengths, depths, f"NIAH accuracy: {label}",
                                out / f"heatmap_{safe_label(label)}.png")
            for label in labels if label in summary["methods"]}


def read_sweeps(in_dirs: Sequence) -> tuple[list[dict], list[dict]]:
    """Records and ``summary.json`` configs of several sweep folders, in the order given (``results.jsonl`` or
    ``results.jsonl.gz``; a torn last line is skipped with a warning naming the file).

    Raises
    ------
    FileNotFoundError
        If a folder has no ``results.jsonl``.
    ValueError
        If a method label appears in two sweeps for the same (length, depth, trial).
    """
    merged = _read_sweep_dirs(in_dirs, key=_cell_key)
    return merged.records, merged.configs


def _sample_id(sample: NIAHSample, trial: int) -> str:
    return f"L={sample.length}/d={sample.depth:g}/t={trial}"


def niah_cells(labels: Sequence[str], lengths: Sequence[int], depths: Sequence[float], trials: int, *,
               seed: int = 0) -> list[Cell]:
    """The cells of a NIAH sweep, method-major (method, length, depth, trial), without payloads: what a sweep with
    these arguments expects (:func:`merge_results` counts them)."""
    return [Cell(label, f"L={int(n)}/d={float(d):g}/t={t}",
                 {"length": int(n), "depth": float(d), "trial": t, "sample_seed": seed + t})
            for label in labels for n in lengths for d in depths for t in range(trials)]


def run_niah(
    model,
    tokenizer,
    methods: Sequence,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    *,
    seed: int = 0,
    haystack=None,
    needle_template: str = NEEDLE_TEMPLATE,
    question_template: str | None = None,
    chat_template: str | bool = "auto",
    max_new_tokens: int = 32,
    repeats: int = 1,
    warmup: int = 1,
    out_dir=None,
    progress: bool | None = True,
    state=None,
    memory_meter: str = "rss",
    resume: bool = False,
    overwrite: bool = False,
    shared_prefill: bool = True,
    report=None,
    samples: Sequence[tuple[int, NIAHSample]] | None = None,
) -> NIAHResult:
    """Run a NIAH sweep: every method on every (length, depth, trial) prompt through the sweep harness
    (:func:`mmaccel.eval.sweep.sweep`: methods interleaved per prompt, records appended and fsynced as they finish,
    resumable), sharded over processes when launched with ``accelerate launch`` (see the module docstring).

    Parameters
    ----------
    model, tokenizer
        Any Hugging Face causal LM and its tokenizer.
    methods : sequence of str or KVMethod
        Specs such as ``["full", "snapkv:budget=256", "streaming:window=256"]``.
    lengths : sequence of int
        Prompt lengths in tokens.
    depths : sequence of float
        Needle depths in [0, 1].
    trials : int
        Prompts per (length, depth); trial ``t`` uses sample seed ``seed + t``.
    haystack : None, path or HaystackTokens
        Default: the built-in held-out prose; a path: any UTF-8 text file.
    needle_template, question_template : str
        Format strings with ``{key}`` and ``{value}`` (question: ``{key}`` only). Default question: a sentence to
        complete for plain prompts, a question for chat prompts.
    chat_template : {"auto", "on", "off"} or bool
        Whether prompts go through the tokenizer's chat template (``"auto"``: when it has one, as instruct models
        do); recorded in each record's ``extra["chat_template"]``.
    max_new_tokens : int
        Tokens generated per run (default 32, room for an instruct model's "The secret number of ... is" preamble).
    repeats, warmup : int
        Passed to :func:`~mmaccel.eval.generation.generate_measured`; ``warmup`` runs happen once per method (and per
        process in a sharded sweep), on a short prompt (:func:`warmup_sample`), not on a copy of the long one and not
        before every trial.
    out_dir : path, optional
        Where ``results.jsonl``, ``sweep.json``, ``summary.json`` and the heatmaps go; nothing is written when
        ``None``. A sharded sweep also writes ``shard-{k}-of-{N}/`` there; every process must see the same folder.
    progress : bool or None
        Show a tqdm progress bar (``None``: only on a terminal).
    memory_meter : {"rss", "allocator"}
        How ``peak_memory_bytes`` is measured off CUDA (:func:`~mmaccel.eval.generation.generate_measured`): the
        sampled RSS (default) or torch's exact CPU allocations under the profiler (comparable across runs and
        processes; the profiler's per-op cost is inside the timings).
    state : accelerate.PartialState, optional
        The processes to shard over; default :func:`process_state` for the model's device. One process (no
        ``accelerate launch``, or ``--num_processes 1``) runs every cell, exactly as without accelerate.
    resume, overwrite : bool
        A non-empty ``out_dir`` is refused unless one is set: ``resume`` skips the prompts already in
        ``results.jsonl`` and runs the rest; ``overwrite`` replaces the old files once the first new record is
        written (:func:`mmaccel.eval.sweep.check_out_dir`).
    shared_prefill : bool
        Run the KV methods that only compress after a full prefill (``shares_prefill``) as one group per prompt
        with one shared prefill, when ``mmaccel.eval.shared`` is installed (not with ``memory_meter="allocator"``,
        which needs separate runs); ``False`` runs every method separately.
    report : callable ``(summary) -> None``, optional
        Called before ``summary.json`` and the heatmaps are written (the CLI prints its table there).
    samples : list of (trial, NIAHSample), optional
        The prompts, already built by :func:`build_samples` with these arguments (a caller that built them to
        check its input first need not tokenize the haystack twice). Default: built here.

    Returns
    -------
    NIAHResult

    Raises
    ------
    ValueError, FileNotFoundError
        Configuration errors, all before the first run and before any file is touched: an unknown method or bad
        method arguments, bad lengths/depths/trials, a length too small for the needle, bad templates,
        ``chat_template="on"`` for a tokenizer without one, a missing haystack file, ``samples`` that are not
        one per (length, depth, trial) of the arguments (:func:`check_samples`), a sharded sweep without
        ``out_dir``, a non-empty ``out_dir`` without ``resume``/``overwrite``, resuming a folder of another sweep.
        Failures of single runs (e.g. out of memory) are recorded as ``status="failed"`` and the sweep goes on.
    RuntimeError
        In a sharded sweep, if the shard files the main process reads back do not hold every cell (e.g. another
        sweep wrote into the same folder at the same time).
    """
    resolved = resolve_methods(methods)
    check_cpu_meter(memory_meter, "memory_meter")
    use_chat = resolve_chat_template(tokenizer, chat_template)
    if samples is None:
        samples = build_samples(
            tokenizer, lengths, depths, trials, seed=seed, haystack=haystack,
            needle_template=needle_template, question_template=question_template, chat_template=use_chat,
        )
    else:
        samples = check_samples(samples, lengths, depths, trials, chat_template=use_chat)
    warm = warmup_sample(tokenizer, seed=seed, chat_template=use_chat, haystack=haystack,
                         needle_template=needle_template, question_template=question_template)
    lengths, depths = [int(n) for n in lengths], [float(d) for d in depths]
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_pos and max(lengths) + max_new_tokens > max_pos:
        logger.warning("lengths up to %d exceed the model's max_position_embeddings=%d", max(lengths), max_pos)
    if state is None:
        state = process_state(getattr(model, "device", "cpu"))
    n_proc = state.num_processes
    if n_proc > 1 and out_dir is None:
        raise ValueError(f"a sweep sharded over {n_proc} processes needs out_dir (a folder every process can see), "
                         "where the shards are merged")

    labels = [label for _, label in resolved]
    config = {
        "methods": labels,
        "lengths": lengths,
        "depths": depths,
        "trials": trials,
        "seed": seed,
        "haystack": "builtin" if haystack is None else "custom" if isinstance(haystack, HaystackTokens) else str(
            haystack),
        "needle_template": needle_template,
        "question_template": question_template or "default",
        "chat_template": use_chat,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "warmup": warmup,
        "memory_meter": memory_meter,
    }
    share = shared_prefill and memory_meter == "rss"  # the shared runner has no allocator meter
    # (method, length, depth, trial), method-major; the harness interleaves the methods per prompt.
    cells = [
        Cell(label, _sample_id(sample, trial),
             {"length": sample.length, "depth": sample.depth, "trial": trial, "sample_seed": seed + trial},
             group="shared-prefill" if share and shares_prefill(method) else None, payload=(m, s))
        for m, (method, label) in enumerate(resolved) for s, (trial, sample) in enumerate(samples)
    ]
    warmed: set[int] = set()

    def finish(rec, trial: int, sample: NIAHSample) -> dict:
        rec.extra.update(
            length=sample.length, depth=sample.depth, trial=trial, sample_seed=seed + trial, key=sample.key,
            answer=sample.answer, needle_position=sample.needle_position, chat_template=use_chat,
            correct=rec.ok and score_answer(rec.output_text, sample.answer),
            correct_contains=rec.ok and score_answer_contains(rec.output_text, sample.answer),
        )
        return rec.to_dict()

    def run(cell: Cell) -> dict:
        m, s = cell.payload
        (method, label), (trial, sample) = resolved[m], samples[s]
        rec = generate_measured(
            model, tokenizer, sample.input_ids, method=method, label=label, max_new_tokens=max_new_tokens,
            repeats=repeats, warmup=0 if m in warmed else warmup, warmup_ids=warm.input_ids,
            memory_meter=memory_meter,
        )
        warmed.add(m)
        return finish(rec, trial, sample)

    def run_group(group: list[Cell]) -> list[dict]:
        ms = [c.payload[0] for c in group]
        trial, sample = samples[group[0].payload[1]]
        recs = run_measured_group(
            model, tokenizer, sample.input_ids, [resolved[m] for m in ms], max_new_tokens=max_new_tokens,
            repeats=repeats, warmup=0 if all(m in warmed for m in ms) else warmup, warmup_ids=warm.input_ids,
        )
        warmed.update(ms)
        return [finish(rec, trial, sample) for rec in recs]

    def summarize_all(records: list[dict]) -> dict:
        summary = summarize(records, lengths, depths)
        summary["config"] = dict(config)
        if n_proc > 1:
            summary["config"]["shards"] = [str(shard_dir(out_dir, k, n_proc)) for k in range(n_proc)]
        return summary

    heatmaps: dict = {}

    def write_extra(out: Path, summary: dict, records: list[dict]) -> None:
        heatmaps.update(_write_heatmaps(out, summary, labels, lengths, depths))

    desc = "niah"
    result = sweep(cells, run, out=out_dir, resume=resume, overwrite=overwrite, summarize=summarize_all,
                   report=report, write_extra=write_extra, run_group=run_group, config=config, state=state,
                   progress=progress, desc=desc)
    if result.summary is None:  # a non-main process of a sharded sweep: its shard's records only
        shard_summary = summarize(result.records, lengths, depths)
        shard_summary["config"] = {**config, "shard": [result.process_index, n_proc]}
        return NIAHResult(records=result.records, summary=shard_summary, out_dir=result.out_dir,
                          process_index=result.process_index, num_processes=n_proc)
    if out_dir is not None:
        logger.info("wrote %s (%d cells run, %d resumed)", out_dir, result.ran, result.skipped)
    return NIAHResult(records=result.records, summary=result.summary, out_dir=result.out_dir, heatmaps=heatmaps,
                      process_index=result.process_index, num_processes=n_proc)


def merge_results(in_dirs: Sequence, out_dir, *, report=None, overwrite: bool = False) -> NIAHResult:
    """Merge the records of several NIAH sweeps (e.g. methods run in separate processes) into one folder.

    Records (``results.jsonl`` or ``results.jsonl.gz``; a torn last line is skipped with a warning naming the file)
    are concatenated in the order given; ``summary.json`` (with K/V ratios against ``full`` on the same prompts,
    wherever ``full`` ran in any of the sweeps) and one heatmap per method are written anew, atomically. The
    summary's ``"sweep"`` block says whether the merge is complete: the cells expected are those of every input's
    ``config`` (methods x lengths x depths x trials), the cells found those with a record; ``complete`` is
    ``False`` (and a warning is logged) when some are missing.

    Parameters
    ----------
    in_dirs : sequence of path
        Folders holding ``results.jsonl`` (and ``summary.json``, whose ``config`` is merged).
    out_dir : path
        Output folder (may be one of ``in_dirs``' parents, not one of them).
    report : callable ``(summary) -> None``, optional
        Called before anything is written (e.g. to print the table).
    overwrite : bool
        Replace the sweep files of a non-empty ``out_dir`` (refused otherwise).

    Raises
    ------
    FileNotFoundError
        If a folder has no ``results.jsonl``.
    ValueError
        If a method label appears in two sweeps for the same (length, depth, trial); ``out_dir`` is one of
        ``in_dirs``, a file, unwritable, or not empty without ``overwrite``.
    """
    records, configs = read_sweeps(in_dirs)
    lengths = sorted({r["extra"]["length"] for r in records} | {n for c in configs for n in c.get("lengths", [])})
    depths = sorted({r["extra"]["depth"] for r in records} | {d for c in configs for d in c.get("depths", [])})
    expected = {_cell_key(r) for r in records}
    for c in configs:
        if all(k in c for k in ("methods", "lengths", "depths", "trials")):
            expected |= {(label, int(n), float(d), t) for label in c["methods"] for n in c["lengths"]
                         for d in c["depths"] for t in range(int(c["trials"]))}
    config = dict(configs[0]) if configs else {}
    config.pop("shard", None)
    config.pop("shards", None)
    heatmaps: dict = {}

    def summarize_all(rows: list[dict]) -> dict:
        summary = summarize(rows, lengths, depths)
        config.update(methods=list(summary["methods"]), lengths=lengths, depths=depths,
                      merged_from=[str(d) for d in in_dirs])
        summary["config"] = config
        return summary

    def write_extra(out: Path, summary: dict, rows: list[dict]) -> None:
        heatmaps.update(_write_heatmaps(out, summary, list(summary["methods"]), lengths, depths))

    summary, merged = merge_sweeps(in_dirs, out_dir, summarize=summarize_all, expected=len(expected), key=_cell_key,
                                   report=report, write_extra=write_extra, overwrite=overwrite)
    return NIAHResult(records=merged, summary=summary, out_dir=Path(out_dir), heatmaps=heatmaps)
