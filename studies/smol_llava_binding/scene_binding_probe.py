"""Can one attention head bind a question's word to an object's patches in smol-llava's frozen DINOv2 features?

The scene questions "What color is the <shape>?" and "What shape is the <colour> object?" need a lookup: find the
patches of the named object among the 144, then read another of its attributes. Every trained ``smol-llava`` and
``micro-llava`` answers colour questions at chance among the colours present (see their cards). This probe asks
whether the features allow the lookup at all, with the smallest model that can do it:

- query: a learnt embedding of the question's word (a shape for colour questions, a colour for shape questions);
- keys and values: linear maps (to 64 dims) of LayerNorm(patch features) of one DINOv2 layer;
- one softmax over the 144 patches, then a 2-layer MLP to the answer. Adam lr 3e-3, batch 64.

Scenes: ``mmaccel.data.scenes.make_scene`` (2-5 objects). Each object whose shape (colour) is unique in its scene
gives one colour (shape) question. Held-out accuracy per layer and epoch goes to ``--out`` (JSON) and stdout.

    python studies/smol_llava_binding/scene_binding_probe.py --threads 2 --out studies/smol_llava_binding/scene_binding_probe.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from smol_llava_feature_probe import parse_and_load  # the sibling script in this folder

from mmaccel.data.scenes import PALETTE, SHAPES, make_scene
from mmaccel.data.splits import split_seed

COLOURS = list(PALETTE)


def scene_features(tower, processor, split: str, n: int, layers: list[int]):
    """[n, len(layers), 144, D] patch features and per-scene questions (kind 0 colour / 1 shape, word, answer)."""
    feats, questions = [], []
    for i in range(n):
        scene = make_scene(split_seed(split, 0, i))
        px = processor.image_processor(scene.image, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            hidden = tower(px, output_hidden_states=True).hidden_states
        feats.append(torch.stack([hidden[layer][0, 1:] for layer in layers]))
        shapes, colours = [o.shape for o in scene.objects], [o.colour for o in scene.objects]
        qs = []
        for o in scene.objects:
            if shapes.count(o.shape) == 1:
                qs.append((0, SHAPES.index(o.shape), COLOURS.index(o.colour)))
            if colours.count(o.colour) == 1:
                qs.append((1, COLOURS.index(o.colour), SHAPES.index(o.shape)))
        questions.append(qs)
    return torch.stack(feats), questions


class BindingHead(torch.nn.Module):
    """One cross-attention head from a question word over patch features, then an MLP to the answer (6 classes)."""

    def __init__(self, dim: int, hidden: int = 64):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.key, self.value = torch.nn.Linear(dim, hidden), torch.nn.Linear(dim, hidden)
        self.query = torch.nn.Embedding(2 * len(COLOURS), hidden)
        self.out = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, len(COLOURS)))
        self.scale = hidden ** -0.5

    def forward(self, patches, kind, word):
        """patches [B, N, D], kind [B], word [B] -> logits [B, 6]."""
        x = self.norm(patches)
        q = self.query(kind * len(COLOURS) + word)
        attn = torch.softmax(torch.einsum("bnh,bh->bn", self.key(x), q) * self.scale, -1)
        return self.out(torch.einsum("bn,bnh->bh", attn, self.value(x)))


def flat(questions):
    rows = torch.tensor([(i, k, w, a) for i, qs in enumerate(questions) for (k, w, a) in qs])
    return rows.unbind(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=int, default=1200, help="training scenes")
    p.add_argument("--test", type=int, default=300, help="held-out scenes")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 6, 8, 10, 12])
    p.add_argument("--epochs", type=int, default=8)
    a, tower, processor = parse_and_load(p)
    t0 = time.perf_counter()
    x_train, q_train = scene_features(tower, processor, "train", a.train, a.layers)
    x_test, q_test = scene_features(tower, processor, "test", a.test, a.layers)
    i, k, w, y = flat(q_train)
    ti, tk, tw, ty = flat(q_test)
    rows = []
    for li, layer in enumerate(a.layers):
        torch.manual_seed(0)
        head = BindingHead(x_train.shape[-1])
        opt = torch.optim.Adam(head.parameters(), 3e-3)
        for epoch in range(a.epochs):
            for b in torch.randperm(len(i)).split(64):
                loss = torch.nn.functional.cross_entropy(head(x_train[i[b], li], k[b], w[b]), y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                right = head(x_test[ti, li], tk, tw).argmax(-1) == ty
            row = {"layer": layer, "epoch": epoch + 1, "colour": float(right[tk == 0].float().mean()),
                   "shape": float(right[tk == 1].float().mean())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"train_scenes": a.train, "test_scenes": a.test, "train_questions": len(i), "test_questions": len(ti),
           "projector_reads_layer": 12, "seconds": time.perf_counter() - t0, "threads": torch.get_num_threads(),
           "rows": rows}
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
