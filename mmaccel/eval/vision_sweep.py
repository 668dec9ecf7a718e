"""Accuracy against visual-token budget: every visual-token method at every budget on held-out scene QA.

``mmaccel vision-sweep --model smol-llava --methods pooling visionzip fastv --budgets 1.0 0.5 0.25 0.1 --n 200``
and :func:`vision_sweep`. The questions are the held-out test split of :func:`mmaccel.data.scenes.make_scene_qa`
(CLEVR-style scenes, one-word answers), asked with ``smol-llava``'s training prompt and scored by its rule (first
word equals the answer; :mod:`mmaccel.eval.visual`). Per question, the full-token baseline and every (method,
budget) cell run in turn, in the same process, each through the one measured path
(:func:`~mmaccel.eval.generation.generate_measured`, ``vision=`` the method at ``keep_ratio=budget``, greedy), so a
load spike on a shared machine hits them alike. The plain pooling baseline is always in the sweep (VTC-Bench, Liao et
al., 2025: simple downsampling beats many compression methods).

Estimated FLOPs
---------------
The prefill FLOPs of the language model, per decoder layer ``i`` that sees ``L_i`` tokens::

    FLOPs = sum_i ( 2 * P_i * L_i  +  2 * L_i**2 * d_attn )

``P_i`` is the layer's parameter count (a multiply-add per parameter per token), ``d_attn = heads * head_dim`` and
``2 * L**2 * d_attn`` is causal attention (``QK^T`` and ``AV``, each ``L**2 / 2`` dot products of length ``d_attn``
at 2 FLOPs per multiply-add). Pre-LLM methods (pooling, VisionZip, PruMerge, ToMe's LLM side) shorten every layer's
``L``; FastV at layer ``K`` keeps ``L`` in layers ``< K`` (a multi-stage in-LLM schedule cuts at each of its layers;
:meth:`PrefillCost.tokens_per_layer`). Embeddings, the LM head (one position at prefill) and the
vision tower are left out (ToMe also saves tower FLOPs, not counted). ``flops_ratio`` is a cell's estimate over the
baseline's on the same question.

Output folder
-------------
``results.jsonl``
    One :class:`~mmaccel.eval.generation.RunRecord` per (question, cell), written as it exists; ``extra`` holds
    ``cell`` (``"baseline"`` or the method's label), ``budget``, ``question_index``, ``kind``, ``question``,
    ``answer``, ``correct``, ``visual_tokens_input``, ``lm_prefill_flops``, ``flops_ratio``, ``same_as_baseline``.
    A run that raised is recorded with ``status="failed"`` and its error, and the sweep goes on.
``summary.json``
    ``config``; ``baseline``; ``cells``: per (method, budget) the accuracy, kept visual tokens, the medians of the
    vision-encoder, prefill, TTFT and decode seconds, ``prefill_speedup`` and ``ttft_speedup`` (the baseline's median
    over the cell's), ``flops_ratio``, ``agreement`` (answers identical to the baseline's) and accuracy by question
    kind.
``accuracy_vs_budget.png``
    Accuracy against budget, one line per method (the baseline dashed), beside the prefill speedup.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..specs import MethodSpec, parse_method_spec
from .generation import generate_measured, median_or_none
from .niah import _accuracy
from .visual import chat_inputs, check_vlm_processor, image_token_count, score

logger = logging.getLogger(__name__)

BASELINE = "baseline"
#: the plain downsampling baseline every sweep includes
POOLING = "pooling"
"""Label of the full-token run every cell is compared with."""
DEFAULT_METHODS = ("pooling", "visionzip", "fastv")
DEFAULT_BUDGETS = (1.0, 0.5, 0.25, 0.1)
PLOT_FILE = "accuracy_vs_budget.png"


def check_budget(value) -> float:
    """A budget (fraction of visual tokens kept) as a float in (0, 1].

    Raises
    ------
    ValueError
        If it is not a number in (0, 1].
    """
    from ..vision_tokens import check_keep_ratio

    return check_keep_ratio(value, "budget")


@dataclass
class Cell:
    """One (method, budget) of a sweep.

    Attributes
    ----------
    method : str
        The method as given (``"fastv:layer=3"``; an object's registry name).
    budget : float
        Its ``keep_ratio``.
    label : str
        The records' ``method``: the spec with the budget (``"fastv:layer=3:keep_ratio=0.25"``).
    vision : VisionTokenMethod or None
        ``None`` for the baseline.
    """

    method: str
    budget: float
    label: str
    vision: object = None


def build_cells(methods: Sequence, budgets: Sequence[float]) -> list[Cell]:
    """Every (method, budget) cell, pooling first when ``methods`` does not name it.

    Parameters
    ----------
    methods : sequence of str or VisionTokenMethod
        Names of :data:`mmaccel.vision_tokens.METHODS` with optional arguments other than the budget
        (``"fastv:layer=3"``), or method objects (copied with ``keep_ratio`` set to each budget).
    budgets : sequence of float
        Fractions of visual tokens kept, each in (0, 1].

    Raises
    ------
    ValueError
        No methods or budgets, a budget outside (0, 1], an unknown method (the message lists the registry), a spec
        that sets ``keep_ratio`` itself (the budget does), or an argument the method refuses (e.g. ToMe's ``r``
        together with a budget below 1).
    """
    from ..vision_tokens import METHODS, VisionTokenMethod, build_method

    if isinstance(methods, (str, VisionTokenMethod)):
        methods = [methods]
    if not methods or not budgets:
        raise ValueError("a sweep needs at least one method and one budget, e.g. methods=['pooling'], budgets=[0.5]")
    budgets = [check_budget(b) for b in budgets]
    names = [m.name if isinstance(m, VisionTokenMethod) else parse_method_spec(m).name for m in methods]
    if POOLING not in names:
        methods, names = [POOLING, *methods], [POOLING, *names]
    cells = []
    for method, name in zip(methods, names):
        if isinstance(method, VisionTokenMethod):
            cells += [Cell(name, b, f"{name}:keep_ratio={b:g}", dataclasses.replace(method, keep_ratio=b))
                      for b in budgets]
            continue
        spec = parse_method_spec(method)
        if spec.name not in METHODS:
            raise ValueError(f"unknown visual-token method {spec.name!r}; methods: {', '.join(sorted(METHODS))} "
                             "(syntax: name or name:key=value, e.g. fastv:layer=3)")
        if "keep_ratio" in spec.kwargs:
            raise ValueError(f"{spec.text!r} sets keep_ratio, which the budgets set; write "
                             f"{spec.text.split(':keep_ratio')[0]!r} and pass --budgets")
        for b in budgets:
            label = f"{spec.text}:keep_ratio={b:g}"
            cells.append(Cell(spec.text, b, label, build_method(MethodSpec(spec.name, {**spec.kwargs,
                                                                                       "keep_ratio": b}, label))))
    labels = [c.label for c in cells]
    if len(set(labels)) != len(labels):
        raise ValueError(f"the sweep names a method twice: {sorted({x for x in labels if labels.count(x) > 1})}")
    return cells


# ---------------------------------------------------------------------------------------------------------- FLOPs
@dataclass(frozen=True)
class PrefillCost:
    """What the FLOPs estimate needs of a language model: parameters per decoder layer and ``d_attn``."""

    layer_params: tuple
    d_attn: int

    @classmethod
    def of(cls, model) -> PrefillCost:
        """Read it from a vision-language model's decoder (:class:`~mmaccel.vision_tokens.VLMParts`).

        Raises
        ------
        ValueError
            If the model is not a supported vision-language model.
        """
        from ..vision_tokens import VLMParts

        parts = VLMParts.find(model)
        if isinstance(parts, str):
            raise ValueError(f"cannot estimate prefill FLOPs: {parts}")  # noqa: TRY004 - bad input is a ValueError
        layers = parts.lm.layers
        d_attn = layers[0].self_attn.q_proj.out_features
        return cls(tuple(sum(p.numel() for p in layer.parameters()) for layer in layers), int(d_attn))

    def flops(self, tokens_per_layer: Sequence[int]) -> float:
        """``sum_i 2 * P_i * L_i + 2 * L_i**2 * d_attn`` (module docstring), FLOPs."""
        return float(sum(2 * p * n + 2 * n * n * self.d_attn for p, n in zip(self.layer_params, tokens_per_layer)))

    def tokens_per_layer(self, record: dict) -> list[int]:
        """Tokens each decoder layer saw at prefill, from a record's ``telemetry["vision"]``.

        The prompt length without a vision method; a pre-LLM or in-tower method's ``sequence_after`` from layer 0;
        an in-LLM method's ``sequence_after`` from its ``layer`` on -- for each of its ``stages`` (Progressive), and
        for the in-LLM part a pre-LLM method files under ``"in_llm"`` (AIM).
        """
        tel = (record.get("telemetry") or {}).get("vision") or {}
        tokens = int(record["prompt_tokens"])
        if tel.get("stage") != "in-llm" and "sequence_after" in tel:
            tokens = int(tel["sequence_after"])
        in_llm = tel if tel.get("stage") == "in-llm" else tel.get("in_llm") or {}
        cuts = sorted((int(s["layer"]), int(s["sequence_after"])) for s in in_llm.get("stages") or [in_llm]
                      if "layer" in s and "sequence_after" in s)
        per_layer = []
        for i in range(len(self.layer_params)):
            for layer, after in cuts:
                if i >= layer:
                    tokens = after
            per_layer.append(tokens)
        return per_layer


# ---------------------------------------------------------------------------------------------------------- sweep
@dataclass
class VisionSweepResult:
    """The outcome of :func:`vision_sweep`.

    Attributes
    ----------
    records : list of dict
        ``RunRecord.to_dict()`` per run, as in ``results.jsonl``.
    summary : dict
        As in ``summary.json``.
    out_dir : pathlib.Path or None
    plot : pathlib.Path or None
        The PNG, when ``out_dir`` was given.
    """

    records: list
    summary: dict
    out_dir: Path | None = None
    plot: Path | None = None

    def cell(self, label: str) -> dict:
        """The summary of one cell by its label (``"pooling:keep_ratio=0.5"``) or ``"baseline"``.

        Raises
        ------
        KeyError
            For a label the sweep does not have.
        """
        if label == BASELINE:
            return self.summary["baseline"]
        for c in self.summary["cells"]:
            if c["label"] == label:
                return c
        raise KeyError(f"no cell {label!r}; cells: {[c['label'] for c in self.summary['cells']]}")


def vision_sweep(
    model,
    processor,
    methods: Sequence = DEFAULT_METHODS,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    *,
    n: int = 200,
    seed: int = 0,
    split: str = "test",
    max_new_tokens: int = 4,
    repeats: int = 1,
    warmup: int = 1,
    out_dir=None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> VisionSweepResult:
    """Run every (method, budget) cell and the full-token baseline on ``n`` scene questions.

    Parameters
    ----------
    model : LlavaForConditionalGeneration (or another model :class:`~mmaccel.vision_tokens.VLMParts` supports)
    processor : its processor (``smol-llava``: a ``LlavaProcessor`` with a chat template)
    methods : sequence of str or VisionTokenMethod
        See :func:`build_cells`; pooling is added when missing.
    budgets : sequence of float
        Fractions of visual tokens kept, in (0, 1].
    n : int
        Questions (``make_scene_qa(n, seed, split=split)``), >= 1.
    seed : int
        Which draw of the split.
    split : {"test", "train"}
        ``"test"``: scenes the projector never saw.
    max_new_tokens : int
        Greedy new tokens per run (answers are one word: 4 is enough).
    repeats, warmup : int
        Per run, see :func:`~mmaccel.eval.generation.generate_measured`; warm-up runs happen on the first question
        only (once per cell).
    out_dir : path, optional
        Where ``results.jsonl``, ``summary.json`` and the PNG go (module docstring); nothing is written when ``None``.
    progress : bool
        Show a tqdm progress bar.
    resume, overwrite : bool
        What to do with a non-empty ``out_dir`` (:func:`mmaccel.eval.sweep.sweep`): finish it, skipping the runs
        already recorded, or replace it; refused otherwise.

    Returns
    -------
    VisionSweepResult

    Raises
    ------
    ValueError
        Before any run: bad methods or budgets (:func:`build_cells`), ``n < 1``, a processor that is not a VLM's, a
        method the model does not support (``UnsupportedModelError``, e.g. FastV's layer past the model's depth).
        Failures of single runs are recorded as ``status="failed"`` and the sweep goes on.
    """
    from ..data.scenes import make_scene_qa
    from .sweep import Cell as SweepCell
    from .sweep import check_out_dir, finished_records, sweep

    check_vlm_processor(processor)
    if n < 1:
        raise ValueError(f"n must be >= 1 question, got {n}")
    cells = build_cells(methods, budgets)
    for c in cells:
        c.vision.check(model)
    out = check_out_dir(out_dir, resume=resume, overwrite=overwrite) if out_dir is not None else None
    cost = PrefillCost.of(model)
    qas = make_scene_qa(n, seed=seed, split=split)
    everything = [Cell(BASELINE, 1.0, BASELINE)] + cells
    config = {"methods": list(dict.fromkeys(c.method for c in cells)), "budgets": [float(b) for b in
              dict.fromkeys(c.budget for c in cells)], "n": n, "seed": seed, "split": split,
              "max_new_tokens": max_new_tokens, "repeats": repeats, "warmup": warmup,
              "lm_layer_params": list(cost.layer_params), "d_attn": cost.d_attn}
    # every cell of question i, the baseline first (the others' flops_ratio and same_as_baseline refer to it)
    units = [SweepCell(cell.label, sample=f"q{i}", fields={"question_index": i}, payload=(cell, i))
             for i in range(len(qas)) for cell in everything]
    baselines = {r["extra"]["question_index"]: r for r in (finished_records(out) if resume and out else {}).values()
                 if r.get("method") == BASELINE and r.get("status") == "ok"}
    warmed: set[str] = set()
    prepared: dict[int, tuple] = {}

    def run(unit) -> dict:
        cell, i = unit.payload
        qa = qas[i]
        if i not in prepared:
            prepared.clear()  # one question's inputs at a time
            inputs = chat_inputs(processor, [qa.image], qa.question)
            prepared[i] = (inputs, image_token_count(model, inputs))
        inputs, visual = prepared[i]
        rec = generate_measured(model, processor.tokenizer, inputs, vision=cell.vision, label=cell.label,
                                max_new_tokens=max_new_tokens, repeats=repeats,
                                warmup=0 if cell.label in warmed else warmup)
        warmed.add(cell.label)  # warm-up runs once per cell, on the first question it runs
        row = rec.to_dict()
        flops = cost.flops(cost.tokens_per_layer(row)) if rec.ok else None
        if cell.method == BASELINE and rec.ok:
            baselines[i] = {**row, "extra": {**row["extra"], "lm_prefill_flops": flops}}
        base = baselines.get(i)
        base_flops = base["extra"]["lm_prefill_flops"] if base is not None else None
        row["extra"].update(
            cell=cell.method, budget=cell.budget, question_index=i, kind=qa.kind, question=qa.question,
            answer=qa.answer, correct=rec.ok and score(rec.output_text, qa.answer),
            visual_tokens_input=visual, lm_prefill_flops=flops,
            flops_ratio=flops / base_flops if flops is not None and base_flops else None,
            same_as_baseline=None if base is None or not rec.ok else rec.output_ids == base["output_ids"],
        )
        return row

    def summarize(records: list[dict]) -> dict:
        summary = summarize_sweep(records)
        summary["config"] = config
        return summary

    def plot(folder, summary, records):
        plots.append(plot_sweep(summary, folder / PLOT_FILE))

    plots: list = []
    done = sweep(units, run, out=out, resume=resume, overwrite=overwrite, summarize=summarize, write_extra=plot,
                 config=config, progress=progress, desc="vision-sweep", rotate=False)
    result = VisionSweepResult(records=done.records, summary=done.summary, out_dir=out)
    if plots:
        result.plot = plots[0]
        logger.info("wrote %s", out)
    return result


def _medians(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    return {f"median_{k}": median_or_none([r[k] for r in ok])
            for k in ("vision_encoder_s", "prefill_s", "ttft_s", "decode_s")}


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den else None


def _paired(rows: list[dict], other: list[dict]) -> dict:
    """``{"won", "lost"}``: questions answered right by ``rows`` and wrong by ``other``, and the reverse, over the
    questions both ran successfully (the counts an exact McNemar test takes)."""
    theirs = {r["extra"]["question_index"]: r["extra"]["correct"] for r in other if r["status"] == "ok"}
    pairs = [(r["extra"]["correct"], theirs[r["extra"]["question_index"]]) for r in rows
             if r["status"] == "ok" and r["extra"]["question_index"] in theirs]
    return {"won": sum(1 for a, b in pairs if a and not b), "lost": sum(1 for a, b in pairs if b and not a)}


def summarize_sweep(records: list[dict]) -> dict:
    """Aggregate sweep records: the baseline, then each (method, budget) cell in order of appearance.

    Accuracy is over successful runs (``None`` where every run failed), with its binomial standard error
    ``accuracy_se``; failed runs are counted in ``failed`` and the first error is kept. Speedups are the baseline's
    median seconds over the cell's (> 1 = faster). ``vs_pooling`` pairs each cell with the pooling cell of the same
    budget question by question (``None`` for pooling itself, or when the sweep has no such cell).

    Returns
    -------
    dict
        ``{"baseline": {"accuracy", "n", "failed", "visual_tokens", "median_vision_encoder_s", "median_prefill_s",
        "median_ttft_s", "median_decode_s", "by_kind"}, "cells": [{"label", "method", "budget", "accuracy", "n",
        "failed", "error", "visual_tokens", "median_visual_tokens_kept", "kept_ratio", the medians,
        "prefill_speedup", "ttft_speedup", "flops_ratio", "agreement", "by_kind"}]}``
    """
    def stats(rows):
        ok = [r for r in rows if r["status"] == "ok"]
        kinds = sorted({r["extra"]["kind"] for r in rows})
        acc = _accuracy(rows)
        return {"accuracy": acc, "accuracy_se": None if acc is None else math.sqrt(acc * (1 - acc) / len(ok)),
                "n": len(ok), "failed": len(rows) - len(ok),
                "visual_tokens": median_or_none([r["extra"]["visual_tokens_input"] for r in rows]),
                **_medians(rows),
                "by_kind": {k: _accuracy([r for r in rows if r["extra"]["kind"] == k]) for k in kinds}}

    base = stats([r for r in records if r["extra"]["cell"] == BASELINE])
    cells = []
    pooling = {}
    for r in records:
        if r["extra"]["cell"] == POOLING:
            pooling.setdefault(r["extra"]["budget"], []).append(r)
    for label in dict.fromkeys(r["method"] for r in records if r["extra"]["cell"] != BASELINE):
        rows = [r for r in records if r["method"] == label]
        method, budget = rows[0]["extra"]["cell"], rows[0]["extra"]["budget"]
        ok = [r for r in rows if r["status"] == "ok"]
        s = stats(rows)
        kept = median_or_none([r["visual_tokens_kept"] for r in ok])
        same = [r["extra"]["same_as_baseline"] for r in ok if r["extra"]["same_as_baseline"] is not None]
        cells.append({
            "label": label, "method": method, "budget": budget, **s,
            "error": next((r["error"] for r in rows if r["status"] != "ok"), None),
            "median_visual_tokens_kept": kept, "kept_ratio": _ratio(kept, s["visual_tokens"]),
            "prefill_speedup": _ratio(base["median_prefill_s"], s["median_prefill_s"]),
            "ttft_speedup": _ratio(base["median_ttft_s"], s["median_ttft_s"]),
            "flops_ratio": median_or_none([r["extra"]["flops_ratio"] for r in ok]),
            "agreement": sum(same) / len(same) if same else None,
            "vs_pooling": None if method == POOLING or budget not in pooling else _paired(rows, pooling[budget]),
        })
    return {"baseline": base, "cells": cells}


def plot_sweep(summary: dict, path) -> Path:
    """Draw accuracy against budget (one line per method, the baseline dashed) beside the prefill speedup; save a
    PNG at ``path`` (parent folders are created) and return it. Cells whose runs all failed are left out."""
    from .plots import _figure

    fig = _figure(10, 3.8)
    acc_ax, speed_ax = fig.subplots(1, 2)
    methods = list(dict.fromkeys(c["method"] for c in summary["cells"]))
    for method in methods:
        cells = sorted((c for c in summary["cells"] if c["method"] == method and c["accuracy"] is not None),
                       key=lambda c: c["budget"])
        if not cells:
            continue
        xs = [c["budget"] for c in cells]
        line, = acc_ax.plot(xs, [c["accuracy"] for c in cells], marker="o", label=method)
        speed_ax.plot(xs, [c["prefill_speedup"] or float("nan") for c in cells], marker="o", color=line.get_color(),
                      label=method)
    base = summary["baseline"]["accuracy"]
    if base is not None:
        acc_ax.axhline(base, color="k", ls="--", lw=0.8, label=f"all tokens ({base:.2f})")
    speed_ax.axhline(1.0, color="k", ls="--", lw=0.8)
    budgets = sorted({c["budget"] for c in summary["cells"]})
    for ax, ylabel in ((acc_ax, "accuracy (first word)"), (speed_ax, "prefill speedup vs all tokens")):
        ax.set_xscale("log")
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("visual-token budget (fraction kept)")
        ax.set_ylabel(ylabel)
        ax.invert_xaxis()
        ax.legend(fontsize=7)
    acc_ax.set_ylim(-0.02, 1.02)
    failed = [m for m in methods if all(c["accuracy"] is None for c in summary["cells"] if c["method"] == m)]
    if failed:
        fig.text(0.01, 0.01, f"every run failed: {', '.join(failed)} (see summary.json)", fontsize=7, color="#a00")
    acc_ax.set_title("held-out scene QA accuracy", fontsize=9)
    speed_ax.set_title("prefill (LM + projector) speedup", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def sweep_table(summary: dict) -> str:
    """Markdown: per cell the accuracy (± one standard error), its share of the baseline's, kept visual tokens,
    prefill seconds and speedup, FLOPs ratio, agreement with the baseline, and the paired count against pooling at
    the same budget (won/lost)."""
    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    def acc(c):
        se = c.get("accuracy_se")
        return pct(c["accuracy"]) + ("" if se is None else f" ± {100 * se:.1f}")

    b = summary["baseline"]
    share = (lambda c: "-" if c["accuracy"] is None or not b["accuracy"] else f"{c['accuracy'] / b['accuracy']:.0%}")
    lines = [("| method | budget | accuracy | share of baseline | visual tokens kept | prefill (s) | prefill speedup | "
              "FLOPs ratio | same as baseline | vs pooling (won/lost) | failed |"), "|" + "---|" * 11,
             (f"| {BASELINE} | 1 | {acc(b)} | 100% | {b['visual_tokens']} | "
              f"{num(b['median_prefill_s'], '.4f')} | 1.00x | 1.000 | - | - | {b['failed']} |")]
    for c in summary["cells"]:
        vs = c.get("vs_pooling")
        vs = "-" if vs is None else f"{vs['won']}/{vs['lost']}"
        lines.append(f"| {c['method']} | {c['budget']:g} | {acc(c)} | {share(c)} | "
                     f"{num(c['median_visual_tokens_kept'], 'g')} | {num(c['median_prefill_s'], '.4f')} | "
                     f"{num(c['prefill_speedup'], '.2f')}x | {num(c['flops_ratio'], '.3f')} | "
                     f"{pct(c['agreement'])} | {vs} | {c['failed']} |")
    return "\n".join(lines)


__all__ = ["BASELINE", "POOLING", "Cell", "PrefillCost", "VisionSweepResult", "build_cells", "check_budget", "plot_sweep",
           "summarize_sweep", "sweep_table", "vision_sweep"]
