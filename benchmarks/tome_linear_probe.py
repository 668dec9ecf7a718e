"""ToMe on the real dinov2-small: linear-probe accuracy on seeded scenes (object count) beside image throughput.

``python benchmarks/tome_linear_probe.py --out FILE.json [--schedules tome:r=8 tome:r=16] [--train 400 --test 200]``

- Task: how many objects a scene of :func:`mmaccel.data.scenes.make_scene` holds (2-5, four classes), train and test
  scenes from the disjoint seed ranges of :func:`mmaccel.data.splits.split_seed`.
- Features: [CLS] and the size-weighted patch mean of the last layer (DINOv2's linear-probe input), concatenated,
  computed under each schedule; one multinomial logistic regression (L-BFGS, L2 ``--l2``) per schedule, trained on
  that schedule's own train features, scored on its test features.
- Throughput: :func:`tome_dinov2.throughput` (interleaved, median, same process) on a batch of test scenes.

ToMe: Bolya et al., 2023, arXiv 2210.09461. DINOv2: Oquab et al., 2023, arXiv 2304.07193. A measurement script.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tome_dinov2 import pooled, throughput  # noqa: E402


def features(model, processor, images, method=None, batch: int = 16) -> torch.Tensor:
    """[N, 2D] float32: [CLS] and patch mean per image, under ``method`` (``None`` = unmerged)."""
    out = []
    for i in range(0, len(images), batch):
        pixels = processor(images=images[i : i + batch], return_tensors="pt")["pixel_values"]
        cls, patch, _ = pooled(model, pixels, method)
        out.append(torch.cat([cls, patch], -1).float())
    return torch.cat(out)


def probe_accuracy(train_x, train_y, test_x, test_y, l2: float = 1e-3, steps: int = 200) -> float:
    """Test accuracy of a multinomial logistic regression fitted with L-BFGS on standardised features."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    classes = int(train_y.max()) + 1
    layer = torch.nn.Linear(train_x.shape[1], classes)
    opt = torch.optim.LBFGS(layer.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(layer(train_x), train_y) + l2 * layer.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float((layer(test_x).argmax(-1) == test_y).float().mean())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["tome:r=8", "tome:r=16"])
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--l2", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import mmaccel
    from mmaccel.data.scenes import make_scene
    from mmaccel.data.splits import split_seed
    from mmaccel.vision_tokens import build_method

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, processor = mmaccel.load("dinov2-small")
    model.eval()
    sets = {}
    for split, n in (("train", args.train), ("test", args.test)):
        scenes = [make_scene(split_seed(split, 0, i)) for i in range(n)]
        sets[split] = ([s.image for s in scenes], torch.tensor([len(s.objects) - 2 for s in scenes]))
    methods = {"none": None, **{spec: build_method(spec) for spec in args.schedules}}
    load_before = os.getloadavg()[0]
    rows = []
    for label, method in methods.items():
        train_x = features(model, processor, sets["train"][0], method, args.batch)
        test_x = features(model, processor, sets["test"][0], method, args.batch)
        acc = probe_accuracy(train_x, sets["train"][1], test_x, sets["test"][1], args.l2)
        rows.append({"spec": label, "probe_accuracy": acc})
        print(f"{label}: probe accuracy {acc:.3f}", flush=True)
    pixels = processor(images=sets["test"][0][: args.batch], return_tensors="pt")["pixel_values"]
    speeds = throughput(model, pixels, methods, args.repeats)
    base_acc, base_speed = rows[0]["probe_accuracy"], speeds["none"]["images_per_s"]
    for row in rows:
        s = speeds[row["spec"]]
        row.update(images_per_s=s["images_per_s"], speedup=s["images_per_s"] / base_speed,
                   accuracy_drop_points=100 * (base_acc - row["probe_accuracy"]))
    result = {"model": "dinov2-small", "task": "scene object count (4 classes)", "train": args.train,
              "test": args.test, "threads": args.threads, "batch": args.batch,
              "load_avg_1m": [load_before, os.getloadavg()[0]], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print("| schedule | probe accuracy | drop (points) | images/s | speedup |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['spec']} | {r['probe_accuracy']:.3f} | {r['accuracy_drop_points']:.1f} | {r['images_per_s']:.1f} "
              f"| {r['speedup']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
