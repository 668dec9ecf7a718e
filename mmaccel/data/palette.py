"""Seeded prompt -> palette-image pairs and moving-shape palette clips, for the ``micro-ar`` image/video AR model.

An image is a ``16 x 16`` grid of indices into a 16-colour palette (:data:`PALETTE16`): one or two flat shapes on a
plain background, described by a short prompt such as ``"red circle at top-left and blue square at center on
white"``. A clip is ``8`` frames of ``8 x 8``: one shape moving along a lane, ``"red square at top moving right on
black"``. Each pixel is one token of an autoregressive image model (LlamaGen-style raster order, Sun et al., 2024,
"Autoregressive Model Beats Diffusion: Llama for Scalable Image Generation", arXiv 2406.06525), so a ``16 x 16`` image
is 256 tokens and a clip 512.

The target picture is a pure function of the prompt (:func:`render_prompt`): every pixel a generated image gets
right or wrong is defined, and :func:`palette_accuracy` scores it. The shapes and the colour names reuse
:mod:`mmaccel.data.scenes` (``SHAPES``; its six object colours, with their RGB values, are six of the sixteen here)
and the motion directions of :mod:`mmaccel.data.clips`; the scenes' textured backgrounds and anti-aliased shapes do
not fit a 16-colour, 16-pixel canvas, hence this small renderer.

>>> sample = make_palette_sample(0)
>>> sample.prompt, sample.indices.shape
('...', (16, 16))
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .clips import DIRECTIONS
from .scenes import PALETTE as SCENE_PALETTE
from .scenes import SHAPES
from .splits import split_seed

#: The 16 colours (name -> RGB); the index of a name is its image token.
PALETTE16: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "grey": (128, 128, 128),
    "navy": (20, 30, 90),
    **SCENE_PALETTE,  # red, green, blue, yellow, purple, cyan
    "orange": (245, 140, 20),
    "pink": (250, 150, 200),
    "brown": (120, 70, 30),
    "lime": (170, 240, 60),
    "teal": (0, 120, 120),
    "maroon": (110, 0, 30),
}
COLOURS: tuple[str, ...] = tuple(PALETTE16)
#: Background colours; objects take the other twelve.
BACKGROUNDS: tuple[str, ...] = ("black", "white", "grey", "navy")
OBJECT_COLOURS: tuple[str, ...] = tuple(c for c in COLOURS if c not in BACKGROUNDS)
#: Cells of the 3 x 3 grid, row by row.
POSITIONS: tuple[str, ...] = ("top-left", "top", "top-right", "left", "center", "right",
                              "bottom-left", "bottom", "bottom-right")
#: Lanes of a moving shape: rows for horizontal motion, columns for vertical motion.
LANES = {"left": ("top", "center", "bottom"), "right": ("top", "center", "bottom"),
         "up": ("left", "center", "right"), "down": ("left", "center", "right")}
#: Every word a prompt can use (the text vocabulary of ``micro-ar``).
WORDS: tuple[str, ...] = tuple(dict.fromkeys((*COLOURS, *SHAPES, *POSITIONS, *DIRECTIONS, "at", "on", "and", "moving")))
IMAGE_SIZE = 16
IMAGE_RADIUS = 2
VIDEO_SIZE = 8
VIDEO_FRAMES = 8
VIDEO_RADIUS = 1
KINDS = ("image", "video")


@dataclass(frozen=True)
class PaletteSample:
    """One prompt and its target picture.

    Attributes
    ----------
    prompt : str
        Space-separated words from :data:`WORDS`.
    indices : numpy.ndarray
        uint8 palette indices: ``[16, 16]`` for an image, ``[8, 8, 8]`` (frames, rows, columns) for a clip.
    kind : str
        ``"image"`` or ``"video"``.
    seed : int
        The generator seed (:func:`make_palette_sample`).
    """

    prompt: str
    indices: np.ndarray
    kind: str
    seed: int

    @property
    def rgb(self) -> np.ndarray:
        """The picture in RGB: ``[16, 16, 3]`` or ``[8, 8, 8, 3]`` uint8 (:func:`palette_to_rgb`)."""
        return palette_to_rgb(self.indices)


def _centre(cell: int, size: int) -> int:
    """Pixel centre of grid cell ``cell`` (0..2) along a side of ``size`` pixels."""
    return int((cell + 0.5) * size / 3)


def shape_mask(shape: str, centre: tuple[int, int], radius: int, size: int) -> np.ndarray:
    """Pixels of one flat shape on a ``size x size`` canvas.

    Parameters
    ----------
    shape : str
        One of ``SHAPES`` (``circle``, ``square``, ``triangle``: upright, apex on top).
    centre : (int, int)
        ``(x, y)`` in pixels.
    radius : int
        Half-extent in pixels; the shape lies in the square ``centre +- radius``.
    size : int
        Canvas side in pixels.

    Returns
    -------
    numpy.ndarray
        ``[size, size]`` bool.

    Raises
    ------
    ValueError
        For an unknown shape.
    """
    y, x = np.mgrid[0:size, 0:size]
    dx, dy = x - centre[0], y - centre[1]
    box = (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    if shape == "square":
        return box
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius + radius - 0.5
    if shape == "triangle":
        return box & (2 * np.abs(dx) <= dy + radius)
    raise ValueError(f"unknown shape {shape!r}; use one of {SHAPES}")


def _word(words: list[str], i: int, allowed, what: str, prompt: str) -> str:
    if i >= len(words) or words[i] not in allowed:
        got = words[i] if i < len(words) else "the end of the prompt"
        raise ValueError(f"cannot parse prompt {prompt!r}: expected {what} ({', '.join(allowed)}) at word {i + 1}, "
                         f"got {got!r}; see mmaccel.data.palette for the grammar")
    return words[i]


def render_prompt(prompt: str) -> np.ndarray:
    """The target picture of a prompt: the deterministic rendering that :func:`palette_accuracy` scores against.

    Grammar: an image is ``"<colour> <shape> at <position> [and <colour> <shape> at <position>] on <background>"``
    (``16 x 16``, shapes of radius 2 centred in cells of a 3 x 3 grid); a clip is ``"<colour> <shape> at <lane>
    moving <direction> on <background>"`` (8 frames of ``8 x 8``, radius 1, the shape's centre moving one pixel per
    frame from one edge of the frame to the other along the lane, so frame ``t + 1`` is frame ``t`` shifted).

    Parameters
    ----------
    prompt : str
        Words from :data:`WORDS`, separated by spaces.

    Returns
    -------
    numpy.ndarray
        uint8 palette indices, ``[16, 16]`` for an image or ``[8, 8, 8]`` for a clip.

    Raises
    ------
    ValueError
        If the prompt does not follow the grammar (the message names the word that does not fit).
    """
    words = prompt.split()
    if "moving" in words:
        colour = _word(words, 0, OBJECT_COLOURS, "an object colour", prompt)
        shape = _word(words, 1, SHAPES, "a shape", prompt)
        _word(words, 2, ("at",), "'at'", prompt)
        direction = _word(words, 5, DIRECTIONS, "a direction", prompt)
        lane = _word(words, 3, LANES[direction], f"a lane for moving {direction}", prompt)
        _word(words, 4, ("moving",), "'moving'", prompt)
        _word(words, 6, ("on",), "'on'", prompt)
        background = _word(words, 7, BACKGROUNDS, "a background", prompt)
        if len(words) != 8:
            raise ValueError(f"cannot parse prompt {prompt!r}: a clip prompt has 8 words")
        return _render_clip(colour, shape, lane, direction, background)
    objects, i = [], 0
    while True:
        colour = _word(words, i, OBJECT_COLOURS, "an object colour", prompt)
        shape = _word(words, i + 1, SHAPES, "a shape", prompt)
        _word(words, i + 2, ("at",), "'at'", prompt)
        position = _word(words, i + 3, POSITIONS, "a position", prompt)
        objects.append((colour, shape, position))
        i += 4
        if i < len(words) and words[i] == "and" and len(objects) < 2:
            i += 1
            continue
        break
    _word(words, i, ("on",), "'on'", prompt)
    background = _word(words, i + 1, BACKGROUNDS, "a background", prompt)
    if len(words) != i + 2:
        raise ValueError(f"cannot parse prompt {prompt!r}: words after the background")
    if len(objects) == 2 and objects[0][2] == objects[1][2]:
        raise ValueError(f"cannot parse prompt {prompt!r}: two objects at the same position")
    out = np.full((IMAGE_SIZE, IMAGE_SIZE), COLOURS.index(background), dtype=np.uint8)
    for colour, shape, position in objects:
        row, col = divmod(POSITIONS.index(position), 3)
        centre = (_centre(col, IMAGE_SIZE), _centre(row, IMAGE_SIZE))
        out[shape_mask(shape, centre, IMAGE_RADIUS, IMAGE_SIZE)] = COLOURS.index(colour)
    return out


def _render_clip(colour: str, shape: str, lane: str, direction: str, background: str) -> np.ndarray:
    size, r, frames = VIDEO_SIZE, VIDEO_RADIUS, VIDEO_FRAMES
    across = _centre(LANES[direction].index(lane), size)
    out = np.full((frames, size, size), COLOURS.index(background), dtype=np.uint8)
    for t in range(frames):
        along = t if direction in ("right", "down") else size - 1 - t  # one pixel per frame, edge to edge
        centre = (along, across) if direction in ("left", "right") else (across, along)
        out[t][shape_mask(shape, centre, r, size)] = COLOURS.index(colour)
    return out


def make_palette_sample(seed: int, kind: str = "image") -> PaletteSample:
    """A random prompt (one or two objects for an image, one mover for a clip) and its target picture.

    Parameters
    ----------
    seed : int
        Non-negative generator seed; the same seed and kind give the same sample. Use
        :func:`mmaccel.data.splits.split_seed` (or :func:`palette_samples`) for held-out samples.
    kind : str
        ``"image"`` or ``"video"``.

    Returns
    -------
    PaletteSample

    Raises
    ------
    ValueError
        For an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {KINDS}")
    rng = np.random.default_rng(seed)
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    if kind == "video":
        direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
        lane = LANES[direction][int(rng.integers(3))]
        colour = OBJECT_COLOURS[int(rng.integers(len(OBJECT_COLOURS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        prompt = f"{colour} {shape} at {lane} moving {direction} on {background}"
    else:
        n = int(rng.integers(1, 3))
        cells = rng.choice(len(POSITIONS), size=n, replace=False).tolist()
        parts = [f"{OBJECT_COLOURS[int(rng.integers(len(OBJECT_COLOURS)))]} {SHAPES[int(rng.integers(len(SHAPES)))]} "
                 f"at {POSITIONS[c]}" for c in cells]
        prompt = " and ".join(parts) + f" on {background}"
    return PaletteSample(prompt=prompt, indices=render_prompt(prompt), kind=kind, seed=seed)


def palette_samples(n: int, *, kind: str = "image", split: str = "train", seed: int = 0) -> list[PaletteSample]:
    """``n`` samples from a fixed split (train and test seeds never overlap, :mod:`mmaccel.data.splits`).

    Raises
    ------
    ValueError
        For an unknown kind or split, or a seed out of range.
    """
    return [make_palette_sample(split_seed(split, seed, i), kind) for i in range(n)]


def palette_to_rgb(indices) -> np.ndarray:
    """Map palette indices to RGB.

    Parameters
    ----------
    indices : array-like of int
        ``[...]`` indices in ``0 .. 15``.

    Returns
    -------
    numpy.ndarray
        ``[..., 3]`` uint8.

    Raises
    ------
    ValueError
        If an index is outside the palette.
    """
    idx = np.asarray(indices)
    if idx.size and (idx.min() < 0 or idx.max() >= len(COLOURS)):
        raise ValueError(f"palette indices must be in 0..{len(COLOURS) - 1}, got {idx.min()}..{idx.max()}")
    table = np.array(list(PALETTE16.values()), dtype=np.uint8)
    return table[idx.astype(np.int64)]


def palette_accuracy(generated, target) -> float:
    """Pixel-level palette accuracy: the fraction of pixels whose palette index equals the target's.

    Parameters
    ----------
    generated, target : array-like of int
        Palette indices of the same shape (``[16, 16]``, ``[8, 8, 8]`` ...); a generated value outside the palette
        (a non-image token) counts as wrong.

    Returns
    -------
    float
        In ``[0, 1]``.

    Raises
    ------
    ValueError
        If the shapes differ or the arrays are empty.
    """
    gen, tgt = np.asarray(generated), np.asarray(target)
    if gen.shape != tgt.shape or gen.size == 0:
        raise ValueError(f"generated {gen.shape} and target {tgt.shape} must be non-empty and of the same shape")
    return float((gen == tgt).mean())


def save_picture(indices, path, *, scale: int = 8, fps: float = 4.0) -> Path:
    """Write a palette image or clip as PNG, GIF or MP4 (the suffix decides), each pixel a ``scale x scale`` block.

    Parameters
    ----------
    indices : array-like of int
        ``[H, W]`` image or ``[T, H, W]`` clip of palette indices (:func:`palette_to_rgb`).
    path : str or os.PathLike
        ``.png`` (a clip: its frames side by side), ``.gif`` (a clip: animated, looping) or ``.mp4`` (PyAV, via
        :func:`mmaccel.data.media.write_video`; an image is a one-frame video).
    scale : int
        Upscaling factor, ``>= 1`` (nearest neighbour); the MP4 needs ``scale * H`` and ``scale * W`` even.
    fps : float
        Frames per second of a GIF or MP4.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    ValueError
        For an unsupported suffix, a picture that is not 2-D or 3-D, ``scale < 1``, or an index outside the palette.
    """
    from PIL import Image

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".png", ".gif", ".mp4"):
        raise ValueError(f"cannot write {path.name}: use a .png, .gif or .mp4 file name")
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be an int >= 1, got {scale!r}")
    rgb = palette_to_rgb(indices)
    if rgb.ndim == 3:
        rgb = rgb[None]
    if rgb.ndim != 4:
        raise ValueError(f"a picture is [H, W] or [T, H, W] palette indices, got shape {np.shape(indices)}")
    frames = rgb.repeat(scale, axis=1).repeat(scale, axis=2)
    if suffix == ".mp4":
        from .media import write_video

        return write_video(frames, path, fps=fps)
    if suffix == ".png":
        Image.fromarray(np.concatenate(list(frames), axis=1)).save(path)
        return path
    images = [Image.fromarray(f) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return path
