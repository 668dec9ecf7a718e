"""ToMe schedules on a ViT: image throughput against linear-probe accuracy on scene attributes, and the cosine
similarity of pooled features to the unmerged model on sample frames.

``mmaccel tome-sweep --model dinov2-small --schedules tome:r=8 tome:r=16 --out DIR`` and :func:`tome_sweep`
(``benchmarks/tome_linear_probe.py`` calls it). ToMe: Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023,
arXiv 2210.09461 (:class:`mmaccel.vision_tokens.ToMe`). DINOv2: Oquab et al., 2023, arXiv 2304.07193.

- **Linear probes.** Scenes of :func:`mmaccel.data.scenes.make_scene` from the disjoint train and test seed ranges
  (:func:`mmaccel.data.splits.split_seed`); per scene the attributes of :data:`PROBES` (how many objects; the shape,
  colour and size of the top-left object, first in raster order of the grid cells). Features are DINOv2's
  linear-probe input: [CLS] (``pooler_output``) and the mean of the patch tokens (size-weighted under ToMe, i.e. the
  mean over the original patches), concatenated, computed under each schedule. One multinomial logistic regression
  per (schedule, attribute), fitted with L-BFGS on standardised features from a zero start (deterministic), trained
  on that schedule's own train features and scored on its test features.
- **Fidelity.** Cosine similarity to the unmerged model of the [CLS] feature and of the patch mean, on frames of
  held-out clips (:mod:`mmaccel.data.clips`; every other one the needle frame): mean and minimum.
- **Throughput.** Images per second of one forward on a batch of test scenes: every schedule gets a warm-up forward,
  then ``repeats`` interleaved rounds (every schedule once per round, so a neighbour's load drifts over all alike),
  median. The record keeps the device, threads and load average: on a shared CPU compare ratios within one run.

Output folder: ``summary.json`` (``config``, environment, ``rows``: one per schedule, ``"none"`` first) and
``tome_sweep.png`` (speedup against probe accuracy and against [CLS] cosine).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .generation import load_average

logger = logging.getLogger(__name__)

UNMERGED = "none"
"""Label of the unmerged model's row."""
DEFAULT_SCHEDULES = ("tome:r=8", "tome:r=16")


def _top_left(scene):
    return min(scene.objects, key=lambda o: o.cell)


#: Scene attribute -> how to read it from a :class:`~mmaccel.data.scenes.Scene` (the probe's class label).
PROBES: dict[str, Callable] = {
    "count": lambda scene: len(scene.objects),
    "shape": lambda scene: _top_left(scene).shape,
    "colour": lambda scene: _top_left(scene).colour,
    "size": lambda scene: _top_left(scene).size,
}


def resolve_schedules(schedules: Sequence) -> dict:
    """``{label: ToMe}`` for the schedules, the unmerged model (``None``) first under :data:`UNMERGED`.

    Parameters
    ----------
    schedules : sequence of str or ToMe
        ToMe specs (``"tome:r=8"``, ``"tome:schedule=16,16,8"``, ``"tome:keep_ratio=0.5"``) or objects.

    Raises
    ------
    ValueError
        An empty list, a spec of another method (the message says to write ``tome:...``), bad ToMe arguments, or the
        same schedule twice.
    """
    from ..specs import parse_method_spec
    from ..vision_tokens import ToMe, build_method

    if isinstance(schedules, (str, ToMe)):
        schedules = [schedules]
    if not schedules:
        raise ValueError("no schedules given; pass at least one, e.g. 'tome:r=8'")
    out: dict = {UNMERGED: None}
    for s in schedules:
        if isinstance(s, ToMe):
            label, method = repr(s), s
        else:
            spec = parse_method_spec(s)
            if spec.name != "tome":
                raise ValueError(f"{spec.text!r} is not a ToMe schedule; write tome:r=N, tome:schedule=16,16,8 or "
                                 "tome:keep_ratio=0.5")
            label, method = spec.text, build_method(spec)
        if label in out:
            raise ValueError(f"schedule {label!r} is given twice (or is the unmerged baseline's label)")
        out[label] = method
    return out


def pooled_features(model, pixels: torch.Tensor, method=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The [CLS] feature and the patch-token mean of one forward, under ``method`` (``None`` = unmerged).

    Parameters
    ----------
    model : a HF ViT with ``pooler_output`` (``Dinov2Model``, ``CLIPVisionModel``)
    pixels : torch.Tensor
        [B, 3, H, W] from its image processor.
    method : ToMe, optional

    Returns
    -------
    (cls, patch_mean, telemetry)
        ``cls`` [B, D] (``pooler_output``), ``patch_mean`` [B, D] (tokens after the [CLS] weighted by how many
        original patches each holds: the mean over the original patches) and the method's telemetry (unmerged:
        ``tokens_before`` = ``tokens_after`` = the sequence length, [CLS] included).
    """
    with torch.inference_mode():
        if method is None:
            out = model(pixel_values=pixels)
            sizes = None
            n = int(out.last_hidden_state.shape[1])
            telemetry = {"tokens_before": n, "tokens_after": n}
        else:
            with method.apply(model):
                out = model(pixel_values=pixels)
            source = method.last_source
            sizes = None if source is None else source.sources().to(out.last_hidden_state.dtype)
            telemetry = dict(method.telemetry)
        hidden = out.last_hidden_state
        if sizes is None:
            sizes = torch.ones(hidden.shape[:2], dtype=hidden.dtype, device=hidden.device)
        w = sizes[:, 1:, None]
        patch = (hidden[:, 1:] * w).sum(1) / w.sum(1)
        return out.pooler_output.float(), patch.float(), telemetry


def image_features(model, image_processor, images: Sequence, method=None, batch: int = 16) -> torch.Tensor:
    """[N, 2D] float32: [CLS] and patch mean (:func:`pooled_features`) of every image, ``batch`` at a time."""
    rows = []
    for i in range(0, len(images), batch):
        pixels = image_processor(images=list(images[i:i + batch]), return_tensors="pt")["pixel_values"]
        cls, patch, _ = pooled_features(model, pixels.to(model.device, model.dtype), method)
        rows.append(torch.cat([cls, patch], -1).cpu())
    return torch.cat(rows)


def probe_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor, *,
                   l2: float = 1e-3, steps: int = 200) -> float:
    """Test accuracy of a multinomial logistic regression fitted with L-BFGS on standardised features.

    Parameters
    ----------
    train_x, test_x : torch.Tensor
        [N, F] float features.
    train_y, test_y : torch.Tensor
        [N] class indices (long).
    l2 : float
        Weight of the L2 penalty on the weights.
    steps : int
        L-BFGS iterations.

    Returns
    -------
    float
        Fraction of test rows whose argmax is the label. The weights start at zero, so equal features give equal
        accuracy.
    """
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    classes = int(max(train_y.max(), test_y.max())) + 1
    layer = torch.nn.Linear(train_x.shape[1], classes)
    torch.nn.init.zeros_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    opt = torch.optim.LBFGS(layer.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(layer(train_x), train_y) + l2 * layer.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return float((layer(test_x).argmax(-1) == test_y).float().mean())


def image_throughput(model, pixels: torch.Tensor, methods: dict, repeats: int = 5) -> dict:
    """Images per second of one forward on ``pixels`` [B, 3, H, W] per method (``None`` = unmerged).

    One warm-up forward per method, then ``repeats`` rounds of one timed forward of every method in turn (CUDA is
    synchronised around each). Returns ``{label: {"times_s", "median_s", "images_per_s"}}``.
    """
    def forward(method):
        with torch.inference_mode():
            if method is None:
                model(pixel_values=pixels)
            else:
                with method.apply(model):
                    model(pixel_values=pixels)
        if pixels.device.type == "cuda":
            torch.cuda.synchronize(pixels.device)

    for method in methods.values():
        forward(method)
    times: dict = {label: [] for label in methods}
    for _ in range(repeats):
        for label, method in methods.items():
            start = time.perf_counter()
            forward(method)
            times[label].append(time.perf_counter() - start)
    return {label: {"times_s": ts, "median_s": statistics.median(ts),
                    "images_per_s": pixels.shape[0] / statistics.median(ts)} for label, ts in times.items()}


def sample_frames(n: int, seed: int = 0, size: int = 168) -> list:
    """``n`` RGB frames of held-out clips (:func:`mmaccel.data.clips.make_clip`, test split), one per clip, every
    other one the needle frame."""
    from PIL import Image

    from ..data.clips import make_clip
    from ..data.splits import split_seed

    frames = []
    for i in range(n):
        clip = make_clip(8, seed=split_seed("test", seed, i), depth=0.5, size=size)
        frames.append(Image.fromarray(clip.frame(clip.needle_frame if i % 2 else 0)))
    return frames


@dataclass
class ToMeSweepResult:
    """The outcome of :func:`tome_sweep`: ``summary`` (as in ``summary.json``; ``summary["rows"]`` one per schedule,
    ``"none"`` first), the output folder and the PNG."""

    summary: dict
    out_dir: Path | None = None
    plot: Path | None = None

    @property
    def rows(self) -> list:
        """``summary["rows"]``: one dict per schedule, the unmerged model first."""
        return self.summary["rows"]


def tome_sweep(
    model,
    image_processor,
    schedules: Sequence = DEFAULT_SCHEDULES,
    *,
    train: int = 400,
    test: int = 200,
    frames: int = 16,
    probes: Sequence[str] = tuple(PROBES),
    batch: int = 16,
    repeats: int = 5,
    l2: float = 1e-3,
    seed: int = 0,
    out_dir=None,
    progress: bool = True,
    resume: bool = False,
    overwrite: bool = False,
) -> ToMeSweepResult:
    """Measure every ToMe schedule beside the unmerged model: throughput, probe accuracy, feature fidelity.

    Parameters
    ----------
    model : a HF ViT with ``pooler_output`` (``Dinov2Model``, ``CLIPVisionModel``), in eval mode
    image_processor : its image processor
    schedules : sequence of str or ToMe
        See :func:`resolve_schedules`.
    train, test : int
        Scenes fitted and scored per probe (``train >= 2``, ``test >= 1``).
    frames : int
        Held-out clip frames for the cosine similarities (>= 1).
    probes : sequence of str
        Attributes of :data:`PROBES`.
    batch : int
        Images per forward (also the throughput batch).
    repeats : int
        Timed rounds of the throughput measure.
    l2 : float
        The probes' L2 penalty.
    seed : int
        Which draw of the scene and clip splits.
    out_dir : path, optional
        Where ``summary.json`` and ``tome_sweep.png`` go; nothing is written when ``None``.
    progress : bool
        Show a progress bar over the schedules.
    resume, overwrite : bool
        What to do with a non-empty ``out_dir`` (:func:`mmaccel.eval.sweep.sweep`): ``resume`` keeps the schedules
        already measured (their probe and fidelity rows in ``results.jsonl``) and runs the rest; the throughput of
        every schedule is always measured again, together, in this process. Refused otherwise.

    Returns
    -------
    ToMeSweepResult
        ``rows``: ``spec``, ``schedule``, ``tokens_before`` / ``tokens_after`` / ``tokens_per_layer``,
        ``images_per_s``, ``median_s``, ``speedup`` (over the unmerged model, same process), ``probe_accuracy``
        {attribute: accuracy}, ``probe_mean``, ``drop_points`` {attribute: points below unmerged},
        ``cos_cls_mean`` / ``_min`` and ``cos_patch_mean`` / ``_min``.

    Raises
    ------
    ValueError
        Before any forward: bad schedules, a schedule the model does not support (``UnsupportedModelError``: not a
        ViT with pre-norm blocks, a schedule longer than the model), a vision-language model (give its tower), an
        unknown probe, or counts out of range.
    """
    from ..data.scenes import make_scene
    from ..data.splits import split_seed
    from ..vision_tokens import VLMParts
    from .sweep import Cell as SweepCell
    from .sweep import check_out_dir, sweep

    methods = resolve_schedules(schedules)
    if not isinstance(VLMParts.find(model), str):
        raise ValueError(  # noqa: TRY004 - bad input is a ValueError
            "tome-sweep measures a ViT on its own (e.g. --model dinov2-small), not a vision-language model; "
            "`mmaccel vision-sweep --methods tome` sweeps ToMe inside a VLM")
    for method in methods.values():
        if method is not None:
            method.check(model)
    unknown = [p for p in probes if p not in PROBES]
    if not probes or unknown:
        raise ValueError(f"unknown probe(s) {unknown or list(probes)}; probes: {', '.join(PROBES)}")
    if train < 2 or test < 1 or frames < 1 or batch < 1 or repeats < 1:
        raise ValueError(f"need train >= 2, test >= 1, frames >= 1, batch >= 1 and repeats >= 1; got train={train}, "
                         f"test={test}, frames={frames}, batch={batch}, repeats={repeats}")
    load_before = load_average()
    scenes = {split: [make_scene(split_seed(split, seed, i)) for i in range(n)]
              for split, n in (("train", train), ("test", test))}
    labels = {}
    for p in probes:
        values = sorted({PROBES[p](s) for split in scenes.values() for s in split}, key=str)
        labels[p] = {split: torch.tensor([values.index(PROBES[p](s)) for s in ss]) for split, ss in scenes.items()}
    images = {split: [s.image for s in ss] for split, ss in scenes.items()}
    frame_images = sample_frames(frames, seed)
    frame_pixels = image_processor(images=frame_images, return_tensors="pt")["pixel_values"].to(model.device,
                                                                                                   model.dtype)
    ref_cls, ref_patch, _ = pooled_features(model, frame_pixels)
    out = check_out_dir(out_dir, resume=resume, overwrite=overwrite) if out_dir is not None else None
    config = {"model": type(model).__name__, "schedules": list(methods)[1:], "train": train, "test": test,
              "frames": frames, "probes": list(probes), "batch": batch, "repeats": repeats, "l2": l2, "seed": seed}

    def run(cell) -> dict:
        """One schedule's probe accuracies and feature fidelity (the record of its cell)."""
        method = cell.payload
        feats = {split: image_features(model, image_processor, images[split], method, batch) for split in images}
        acc = {p: probe_accuracy(feats["train"], labels[p]["train"], feats["test"], labels[p]["test"], l2=l2)
               for p in probes}
        cls, patch, telemetry = pooled_features(model, frame_pixels, method)
        cos_cls = torch.nn.functional.cosine_similarity(cls, ref_cls, dim=-1)
        cos_patch = torch.nn.functional.cosine_similarity(patch, ref_patch, dim=-1)
        row = {"method": cell.method, "status": "ok", "spec": cell.method, "schedule": telemetry.get("schedule"),
               "tokens_before": telemetry.get("tokens_before"), "tokens_after": telemetry.get("tokens_after"),
               "tokens_per_layer": telemetry.get("tokens_per_layer"), "probe_accuracy": acc,
               "probe_mean": sum(acc.values()) / len(acc),
               "cos_cls_mean": float(cos_cls.mean()), "cos_cls_min": float(cos_cls.min()),
               "cos_patch_mean": float(cos_patch.mean()), "cos_patch_min": float(cos_patch.min())}
        logger.info("%s: probe %s, cos CLS %.4f", cell.method, acc, row["cos_cls_mean"])
        return row

    def summarize(records: list[dict]) -> dict:
        """The rows in schedule order, each with its throughput, measured now for every schedule together."""
        failed = [r for r in records if r.get("status") != "ok"]
        if failed:
            raise RuntimeError(f"schedule {failed[0]['method']} failed: {failed[0].get('error')}")
        rows = [{k: v for k, v in r.items() if k not in ("method", "status", "cell_id")} for r in records]
        pixels = image_processor(images=images["test"][:batch], return_tensors="pt")["pixel_values"]
        speeds = image_throughput(model, pixels.to(model.device, model.dtype), methods, repeats)
        base = rows[0]
        for row in rows:
            s = speeds[row["spec"]]
            row.update(images_per_s=s["images_per_s"], median_s=s["median_s"], times_s=s["times_s"],
                       speedup=s["images_per_s"] / speeds[UNMERGED]["images_per_s"],
                       drop_points={p: 100 * (base["probe_accuracy"][p] - row["probe_accuracy"][p]) for p in probes})
        return {"config": {**config, "batch": int(pixels.shape[0]), "image_px": int(pixels.shape[-1])},
                "device": str(model.device), "dtype": str(model.dtype), "threads": torch.get_num_threads(),
                "load_avg_1m": [load_before, load_average()], "rows": rows}

    result = ToMeSweepResult(summary={}, out_dir=out)

    def plot(folder, summary, records):
        result.plot = plot_tome_sweep(summary, folder / "tome_sweep.png")

    cells = [SweepCell(label, sample="scenes", payload=method) for label, method in methods.items()]
    done = sweep(cells, run, out=out, resume=resume, overwrite=overwrite, summarize=summarize, write_extra=plot,
                 config=config, progress=progress, desc="tome-sweep", rotate=False,
                 on_error=_raise)
    result.summary = done.summary
    return result


def _raise(cell, exc: BaseException) -> dict:
    """A schedule that fails stops the sweep: the table compares every schedule to the unmerged model."""
    raise exc


def plot_tome_sweep(summary: dict, path) -> Path:
    """Speedup against mean probe accuracy and against [CLS] cosine, one labelled point per schedule; a PNG at
    ``path``, returned."""
    from .plots import _figure

    fig = _figure(10, 3.6)
    for ax, key, ylabel in zip(fig.subplots(1, 2), ("probe_mean", "cos_cls_mean"),
                               ("linear-probe accuracy (mean over attributes)", "cosine of [CLS] to unmerged")):
        for row in summary["rows"]:
            ax.scatter(row["speedup"], row[key])
            ax.annotate(row["spec"], (row["speedup"], row[key]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel("images/s speedup over unmerged")
        ax.set_ylabel(ylabel, fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def tome_table(summary: dict) -> str:
    """Markdown: per schedule the tokens after the last block, images/s and speedup, each probe's accuracy, the mean
    drop in points and the cosine similarities."""
    probes = summary["config"]["probes"]
    lines = ["| schedule | tokens after | images/s | speedup | " + " | ".join(f"probe {p}" for p in probes)
             + " | mean drop (points) | cos CLS (mean / min) | cos patch mean |",
             "|" + "---|" * (7 + len(probes))]
    for r in summary["rows"]:
        drop = sum(r["drop_points"].values()) / len(probes)
        lines.append(f"| {r['spec']} | {r['tokens_after']} | {r['images_per_s']:.1f} | {r['speedup']:.2f}x | "
                     + " | ".join(f"{r['probe_accuracy'][p]:.3f}" for p in probes)
                     + f" | {drop:.1f} | {r['cos_cls_mean']:.4f} / {r['cos_cls_min']:.4f} | {r['cos_patch_mean']:.4f} |")
    return "\n".join(lines)


__all__ = ["PROBES", "ToMeSweepResult", "image_features", "image_throughput", "pooled_features", "probe_accuracy",
           "resolve_schedules", "sample_frames", "tome_sweep", "tome_table"]
