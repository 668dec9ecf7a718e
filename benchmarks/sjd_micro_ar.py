"""Speculative Jacobi Decoding (and LANTERN) on ``micro-ar``: target forward passes and palette accuracy vs AR.

``python benchmarks/sjd_micro_ar.py [--images 32] [--clips 16] [--windows 16 32 64] [--temperature 1.0]
[--out benchmarks/results/speculative/sjd_micro_ar.json]`` (``--model DIR`` for another checkpoint)

For held-out test prompts (:func:`mmaccel.data.palette.palette_samples`, split ``test``) the committed ``micro-ar``
paints 16 x 16 images (272 tokens: 256 pixels and a row token per row) and 8-frame 8 x 8 clips (576 tokens):

- ``ar``: plain autoregressive decoding with ``model.generate`` (batched; one target forward per token, counted with
  a forward hook);
- ``sjd:init=random|neighbour[:k=K]``: :class:`~mmaccel.speculative.sjd.SpeculativeJacobi` through the shared engine,
  one prompt at a time, window ``K`` (the engine's ``num_draft_tokens``); ``neighbour`` copies the pixel above;
- clips also ``sjd:init=previous_frame``: each frame's window starts from the previous frame's tokens (our
  extension; the pixel above inside the first frame);
- ``lantern:k=..:delta=..``: :class:`~mmaccel.speculative.lantern.Lantern` around SJD (neighbour init), neighbours by
  palette RGB distance (lossy); ``k=16`` puts every colour in the neighbourhood (a stress test of the loss).

Each is run greedy (SJD must equal AR token for token; the ``identical`` column checks it) and sampled at
``--temperature`` (every method with its own seeded generator; AR sampled with ``generate``). Reported per method:
mean target forwards per picture (the prefill included), the forward ratio (AR forwards / method forwards), mean
accepted tokens per forward, palette accuracy against the prompt's rendered target (mean over pictures), its
difference to AR at the same temperature and whether that is within the stated tolerance (greedy: 0; sampled: the
larger of 0.01 and two standard errors of the difference), and wall seconds (secondary: the machine is shared, the
load average is recorded). A few pictures are written as PNG / GIF / MP4 beside the JSON.

The acceptance bar of issue 11: >= 2x fewer target forwards for images with quality within tolerance, >= 3x for
clips with previous-frame initialisation.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from mmaccel.data.palette import (
    PALETTE16,
    palette_accuracy,
    palette_samples,
    save_picture,
)
from mmaccel.models import load
from mmaccel.speculative.engine import speculative_generate
from mmaccel.speculative.lantern import Lantern, latent_neighbours
from mmaccel.speculative.sjd import SpeculativeJacobi
from mmaccel.zoo.train.micro_ar import LAYOUT, RASTER, left_pad, prompt_ids, tokens_to_picture

#: Tolerance on palette accuracy vs AR at the same temperature for "quality kept" (absolute, fraction of pixels).
QUALITY_TOLERANCE = 0.01
PALETTE_TOKENS = range(len(PALETTE16))


class ForwardCounter:
    """Counts forward calls of a module (a forward pre-hook, removed on exit)."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __enter__(self):
        self._h = self.module.register_forward_pre_hook(lambda *a: setattr(self, "calls", self.calls + 1))
        return self

    def __exit__(self, *exc):
        self._h.remove()


def run_ar(model, tok, samples, kind, temperature, seed):
    """Batched plain decoding; returns per-picture forwards, accuracies, pictures and seconds."""
    n = LAYOUT[kind][1]
    ids, mask = left_pad([prompt_ids(tok, s.prompt, kind) for s in samples], tok.pad_token_id)
    T = ids.shape[1]
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with ForwardCounter(model) as counter, torch.inference_mode():
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                             top_k=None, top_p=None, eos_token_id=None, pad_token_id=tok.pad_token_id)
    seconds = time.perf_counter() - t0
    pics = [tokens_to_picture(g[T:].tolist(), kind) for g in gen]
    return {"forwards": [counter.calls] * len(samples), "seconds": seconds, "pictures": pics,
            "tokens": [g[T:].tolist() for g in gen], "accepted_length": [1.0] * len(samples)}


def run_spec(model, tok, samples, kind, make_drafter, window, temperature, seed):
    """One prompt at a time through the shared engine."""
    n = LAYOUT[kind][1]
    out = {"forwards": [], "seconds": 0.0, "pictures": [], "tokens": [], "accepted_length": [], "telemetry": []}
    for i, s in enumerate(samples):
        ids = torch.tensor([prompt_ids(tok, s.prompt, kind)])
        gen = torch.Generator().manual_seed(seed + i)
        t0 = time.perf_counter()
        res = speculative_generate(model, ids, make_drafter(), max_new_tokens=n, temperature=temperature,
                                   num_draft_tokens=window, eos_token_id=None, generator=gen)
        out["seconds"] += time.perf_counter() - t0
        toks = res.sequences[0, ids.shape[1]:].tolist()
        out["forwards"].append(res.target_forwards)
        out["tokens"].append(toks)
        out["pictures"].append(tokens_to_picture(toks, kind))
        out["accepted_length"].append(res.mean_accepted_length)
        out["telemetry"].append(res.drafter_telemetry)
    return out


def methods_for(kind, windows, neighbours):
    """(label, drafter factory, window) for one kind of picture."""
    width, frame = RASTER[kind]  # token strides: the pixel above, the same pixel one frame back
    out = []
    for k in windows:
        out.append((f"sjd:init=random:window={k}", lambda: SpeculativeJacobi(init_tokens=PALETTE_TOKENS), k))
        out.append((f"sjd:init=neighbour:window={k}",
                    lambda: SpeculativeJacobi(init="neighbour", width=width, init_tokens=PALETTE_TOKENS), k))
        if kind == "video":
            out.append((f"sjd:init=previous_frame:window={k}",
                        lambda: SpeculativeJacobi(init="previous_frame", width=width, frame=frame,
                                                  init_tokens=PALETTE_TOKENS), k))
    k = max(windows)
    init = ({"init": "previous_frame", "width": width, "frame": frame} if kind == "video"
            else {"init": "neighbour", "width": width})
    for lk, delta in ((3, 0.1), (3, 0.3), (16, 0.3)):
        out.append((f"lantern:k={lk}:delta={delta}:init={init['init']}:window={k}",
                    lambda lk=lk, delta=delta: Lantern(k=lk, delta=delta, neighbours=neighbours,
                                                       init_tokens=PALETTE_TOKENS, **init), k))
    return out


def summarise(res, ar, samples, n_tokens, temperature):
    """One method's row: forwards, ratio, acceptance, palette accuracy and whether it is within tolerance of AR.

    Greedy: the tolerance is 0 (a lossless method must paint exactly AR's pictures). Sampling: the method and AR
    draw independent samples, so their mean accuracies differ by chance; the tolerance is the larger of
    :data:`QUALITY_TOLERANCE` and two standard errors of the difference of the two means.
    """
    accs = [palette_accuracy(p, s.indices) for p, s in zip(res["pictures"], samples)]
    ar_accs = [palette_accuracy(p, s.indices) for p, s in zip(ar["pictures"], samples)]
    delta = float(np.mean(accs) - np.mean(ar_accs))
    se = float(np.sqrt(np.var(accs, ddof=1) / len(accs) + np.var(ar_accs, ddof=1) / len(ar_accs))) if len(accs) > 1 \
        else 0.0
    tolerance = 0.0 if temperature == 0 else max(QUALITY_TOLERANCE, 2 * se)
    row = {
        "target_forwards_mean": float(np.mean(res["forwards"])),
        "forward_ratio_vs_ar": float(np.mean(ar["forwards"]) / np.mean(res["forwards"])),
        "mean_accepted_length": float(np.mean(res["accepted_length"])),
        "palette_accuracy": float(np.mean(accs)),
        "palette_accuracy_delta_vs_ar": delta,
        "delta_standard_error": se,
        "quality_tolerance": tolerance,
        "within_tolerance": abs(delta) <= tolerance,
        "palette_accuracy_per_picture": [round(a, 5) for a in accs],
        "exact_pictures": float(np.mean([a == 1.0 for a in accs])),
        "identical_to_ar": float(np.mean([a == b for a, b in zip(res["tokens"], ar["tokens"])])),
        "seconds": res["seconds"],
        "tokens_per_picture": n_tokens,
    }
    if res.get("telemetry"):
        t = res["telemetry"]
        row["stale_tokens_mean"] = float(np.mean([x.get("stale_tokens", 0) for x in t]))
        row["initialised_tokens_mean"] = float(np.mean([x.get("initialised_tokens", 0) for x in t]))
        if "relaxed_positions" in t[0]:
            row["relaxed_positions_mean"] = float(np.mean([x["relaxed_positions"] for x in t]))
            row["mean_moved_mass"] = float(np.mean([x["mean_moved_mass"] for x in t]))
            row["lossless"] = False
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="micro-ar")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/speculative/sjd_micro_ar.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(args.model, device="cpu")
    model.eval()
    neighbours = latent_neighbours(torch.tensor(list(PALETTE16.values()), dtype=torch.float32), len(PALETTE16),
                                   vocab_size=model.config.vocab_size, token_ids=PALETTE_TOKENS)
    out_path = Path(args.out)
    media_dir = out_path.with_suffix("")
    media_dir.mkdir(parents=True, exist_ok=True)
    result = {"config": {**vars(args), "device": "cpu", "torch": torch.__version__,
                         "hardware": f"{platform.machine()} {platform.processor() or ''}".strip(),
                         "quality_tolerance": QUALITY_TOLERANCE, "load_avg_start": os.getloadavg()},
              "results": {}}
    prompts = []
    train_log = Path("assets/models/micro-ar/train_log.json")
    if args.model == "micro-ar" and train_log.exists():
        log = json.loads(train_log.read_text())
        result["config"]["model_steps"] = log.get("steps")
        result["config"]["model_quality"] = log.get("quality")
    for kind, count in (("image", args.images), ("video", args.clips)):
        if count <= 0:
            continue
        samples = palette_samples(count, kind=kind, split="test", seed=args.seed)
        n_tokens = LAYOUT[kind][1]
        for temperature in (0.0, args.temperature):
            tag = f"{kind}/T={temperature:g}"
            ar = run_ar(model, tok, samples, kind, temperature, args.seed)
            rows = {"ar": summarise(ar, ar, samples, n_tokens, temperature)}
            print(f"{tag} ar: {rows['ar']['target_forwards_mean']:.1f} forwards, palette accuracy "
                  f"{rows['ar']['palette_accuracy']:.4f}", flush=True)
            for label, make, window in methods_for(kind, args.windows, neighbours):
                res = run_spec(model, tok, samples, kind, make, window, temperature, args.seed + 1000)
                rows[label] = summarise(res, ar, samples, n_tokens, temperature)
                r = rows[label]
                print(f"{tag} {label}: {r['target_forwards_mean']:.1f} forwards (x{r['forward_ratio_vs_ar']:.2f}), "
                      f"accepted {r['mean_accepted_length']:.2f}/forward, palette accuracy {r['palette_accuracy']:.4f}"
                      f" ({r['palette_accuracy_delta_vs_ar']:+.4f} vs AR, tolerance {r['quality_tolerance']:.4f}), "
                      f"identical {r['identical_to_ar']:.2f}, "
                      f"{r['seconds']:.1f} s", flush=True)
                if temperature == 0.0 and label.startswith("sjd:init=neighbour") and window == max(args.windows):
                    for i in range(min(2, count)):
                        stem = media_dir / f"{kind}{i}_{label.split(':')[1].split('=')[1]}"
                        pic = res["pictures"][i]
                        pic = np.where(pic == 255, 0, pic)  # non-image tokens drawn black
                        save_picture(pic, stem.with_suffix(".png"))
                        if kind == "video":
                            save_picture(pic, stem.with_suffix(".gif"))
                            save_picture(pic, stem.with_suffix(".mp4"))
                    prompts += [f"{kind}{i}: {samples[i].prompt}" for i in range(min(2, count))]
            result["results"][tag] = rows
    (media_dir / "prompts.txt").write_text("\n".join(prompts) + "\n")
    result["config"]["load_avg_end"] = os.getloadavg()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
