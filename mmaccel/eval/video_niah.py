"""Video needle-in-a-haystack (V-NIAH): frames x depth accuracy per method, peak memory, what fits a memory budget.

``mmaccel video-niah --model smol-llava --frames 64 256 1024 --depths 0.1 0.5 0.9 --methods ... --out DIR`` and
:func:`video_niah`. The task is V-NIAH of LongVA (Zhang et al., "Long Context Transfer from Language to Vision", 2024,
arXiv 2406.16852) on the seeded clips of :mod:`mmaccel.data.clips`: one needle frame showing a number at a relative
depth of a slowly changing clip, and the question "What number appeared in the video?" (or its colour, or the motion;
``kind``). Clips come from the held-out test seeds; a depth sweep moves the same needle through the same clip.

A LLaVA-1.5-style model has no video input: the clip's frames are a batch of images in one prompt, one ``<image>`` per
frame (``smol-llava``'s processor expands each to the frame's 144 visual tokens, so a 1,024-frame clip is 147,456
visual tokens). Every (method, clip) runs through the one measured path
(:func:`~mmaccel.eval.generation.generate_measured`) and is scored by the first word of the answer
(:mod:`mmaccel.eval.visual`).

Methods and memory
------------------
A method is ``VISION[+KV]`` (:func:`~mmaccel.eval.visual.parse_visual_config`), e.g.
``pooling:keep_ratio=0.0625+streaming:window=1024``:

- the visual-token method reduces every frame's tokens between projector and LLM (pooling, VisionZip, PruMerge; ToMe in
  the tower; FastV inside the LLM). Kept tokens keep their positions, so a long clip's positions can pass the LM's
  ``max_position_embeddings`` (a warning says so). Temporal ToMe reads the clip's frames (consecutive images of one
  size) as one clip and merges similar tokens across adjacent frames
  (:class:`~mmaccel.vision_tokens.TemporalToMe`);
- the KV-cache method (``kv=`` slot) bounds what the cache holds after prefill and while decoding (StreamingLLM's
  window, SnapKV's budget, ...);
- ``chunked`` prefill (:class:`mmaccel.longctx.Chunked`, e.g. ``pooling:keep_ratio=0.0625+chunked:chunk=1024`` or
  ``...+chunked:chunk=1024:method=streaming,window=4096``) runs the vision tower, the projector and the visual-token
  method once on the whole clip and splits only the language model's prefill, on the merged and reduced
  ``inputs_embeds``: the LM's activations are bounded by the chunk, and with an evicting inner method its K/V too
  (the tower's activations and the merged embeddings still grow with the clip).
  In-LLM pruning (FastV, Progressive, AIM's pruning layers) needs the whole prompt in one forward and is refused with
  ``chunked`` (:func:`check_video_config`).

Output folder
-------------
``results.jsonl``
    One :class:`~mmaccel.eval.generation.RunRecord` per (method, frames, depth, trial), written as it exists;
    ``extra`` holds ``frames`` (also as ``length``, the NIAH field), ``depth``, ``trial``, ``clip_seed``,
    ``needle_frame``, ``kind``, ``question``, ``answer``, ``correct``, ``correct_contains``,
    ``visual_tokens_input``. A run that raised (e.g. out of memory) is recorded as ``failed`` and the sweep goes on.
``summary.json``
    :func:`mmaccel.eval.niah.summarize` over frames (its ``length``) x depth -- accuracy, medians of TTFT and peak
    memory per cell, the K/V ratio after prefill against the ``none`` method on the same clip -- plus ``memory``:
    per method the peak memory per frame count, the largest measured frame count within ``memory_budget`` and a
    linear extrapolation of it.
``heatmap_<method>.png``
    Accuracy over frames (x) x depth (y), drawn by :func:`mmaccel.eval.niah.draw_heatmap`.
``peak_memory.png``
    Peak memory against frames, one line per method, the budget dashed.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..vision_tokens.batched_tower import BatchedVisionEncoding
from .niah import draw_heatmap, safe_label, summarize
from .visual import (
    NO_REDUCTION,
    VisualConfig,
    chat_inputs,
    check_vlm_processor,
    image_token_count,
    parse_visual_config,
    run_config,
)

logger = logging.getLogger(__name__)

DEFAULT_METHODS = ("pooling:keep_ratio=0.25", "pooling:keep_ratio=0.0625+streaming:window=1024")
DEFAULT_FRAMES = (64, 256, 1024)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
WARMUP_FRAMES = 2
"""Frames of the short clip the warm-up runs use (once per method), so a warm-up never costs a long prefill."""


def check_video_config(config: VisualConfig, model) -> None:
    """Refuse, before any run, a configuration that cannot run on a video of images.

    Raises
    ------
    ValueError
        ``chunked`` prefill with a visual-token method that prunes inside the language model (FastV, Progressive,
        AIM with pruning layers): it ranks the prompt's tokens inside one prefill forward, which chunked prefill
        splits, so it would prune nothing.
    UnsupportedModelError
        (a ``ValueError``) a visual-token method the model does not support.
    """
    from ..longctx import build_method as build_kv
    from ..vision_tokens import UnsupportedModelError
    from ..vision_tokens import build_method as build_vision
    from ..pipeline import check_composition

    if config.vision is None:
        return
    kv = None if config.kv is None else build_kv(config.kv)
    try:
        check_composition(model, kv, vision=build_vision(config.vision))
    except UnsupportedModelError:
        raise
    except ValueError as exc:
        raise ValueError(f"{config.label!r}: {exc}") from None


@dataclass
class VideoNIAHResult:
    """The outcome of :func:`video_niah`.

    Attributes
    ----------
    records : list of dict
        ``RunRecord.to_dict()`` per run, as in ``results.jsonl``.
    summary : dict
        As in ``summary.json``.
    out_dir : pathlib.Path or None
    heatmaps : dict
        Method label -> PNG path.
    memory_plot : pathlib.Path or None
    """

    records: list
    summary: dict
    out_dir: Path | None = None
    heatmaps: dict = field(default_factory=dict)
    memory_plot: Path | None = None

    def accuracy(self, method: str) -> float | None:
        """Overall accuracy of one method over its successful runs (``None`` if none succeeded)."""
        return self.summary["methods"][method]["accuracy"]


def clip_images(clip) -> list:
    """Every frame of a :class:`~mmaccel.data.clips.Clip` as an RGB PIL image, rendered one at a time."""
    from PIL import Image

    return [Image.fromarray(clip.frame(t)) for t in range(len(clip))]


def video_niah(
    model,
    processor,
    methods: Sequence[str] = DEFAULT_METHODS,
    frames: Sequence[int] = DEFAULT_FRAMES,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    *,
    trials: int = 1,
    seed: int = 0,
    kind: str = "number",
    size: int = 168,
    max_new_tokens: int = 6,
    repeats: int = 1,
    warmup: int = 1,
    memory_budget: int | None = None,
    vision_batch: int | None = None,
    out_dir=None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> VideoNIAHResult:
    """Run every method on every (frames, depth, trial) clip.

    Parameters
    ----------
    model : LlavaForConditionalGeneration (or another model :class:`~mmaccel.vision_tokens.VLMParts` supports)
    processor : its processor
    methods : sequence of str
        ``VISION[+KV]`` configurations or ``"none"`` (all visual tokens, full attention).
    frames : sequence of int
        Clip lengths in frames, each >= 1.
    depths : sequence of float
        Needle depths in [0, 1] (``needle_frame = round(depth * (frames - 1))``).
    trials : int
        Clips per (frames, depth); trial ``t`` is test-split clip ``t`` of draw ``seed``.
    kind : {"number", "colour", "motion"}
        The question (:data:`mmaccel.data.clips.CLIP_KINDS`).
    size : int
        Frame side in pixels (the processor resizes to the model's input).
    max_new_tokens : int
        Greedy new tokens per run.
    repeats, warmup : int
        See :func:`~mmaccel.eval.generation.generate_measured`; ``warmup`` runs happen once per method, on a
        :data:`WARMUP_FRAMES`-frame clip.
    memory_budget : int, optional
        Bytes of peak memory growth a run may take: the summary's ``memory`` section then says the largest frame
        count that fits, per method.
    out_dir : path, optional
        Where the files of the module docstring go; nothing is written when ``None``.
    progress : bool
        Show a tqdm progress bar.
    resume, overwrite : bool
        What to do with a non-empty ``out_dir`` (:func:`mmaccel.eval.sweep.sweep`): finish it, skipping the runs
        already recorded, or replace it; refused otherwise.

    Returns
    -------
    VideoNIAHResult

    Raises
    ------
    ValueError
        Before any run: no methods, a bad or unknown method (:func:`check_video_config`), frames < 1, a depth outside
        [0, 1], ``trials < 1``, an unknown ``kind``, ``memory_budget <= 0``, a processor that is not a VLM's, a
        ``vision_batch`` below 1 or on a model it does not support. A run
        that fails is recorded as ``status="failed"`` and the sweep goes on.
    """
    from ..data.clips import CLIP_KINDS, make_clip
    from ..data.splits import split_seed
    from .sweep import Cell as SweepCell
    from .sweep import check_out_dir, sweep

    check_vlm_processor(processor)
    if isinstance(methods, str):
        methods = [methods]
    if not methods:
        raise ValueError(f"no methods given; pass at least one, e.g. {DEFAULT_METHODS[0]!r} or {NO_REDUCTION!r}")
    configs = [parse_visual_config(m) for m in methods]
    for c in configs:
        check_video_config(c, model)
    frames = [int(t) for t in frames]
    depths = [float(d) for d in depths]
    if not frames or min(frames) < 1:
        raise ValueError(f"frames must be clip lengths >= 1, got {frames}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be fractions in [0, 1], got {depths}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if kind not in CLIP_KINDS:
        raise ValueError(f"unknown clip question kind {kind!r}; use one of {', '.join(CLIP_KINDS)}")
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
    batched = None if vision_batch is None else BatchedVisionEncoding(model, vision_batch)
    warm_clip = make_clip(WARMUP_FRAMES, seed=split_seed("test", seed, 0), depth=0.5, size=size, kind=kind)
    warm_inputs = chat_inputs(processor, clip_images(warm_clip), warm_clip.question)
    _warn_positions(model, image_token_count(model, warm_inputs) // WARMUP_FRAMES, max(frames), max_new_tokens,
                    configs)

    labels = [c.label for c in configs]
    config = {"methods": labels, "frames": frames, "depths": depths, "trials": trials, "seed": seed,
              "kind": kind, "size": size, "max_new_tokens": max_new_tokens, "repeats": repeats,
              "warmup": warmup, "memory_budget_bytes": memory_budget, "vision_batch": vision_batch}
    out = check_out_dir(out_dir, resume=resume, overwrite=overwrite) if out_dir is not None else None
    cells = [SweepCell(c.label, sample=f"T={n}/d={d:g}/t={t}", fields={"frames": n, "depth": d, "trial": t},
                       payload=c)
             for n in frames for d in depths for t in range(trials) for c in configs]
    warmed: set[str] = set()
    clips: dict[tuple, tuple] = {}

    def run(cell) -> dict:
        n_frames, depth, trial = cell.fields["frames"], cell.fields["depth"], cell.fields["trial"]
        key = (n_frames, depth, trial)
        if key not in clips:
            clips.clear()  # one clip's frames at a time
            clip_seed = split_seed("test", seed, trial)
            clip = make_clip(n_frames, seed=clip_seed, depth=depth, size=size, kind=kind)
            clips[key] = (clip, clip_seed, chat_inputs(processor, clip_images(clip), clip.question))
        clip, clip_seed, inputs = clips[key]
        config = cell.payload
        rec = run_config(model, processor, inputs, config, answer=clip.answer, max_new_tokens=max_new_tokens,
                         repeats=repeats, warmup=0 if config.label in warmed else warmup, warmup_inputs=warm_inputs)
        warmed.add(config.label)
        rec.extra.update(frames=n_frames, length=n_frames, depth=depth, trial=trial, clip_seed=clip_seed,
                         needle_frame=clip.needle_frame, kind=kind, question=clip.question)
        return rec.to_dict()

    def summarize(records: list[dict]) -> dict:
        summary = summarize_video(records, labels, frames, depths, memory_budget)
        summary["config"] = config
        return summary

    result = VideoNIAHResult(records=[], summary={}, out_dir=out)

    def plots(folder, summary, records):
        for label in labels:
            result.heatmaps[label] = plot_frames_heatmap(summary["methods"][label]["cells"], frames, depths,
                                                         f"video NIAH accuracy: {label}",
                                                         folder / f"heatmap_{safe_label(label)}.png")
        result.memory_plot = plot_memory(summary, folder / "peak_memory.png")

    with contextlib.ExitStack() as stack:
        if batched is not None:
            stack.enter_context(batched)
        done = sweep(cells, run, out=out, resume=resume, overwrite=overwrite, summarize=summarize,
                     write_extra=plots, config=config, progress=progress, desc="video-niah")
    result.records, result.summary = done.records, done.summary
    if out is not None:
        logger.info("wrote %s", out)
    return result


def _warn_positions(model, per_frame: int, most_frames: int, max_new_tokens: int, configs) -> None:
    """Warn when the longest clip's positions pass the language model's ``max_position_embeddings``, naming the
    methods that reach them: kept visual tokens keep their original positions by default, so reducing tokens does not
    shorten the position range; a pre-LLM method with ``positions=contiguous`` does, and is left out (no warning when
    every method given renumbers)."""
    from ..vision_tokens import build_method as build_vision

    config = getattr(model.config, "text_config", model.config)
    limit = getattr(config, "max_position_embeddings", None)
    last = per_frame * most_frames + max_new_tokens
    if not limit or last <= limit:
        return
    original = [c.label for c in configs
                if c.vision is None or getattr(build_vision(c.vision), "positions", "original") != "contiguous"]
    if original:
        logger.warning("%d frames x %d visual tokens reach position %d, past the language model's "
                       "max_position_embeddings=%d, under %s: answers there test position extrapolation too (a "
                       "pre-LLM method with ':positions=contiguous' numbers only the kept tokens)", most_frames,
                       per_frame, last, limit, ", ".join(original))


def summarize_video(records: list[dict], labels: Sequence[str], frames: Sequence[int], depths: Sequence[float],
                    memory_budget: int | None = None) -> dict:
    """:func:`mmaccel.eval.niah.summarize` over frames x depth, plus the ``memory`` section.

    The K/V ratio after prefill is taken against the ``none`` configuration's run on the same clip (when the sweep
    has one). ``memory["methods"][label]``: ``by_frames`` (per frame count: the largest and the median peak memory
    growth of its runs, bytes, and whether every run succeeded), ``largest_frames_within_budget`` (the largest
    measured frame count whose runs all succeeded within the budget; ``None`` if none did or there is no budget) and
    ``estimated_max_frames`` (the budget solved on a least-squares line ``peak = a + b * frames`` through the
    successful frame counts; ``None`` with fewer than two of them, a non-positive slope or no budget).
    """
    view = [{**r, "method_name": "full" if r["method"] == NO_REDUCTION else None} for r in records]
    summary = summarize(view, frames, depths)
    memory = {"budget_bytes": memory_budget, "methods": {}}
    for label in labels:
        rows = [r for r in records if r["method"] == label]
        by_frames = []
        for t in frames:
            at = [r for r in rows if r["extra"]["frames"] == t]
            peaks = [r["peak_memory_bytes"] for r in at if r["status"] == "ok" and r["peak_memory_bytes"] is not None]
            all_ok = bool(at) and all(r["status"] == "ok" for r in at)
            by_frames.append({"frames": t, "all_ok": all_ok, "max_peak_memory_bytes": max(peaks) if peaks else None,
                              "median_peak_memory_bytes": sorted(peaks)[len(peaks) // 2] if peaks else None,
                              "method": at[0]["peak_memory_method"] if at else None})
        memory["methods"][label] = {"by_frames": by_frames, **_fit_budget(by_frames, memory_budget)}
    summary["memory"] = memory
    return summary


def _fit_budget(by_frames: list[dict], budget: int | None) -> dict:
    usable = [b for b in by_frames if b["all_ok"] and b["max_peak_memory_bytes"] is not None]
    if budget is None:
        return {"largest_frames_within_budget": None, "estimated_max_frames": None}
    fits = [b["frames"] for b in usable if b["max_peak_memory_bytes"] <= budget]
    estimate = None
    if len({b["frames"] for b in usable}) >= 2:
        xs = [b["frames"] for b in usable]
        ys = [b["max_peak_memory_bytes"] for b in usable]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0:
            estimate = max(0, math.floor((budget - (my - slope * mx)) / slope))
    return {"largest_frames_within_budget": max(fits) if fits else None, "estimated_max_frames": estimate}


def plot_frames_heatmap(cells: list[dict], frames: Sequence[int], depths: Sequence[float], title: str, path) -> Path:
    """The NIAH accuracy heatmap (:func:`mmaccel.eval.niah.draw_heatmap`) with frames on the x axis; a PNG at
    ``path``, returned."""
    from .plots import _figure

    fig = _figure(max(5.0, 1.8 + 0.9 * len(frames)), max(3.0, 1.4 + 0.5 * len(depths)))
    ax = fig.add_subplot()
    fig.colorbar(draw_heatmap(ax, cells, frames, depths, title), ax=ax, label="accuracy")
    ax.set_xlabel("clip length (frames)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def plot_memory(summary: dict, path) -> Path:
    """Peak memory growth (MiB, the largest run per frame count) against frames, one line per method, the budget
    dashed; a PNG at ``path``, returned."""
    from .plots import _figure

    fig = _figure(6.5, 3.6)
    ax = fig.add_subplot()
    memory = summary["memory"]
    for label, m in memory["methods"].items():
        points = [(b["frames"], b["max_peak_memory_bytes"] / 2**20) for b in m["by_frames"]
                  if b["max_peak_memory_bytes"] is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=label[:48])
    if memory["budget_bytes"]:
        ax.axhline(memory["budget_bytes"] / 2**20, color="k", ls="--", lw=0.8, label="budget")
    ax.set_xscale("log", base=2)
    ticks = sorted({b["frames"] for m in memory["methods"].values() for b in m["by_frames"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("clip length (frames)")
    ax.set_ylabel("peak memory growth (MiB)")
    ax.set_title("peak memory per run (largest over depths and trials)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def video_table(summary: dict) -> str:
    """Markdown: per method and frame count the accuracy, runs, failures, median TTFT and peak memory; then, with a
    budget, the largest frame count that fits per method."""
    from .compare import format_bytes

    lines = ["| method | frames | accuracy | n | failed | median TTFT (s) | median peak mem |", "|" + "---|" * 7]
    for label, m in summary["methods"].items():
        for row in m["by_length"]:
            acc = "-" if row["accuracy"] is None else f"{100 * row['accuracy']:.0f}%"
            ttft = "-" if row["median_ttft_s"] is None else f"{row['median_ttft_s']:.2f}"
            lines.append(f"| {label} | {row['length']} | {acc} | {row['n']} | {row['failed']} | {ttft} | "
                         f"{format_bytes(row['median_peak_memory_bytes'])} |")
    budget = summary["memory"]["budget_bytes"]
    if budget:
        lines.append(f"\nmemory budget {format_bytes(budget)}:")
        for label, m in summary["memory"]["methods"].items():
            est = m["estimated_max_frames"]
            lines.append(f"- {label}: largest measured frame count within budget "
                         f"{m['largest_frames_within_budget'] or 'none'}; linear estimate "
                         f"{'-' if est is None else est} frames")
    return "\n".join(lines)


__all__ = ["DEFAULT_METHODS", "VideoNIAHResult", "check_video_config", "clip_images", "plot_frames_heatmap",
           "plot_memory", "summarize_video", "video_niah", "video_table"]
