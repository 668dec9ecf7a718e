"""Does smol-llava's vision tower carry what the scene questions ask? Per-object linear probes on every DINOv2 layer.

For each object of ``--train`` training scenes and ``--test`` held-out scenes (``mmaccel.data.scenes``), take the
tower's hidden state of the patch under the object's centre ("centre") and the mean over the patches its bounding
box covers ("mean"), at every layer (0 = embeddings, 12 = last block, what smol-llava's projector reads), and fit a
multinomial logistic regression (L-BFGS, L2 1e-3, standardised features) for its colour (6-way), shape (3-way) and
size (2-way). Held-out accuracy per layer goes to ``--out`` (JSON) and stdout.

    python studies/smol_llava_binding/smol_llava_feature_probe.py --threads 2 --out studies/smol_llava_binding/smol_llava_feature_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import mmaccel
from mmaccel.data.scenes import PALETTE, SHAPES, make_scene
from mmaccel.data.splits import split_seed

ATTRS = (("colour", len(PALETTE)), ("shape", len(SHAPES)), ("size", 2))


def object_features(tower, processor, split: str, n: int, patch: int = 14, grid: int = 12):
    """[objects, layers, 2 (centre, mean), D] hidden states and [objects, 3] labels (colour, shape, size)."""
    xs, ys = [], []
    for i in range(n):
        scene = make_scene(split_seed(split, 0, i))
        px = processor.image_processor(scene.image, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            hidden = torch.stack([h[0, 1:] for h in tower(px, output_hidden_states=True).hidden_states])
        for o in scene.objects:
            (cx, cy), r = o.center, o.radius
            rows = range(max(0, (cy - r) // patch), min(grid, (cy + r) // patch + 1))
            cols = range(max(0, (cx - r) // patch), min(grid, (cx + r) // patch + 1))
            box = [a * grid + b for a in rows for b in cols]
            centre = (cy // patch) * grid + cx // patch
            xs.append(torch.stack([hidden[:, centre], hidden[:, box].mean(1)], 1))
            ys.append((list(PALETTE).index(o.colour), SHAPES.index(o.shape), int(o.size == "large")))
    return torch.stack(xs), torch.tensor(ys)


def probe(x_train, y_train, x_test, y_test, classes: int) -> float:
    """Held-out accuracy of an L2-regularised multinomial logistic regression fitted with L-BFGS."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-5
    x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
    w = torch.zeros(x_train.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x_train @ w + b, y_train) + 1e-3 * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return float(((x_test @ w + b).argmax(1) == y_test).float().mean())


def parse_and_load(p: argparse.ArgumentParser):
    """Add ``--threads`` and ``--out`` to a probe's parser, parse, set the threads and seed 0, load ``smol-llava``;
    returns ``(args, vision tower, processor)``; ``args.vision_feature_layer`` is the layer the projector reads.
    Shared with ``scene_binding_probe.py``."""
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model, processor = mmaccel.load("smol-llava", device="cpu")
    a.vision_feature_layer = int(model.config.vision_feature_layer)
    return a, model.model.vision_tower, processor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=int, default=250, help="training scenes")
    p.add_argument("--test", type=int, default=100, help="held-out scenes")
    a, tower, processor = parse_and_load(p)
    t0 = time.perf_counter()
    xtr, ytr = object_features(tower, processor, "train", a.train)
    xte, yte = object_features(tower, processor, "test", a.test)
    rows = []
    for layer in range(xtr.shape[1]):
        row = {"layer": layer}
        for j, where in enumerate(("centre", "mean")):
            for k, (attr, classes) in enumerate(ATTRS):
                row[f"{where}_{attr}"] = probe(xtr[:, layer, j], ytr[:, k], xte[:, layer, j], yte[:, k], classes)
        rows.append(row)
        print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v:2d}" for k, v in row.items()), flush=True)
    out = {"train_scenes": a.train, "test_scenes": a.test, "train_objects": len(ytr), "test_objects": len(yte),
           "projector_reads_layer": a.vision_feature_layer % xtr.shape[1],
           "seconds": time.perf_counter() - t0, "threads": torch.get_num_threads(), "load_avg": os.getloadavg()[0],
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
