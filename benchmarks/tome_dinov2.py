"""ToMe on the real dinov2-small at 224 px: image throughput vs fidelity of pooled features, per schedule.

``python benchmarks/tome_dinov2.py --out runs/tome_dinov2.json [--schedules tome:r=0 tome:r=8 tome:r=16]
[--batch 8] [--repeats 5] [--threads 1]``

- Model: ``mmaccel.load("dinov2-small")`` (a transformers ``Dinov2Model``, SDPA) and its image processor (resize 256,
  centre crop 224: 16 x 16 patches + [CLS] = 257 tokens, 12 blocks).
- Photos: every scikit-image sample photo that loads offline (astronaut, chelsea, coffee, rocket, camera, cat...).
- Throughput: images/s of one forward on a batch of ``--batch`` photos, after one warm-up forward per schedule,
  median of ``--repeats`` timed forwards taken in interleaved rounds (every schedule once per round),
  ``torch.set_num_threads(--threads)``. The machine may be shared: the JSON records the load average before and
  after, so read absolute numbers with care; ratios within one run are what count.
- Fidelity: per photo, cosine similarity to the unmerged model of (a) the pooled [CLS] feature (``pooler_output``)
  and (b) the mean of the patch tokens (ToMe: size-weighted, i.e. the mean over the original patches); mean and min.

ToMe: Bolya et al., "Token Merging: Your ViT But Faster", 2023, arXiv 2210.09461. DINOv2: Oquab et al., 2023,
arXiv 2304.07193. This is a measurement script, not a test.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger("tome_dinov2")

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "cat", "horse", "hubble_deep_field",
          "immunohistochemistry", "coins", "moon", "page", "text", "clock")


def load_photos() -> dict:
    """The scikit-image sample photos that load without a download, as RGB PIL images."""
    from PIL import Image
    from skimage import data

    photos = {}
    for name in PHOTOS:
        try:
            array = getattr(data, name)()
        except (OSError, ValueError, ImportError) as exc:  # some photos need a download
            logger.info("skipping photo %s: %s", name, exc)
            continue
        photos[name] = Image.fromarray(array).convert("RGB")
    return photos


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["tome:r=8", "tome:r=12", "tome:r=16"],
                        help="ToMe specs (the unmerged model is always measured first)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/tome_dinov2.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import mmaccel
    from mmaccel.eval.tome_sweep import image_throughput as throughput
    from mmaccel.eval.tome_sweep import pooled_features as pooled
    from mmaccel.vision_tokens import build_method

    torch.set_num_threads(args.threads)
    model, processor = mmaccel.load("dinov2-small")
    model.eval()
    photos = load_photos()
    names = list(photos)
    pixels = processor(images=[photos[n] for n in names], return_tensors="pt")["pixel_values"]
    batch = pixels[: args.batch]
    if batch.shape[0] < args.batch:
        batch = batch.repeat((args.batch + batch.shape[0] - 1) // batch.shape[0], 1, 1, 1)[: args.batch]
    load_before = os.getloadavg()

    ref_cls, ref_patch, _ = pooled(model, pixels)
    methods = {"none": None, **{spec: build_method(spec) for spec in args.schedules}}
    speeds = throughput(model, batch, methods, args.repeats)
    base = speeds["none"]
    rows = [{"spec": "none", "tokens_after": 257, **base, "speedup": 1.0,
             "cos_cls_mean": 1.0, "cos_cls_min": 1.0, "cos_patch_mean": 1.0, "cos_patch_min": 1.0}]
    logger.info("unmerged: %.2f images/s", base["images_per_s"])
    for spec in args.schedules:
        method = methods[spec]
        cls, patch, telemetry = pooled(model, pixels, method)
        speed = speeds[spec]
        cos_cls = torch.nn.functional.cosine_similarity(cls, ref_cls, dim=-1)
        cos_patch = torch.nn.functional.cosine_similarity(patch, ref_patch, dim=-1)
        row = {"spec": spec, "schedule": telemetry.get("schedule"),
               "tokens_per_layer": telemetry.get("tokens_per_layer"), "tokens_after": telemetry.get("tokens_after"),
               **speed, "speedup": speed["images_per_s"] / base["images_per_s"],
               "cos_cls_mean": float(cos_cls.mean()), "cos_cls_min": float(cos_cls.min()),
               "cos_patch_mean": float(cos_patch.mean()), "cos_patch_min": float(cos_patch.min()),
               "cos_cls_per_photo": dict(zip(names, cos_cls.tolist(), strict=True))}
        rows.append(row)
        logger.info("%s: %.2f images/s (x%.2f), tokens %s, cos CLS mean %.4f min %.4f, cos patch-mean %.4f",
                    spec, row["images_per_s"], row["speedup"], row["tokens_after"], row["cos_cls_mean"],
                    row["cos_cls_min"], row["cos_patch_mean"])
    result = {
        "model": "dinov2-small", "image_px": 224, "batch": args.batch, "repeats": args.repeats,
        "threads": args.threads, "photos": names, "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "note": "shared machine: absolute images/s vary with the neighbours' load; compare ratios within this run",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
