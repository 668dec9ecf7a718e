"""Seeded synthetic video clips for video needle-in-a-haystack (V-NIAH).

A clip is a slowly changing scene: a muted texture that pans and slowly brightens and darkens, with one shape moving
across it. One frame, the needle, shows a large number (seven-segment digits in a palette colour on a dark panel).
The question asks for the number (or its colour, or which way the shape moved), so the model must find one frame
among many. The task imitates V-NIAH of LongVA (Zhang et al., 2024, "Long Context Transfer from Language to
Vision", arXiv 2406.16852), which plants a needle image in a long video and asks about it, as the text NIAH of
:mod:`mmaccel.data.haystack` plants a sentence in a long document.

Frames are rendered on demand from the seed, so a 1,000-frame clip holds one background texture (``size**2 * 3``
bytes), not 1,000 frames, until :meth:`Clip.frames` is asked for them.

>>> clip = make_clip(256, seed=3, depth=0.5)
>>> clip.question, clip.answer, clip.needle_frame
('What number appeared in the video?', '5', 128)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from .scenes import PALETTE, SHAPES, textured_background

#: Question types of a clip: the needle's number, the needle's colour, the moving shape's direction.
CLIP_KINDS = ("number", "colour", "motion")
DIRECTIONS = ("left", "right", "up", "down")
#: Lit segments of each digit; segments are named a (top), b (top right), c (bottom right), d (bottom),
#: e (bottom left), f (top left), g (middle), as on a seven-segment display.
SEVEN_SEGMENTS = {
    "0": "abcdef", "1": "bc", "2": "abdeg", "3": "abcdg", "4": "bcfg",
    "5": "acdfg", "6": "acdefg", "7": "abc", "8": "abcdefg", "9": "abcdfg",
}
PANEL_RGB = (16, 16, 16)
_QUESTIONS = {
    "number": "What number appeared in the video?",
    "colour": "What color was the number that appeared in the video?",
    "motion": "Which way did the {name} move?",
}


def segment_boxes(box: tuple[int, int, int, int]) -> dict[str, tuple[int, int, int, int]]:
    """The seven segment rectangles of one digit drawn in ``box``.

    Parameters
    ----------
    box : (x0, y0, x1, y1)
        The digit's bounding box in pixels (inclusive corners, PIL's convention), about twice as tall as wide.

    Returns
    -------
    dict
        Segment name (``"a"`` ... ``"g"``) -> ``(x0, y0, x1, y1)``. The centre pixel of each rectangle belongs to
        that segment only, so a reader can tell lit segments apart by sampling the centres.
    """
    x0, y0, x1, y1 = box
    w, h = x1 - x0 + 1, y1 - y0 + 1
    th = max(2, w // 5)
    ym = y0 + h // 2
    return {
        "a": (x0, y0, x1, y0 + th - 1),
        "b": (x1 - th + 1, y0, x1, ym),
        "c": (x1 - th + 1, ym, x1, y1),
        "d": (x0, y1 - th + 1, x1, y1),
        "e": (x0, ym, x0 + th - 1, y1),
        "f": (x0, y0, x0 + th - 1, ym),
        "g": (x0, ym - th // 2, x1, ym - th // 2 + th - 1),
    }


@dataclass
class Clip:
    """A synthetic clip with one needle frame and a question about it; frames are rendered on demand.

    Attributes
    ----------
    num_frames : int
    size : int
        Frames are ``size x size`` RGB.
    seed : int
    needle_frame : int
        Index of the needle frame, ``0 <= needle_frame < num_frames``.
    question, answer : str
        The answer is one word or a number (digits only).
    kind : str
        One of :data:`CLIP_KINDS`.
    number : str
        The digits on the needle frame.
    number_colour : str
        Their colour, a key of :data:`~mmaccel.data.scenes.PALETTE`.
    digit_boxes : tuple of (x0, y0, x1, y1)
        Where each digit is drawn on the needle frame (see :func:`segment_boxes`).
    mover : dict
        The moving shape: ``shape``, ``colour``, ``direction`` (one of :data:`DIRECTIONS`), ``radius`` (pixels),
        ``start`` and ``end`` centres ``(x, y)`` at the first and last frame.
    """

    num_frames: int
    size: int
    seed: int
    needle_frame: int
    question: str
    answer: str
    kind: str
    number: str
    number_colour: str
    digit_boxes: tuple[tuple[int, int, int, int], ...]
    mover: dict
    _background: np.ndarray = field(repr=False)
    _sprite: np.ndarray = field(repr=False)
    _pan: float = field(repr=False)
    _drift: tuple[float, float] = field(repr=False)

    def __len__(self) -> int:
        return self.num_frames

    def __iter__(self):
        return (self.frame(t) for t in range(self.num_frames))

    def frame(self, t: int) -> np.ndarray:
        """Frame ``t`` as a ``[size, size, 3]`` uint8 array (a new array each call).

        Raises
        ------
        IndexError
            If ``t`` is outside ``[0, num_frames)``.
        """
        if not 0 <= t < self.num_frames:
            raise IndexError(f"frame {t} is outside a clip of {self.num_frames} frames")
        period, phase = self._drift
        shade = round(12.0 * math.sin(2 * math.pi * t / period + phase))
        out = np.roll(self._background, int(t * self._pan), axis=1).astype(np.int16)
        out = np.clip(out + shade, 0, 255).astype(np.uint8)
        x, y = self.mover_center(t)
        r = self.mover["radius"]
        out[y - r : y + r + 1, x - r : x + r + 1][self._sprite] = PALETTE[self.mover["colour"]]
        if t == self.needle_frame:
            image = Image.fromarray(out)
            draw = ImageDraw.Draw(image)
            pad = self.size // 12
            boxes = self.digit_boxes
            draw.rectangle((boxes[0][0] - pad, boxes[0][1] - pad, boxes[-1][2] + pad, boxes[-1][3] + pad),
                           fill=PANEL_RGB)
            for digit, box in zip(self.number, boxes):
                segments = segment_boxes(box)
                for name in SEVEN_SEGMENTS[digit]:
                    draw.rectangle(segments[name], fill=PALETTE[self.number_colour])
            out = np.asarray(image).copy()
        return out

    def mover_center(self, t: int) -> tuple[int, int]:
        """Centre ``(x, y)`` in pixels of the moving shape at frame ``t``: a straight line from start to end."""
        (x0, y0), (x1, y1) = self.mover["start"], self.mover["end"]
        f = t / max(self.num_frames - 1, 1)
        return round(x0 + (x1 - x0) * f), round(y0 + (y1 - y0) * f)

    def frames(self, indices=None) -> np.ndarray:
        """Frames as one ``[N, size, size, 3]`` uint8 array: all of them, or those at ``indices`` (in that order).

        A 1,000-frame clip at 168 x 168 is 85 MB; pass ``indices`` (e.g. ``np.linspace(0, T - 1, 64).round()``)
        to sample.
        """
        idx = range(self.num_frames) if indices is None else [int(i) for i in indices]
        out = np.empty((len(idx), self.size, self.size, 3), dtype=np.uint8)
        for k, t in enumerate(idx):
            out[k] = self.frame(t)
        return out


def _digit_boxes(size: int, n: int) -> tuple[tuple[int, int, int, int], ...]:
    w = min(size // 4, int(0.6 * size / (1.4 * n)))
    h, gap = 2 * w, max(2, int(0.4 * w))
    total = n * w + (n - 1) * gap
    x, y = (size - total) // 2, (size - h) // 2
    return tuple((x + i * (w + gap), y, x + i * (w + gap) + w - 1, y + h - 1) for i in range(n))


def _sprite(shape: str, r: int) -> np.ndarray:
    mask = Image.new("L", (2 * r + 1, 2 * r + 1), 0)
    draw = ImageDraw.Draw(mask)
    box = (0, 0, 2 * r, 2 * r)
    if shape == "circle":
        draw.ellipse(box, fill=255)
    elif shape == "square":
        draw.rectangle(box, fill=255)
    else:
        draw.polygon([(r, 0), (0, 2 * r), (2 * r, 2 * r)], fill=255)
    return np.asarray(mask) > 0


def make_clip(
    num_frames: int,
    seed: int = 0,
    *,
    needle_frame: int | None = None,
    depth: float | None = None,
    size: int = 168,
    kind: str = "number",
    digits: int = 1,
) -> Clip:
    """A clip of ``num_frames`` frames with one needle frame, and a question about it.

    Parameters
    ----------
    num_frames : int
        Clip length in frames, >= 1.
    seed : int
        Non-negative generator seed. The background, the moving shape and the needle's number and colour depend
        only on ``seed``, ``num_frames``, ``size`` and ``digits``, so a depth sweep moves the same needle through the
        same clip. Use :func:`mmaccel.data.splits.split_seed` for held-out clips.
    needle_frame : int, optional
        Index of the needle frame.
    depth : float, optional
        Relative position of the needle instead, 0.0 (first frame) to 1.0 (last):
        ``needle_frame = round(depth * (num_frames - 1))``. Neither given: a seeded random frame.
    size : int
        Frame side in pixels, >= 32 (168 gives a ViT-S/14 a 12 x 12 patch grid).
    kind : str
        The question, one of :data:`CLIP_KINDS`: ``"number"`` ("What number appeared in the video?" -> the digits),
        ``"colour"`` (the digits' colour name) or ``"motion"`` ("Which way did the red circle move?" -> one of
        :data:`DIRECTIONS`; the needle frame is still there).
    digits : int
        Digits in the number, 1 to 3 (no leading zero).

    Returns
    -------
    Clip

    Raises
    ------
    ValueError
        For ``num_frames < 1``, both ``needle_frame`` and ``depth``, a needle frame or depth out of range, an unknown
        kind, ``digits`` outside 1..3, or ``size < 32``.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if needle_frame is not None and depth is not None:
        raise ValueError("give needle_frame or depth, not both")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if needle_frame is not None and not 0 <= needle_frame < num_frames:
        raise ValueError(f"needle_frame must be in [0, {num_frames}), got {needle_frame}")
    if kind not in CLIP_KINDS:
        raise ValueError(f"unknown clip question kind {kind!r}; use one of {CLIP_KINDS}")
    if not 1 <= digits <= 3:
        raise ValueError(f"digits must be 1, 2 or 3, got {digits}")
    if size < 32:
        raise ValueError(f"size must be >= 32 pixels, got {size}")
    rng = np.random.default_rng(seed)
    background = textured_background(rng, size)
    pan = float(rng.uniform(0.2, 0.5))
    drift = (float(rng.uniform(200.0, 600.0)), float(rng.uniform(0.0, 2 * np.pi)))
    colours = list(PALETTE)
    number = str(rng.integers(1 if digits > 1 else 0, 10))
    number += "".join(str(d) for d in rng.integers(0, 10, size=digits - 1))
    number_colour = colours[int(rng.integers(len(colours)))]
    random_frame = int(rng.integers(num_frames))  # drawn always, so the draws after it do not depend on the needle
    shape, colour = SHAPES[int(rng.integers(len(SHAPES)))], colours[int(rng.integers(len(colours)))]
    direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    radius = max(3, size // 12)
    lo, hi = radius + 1, size - radius - 2
    across = int(rng.integers(lo, hi + 1))
    start, end = {
        "right": ((lo, across), (hi, across)),
        "left": ((hi, across), (lo, across)),
        "down": ((across, lo), (across, hi)),
        "up": ((across, hi), (across, lo)),
    }[direction]
    if needle_frame is None:
        needle_frame = round(depth * (num_frames - 1)) if depth is not None else random_frame
    mover = {"shape": shape, "colour": colour, "direction": direction, "radius": radius, "start": start, "end": end}
    answer = {"number": number, "colour": number_colour, "motion": direction}[kind]
    return Clip(
        num_frames=num_frames,
        size=size,
        seed=seed,
        needle_frame=needle_frame,
        question=_QUESTIONS[kind].format(name=f"{colour} {shape}"),
        answer=answer,
        kind=kind,
        number=number,
        number_colour=number_colour,
        digit_boxes=_digit_boxes(size, digits),
        mover=mover,
        _background=background,
        _sprite=_sprite(shape, radius),
        _pan=pan,
        _drift=drift,
    )
