"""The token overlay of the Vision encoder and Image & video QA tabs: which patches each output token holds, drawn over the encoder's input.

Merged patches share one colour per token (outlined where a group ends), pruned patches are greyed out, patches kept
alone are left untouched, so an unmodified encoder's overlay is its input pixel for pixel.
"""
from __future__ import annotations

OVERLAY_SIDE = 448
"""Overlays are the encoder's input upscaled by a whole factor to at least this many pixels on the long side."""
_MERGE_ALPHA = 0.55  # share of a merged token's colour in its patches
_EDGE_RGB = (20, 20, 20)


def scaled_view(view, side: int = OVERLAY_SIDE):
    """``view`` upscaled by the smallest whole factor that makes its long side at least ``side`` pixels (bicubic),
    so that every patch stays a square of whole pixels; the overlay is drawn on the same picture."""
    from PIL import Image

    factor = max(1, -(-side // max(view.size)))
    return view if factor == 1 else view.resize((view.width * factor, view.height * factor), Image.BICUBIC)


def token_overlay(view, slots, side: int = OVERLAY_SIDE):
    """The encoder's input with its output tokens drawn over the patches.

    Parameters
    ----------
    view : PIL.Image.Image
        The image as the encoder saw it, ``h * patch x w * patch`` pixels (:meth:`EncoderRunner.view`).
    slots : numpy.ndarray
        [h, w] int: the output token of every patch, ``-1`` for a pruned patch (:meth:`VisionRun.patch_slots`).
    side : int
        Upscale as :func:`scaled_view` does.

    Returns
    -------
    PIL.Image.Image
        RGB, the size of ``scaled_view(view, side)``. A patch that is its own token is left as it is; the patches
        merged into one token are tinted with that token's colour (one hue per token, by the golden ratio) and
        outlined where the group ends; a pruned patch is greyed out. With no merged and no pruned patch the result
        equals ``scaled_view(view, side)`` pixel for pixel.
    """
    import numpy as np
    from matplotlib.colors import hsv_to_rgb
    from PIL import Image

    base = scaled_view(view, side)
    step = base.height // slots.shape[0]  # pixels per patch side
    arr = np.asarray(base, dtype=np.float32)
    px = np.repeat(np.repeat(slots, step, axis=0), step, axis=1)
    sizes = np.bincount(slots[slots >= 0].ravel(), minlength=int(slots.max()) + 1) if (slots >= 0).any() \
        else np.zeros(1, dtype=int)
    merged = (px >= 0) & (sizes[px.clip(min=0)] > 1)
    pruned = px < 0
    hue = (px.clip(min=0) * 0.6180339887) % 1.0
    colour = hsv_to_rgb(np.stack([hue, np.full_like(hue, 0.85), np.ones_like(hue)], axis=-1)) * 255
    out = arr.copy()
    out[merged] = (1 - _MERGE_ALPHA) * arr[merged] + _MERGE_ALPHA * colour[merged]
    luminance = arr @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    out[pruned] = (90 + 0.25 * luminance[pruned])[:, None]
    marked = merged | pruned
    edge = np.zeros(px.shape, dtype=bool)
    for axis in (0, 1):  # a 2-pixel line where the token changes next to a merged or pruned patch
        a = [slice(None), slice(None)]
        b = [slice(None), slice(None)]
        a[axis], b[axis] = slice(1, None), slice(None, -1)
        change = (px[tuple(a)] != px[tuple(b)]) & (marked[tuple(a)] | marked[tuple(b)])
        edge[tuple(a)] |= change
        edge[tuple(b)] |= change
    out[edge] = _EDGE_RGB
    return Image.fromarray(out.round().clip(0, 255).astype(np.uint8))
