"""Where the peak is: the tensors alive at the peak of one measured run, grouped by the code that allocated them.

``python benchmarks/peak_profile.py niah --model smollm2-135m --length 4096 --method snapkv:ratio=0.25``
``python benchmarks/peak_profile.py video --model smol-llava --frames 256 --method pooling:keep_ratio=0.0625``

One run of :func:`mmaccel.eval.generation.generate_measured` (a NIAH prompt with a KV method, or a video-NIAH clip
with a ``VISION[+KV]`` configuration) goes under ``torch.profiler`` with ``profile_memory=True`` and Python stacks.
Every CPU allocation and free is replayed in time order. At the moment the sum is highest, the live allocations are
grouped by the innermost Python frame of mmaccel or transformers that allocated them, plus the op. The peak equals
:class:`mmaccel.eval.memory.PeakMemory` ``cpu_meter="allocator"``. Times under the profiler are not meaningful.

Output: the peak (MiB) and a table of the largest groups, printed and written to ``--out`` as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections import defaultdict
from pathlib import Path

import torch

FRAME = re.compile(r"(mmaccel/[\w/]+\.py|transformers/[\w/]+\.py)\((\d+)\): (\w+)")


def _walk(nodes):
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def _label(node) -> str:
    """``file(line): function / op`` of the innermost mmaccel or transformers frame above an allocation."""
    op, frame, parent = None, None, node.parent
    while parent is not None and frame is None:
        name = parent.name
        match = FRAME.search(name)
        if match:
            frame = f"{match.group(1)}({match.group(2)}): {match.group(3)}"
        elif op is None and not name.endswith(".py") and "(" not in name:
            op = name
        parent = parent.parent
    return f"{frame or '?'} / {op or '?'}"


def live_at_peak(profiler) -> tuple[int, dict[str, int]]:
    """``(peak bytes, {label: bytes alive at the peak})`` from a finished profile with memory and stacks.

    Raises
    ------
    RuntimeError
        This torch's profile has no event tree (``kineto_results.experimental_event_tree``).
    """
    results = profiler.profiler.kineto_results
    if not hasattr(results, "experimental_event_tree"):
        raise RuntimeError("this torch's profiler exposes no event tree; upgrade torch")
    allocs = []
    for node in _walk(results.experimental_event_tree()):
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            allocs.append((node.start_time_ns, fields.ptr, fields.alloc_size, node))
    allocs.sort(key=lambda a: a[0])
    live: dict[int, tuple[int, object]] = {}
    total = peak = 0
    snapshot: dict[int, tuple[int, object]] = {}
    for _, ptr, size, node in allocs:
        if size > 0:
            live[ptr] = (size, node)
        else:
            live.pop(ptr, None)
        total += size
        if total > peak:
            peak, snapshot = total, dict(live)
    groups: dict[str, int] = defaultdict(int)
    for size, node in snapshot.values():
        groups[_label(node)] += size
    return peak, dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def _niah_inputs(args, tokenizer):
    from mmaccel.data.haystack import resolve_chat_template
    from mmaccel.eval import make_niah_sample

    chat = resolve_chat_template(tokenizer, "auto")
    sample = make_niah_sample(tokenizer, args.length, args.depth, seed=args.seed, chat_template=chat)
    return sample.input_ids, {"method": args.method}


def _video_inputs(args, processor):
    from mmaccel.data.clips import make_clip
    from mmaccel.data.splits import split_seed
    from mmaccel.eval.video_niah import clip_images
    from mmaccel.eval.visual import chat_inputs, parse_visual_config

    clip = make_clip(args.frames, seed=split_seed("test", args.seed, 0), depth=args.depth, size=168)
    config = parse_visual_config(args.method)
    return chat_inputs(processor, clip_images(clip), clip.question), {"vision": config.vision, "kv": config.kv}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=["niah", "video"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="full", help="niah: a KV spec; video: a VISION[+KV] configuration or none")
    p.add_argument("--length", type=int, default=4096, help="niah prompt tokens")
    p.add_argument("--frames", type=int, default=64, help="video frames")
    p.add_argument("--vision-batch", type=int, default=None,
                   help="video: encode the frames N at a time (mmaccel.vision_tokens.BatchedVisionEncoding)")
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from mmaccel.eval.generation import generate_measured
    from mmaccel.models import load

    torch.set_num_threads(args.threads)
    model, proc = load(args.model, device="cpu", dtype=torch.float32)
    tokenizer = getattr(proc, "tokenizer", proc)
    inputs, kwargs = (_niah_inputs if args.task == "niah" else _video_inputs)(args, proc)
    with contextlib.ExitStack() as stack:
        if args.vision_batch:
            from mmaccel.vision_tokens import BatchedVisionEncoding

            stack.enter_context(BatchedVisionEncoding(model, args.vision_batch))
        generate_measured(model, tokenizer, inputs, max_new_tokens=1, warmup=0, raise_errors=True, **kwargs)  # warm
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, profile_memory=True, with_stack=True) as prof:
            rec = generate_measured(model, tokenizer, inputs, max_new_tokens=args.max_new_tokens, warmup=0,
                                    raise_errors=True, **kwargs)
    peak, groups = live_at_peak(prof)
    top = list(groups.items())[: args.top]
    print(f"{args.task} {args.model} {args.method} ({args.length if args.task == 'niah' else args.frames}): "
          f"peak {peak / 2**20:.1f} MiB of tensors; answer {rec.output_text!r}")
    for label, size in top:
        print(f"  {size / 2**20:9.1f} MiB  {label}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "peak_bytes": peak,
                                        "live_at_peak": groups, "output_text": rec.output_text}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
