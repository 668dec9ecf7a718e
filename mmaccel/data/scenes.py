"""Seeded synthetic scenes with questions: CLEVR-style scene QA, small enough to train and score on a CPU.

A scene is a few flat shapes (circle, square, triangle) in named colours and two sizes, one per cell of a coarse
grid, on a muted textured background, so that most patches are background (the redundancy visual-token methods
remove). Questions ask for one attribute or relation and have a one-word or one-digit answer. The task imitates
CLEVR (Johnson et al., 2017, "CLEVR: A Diagnostic Dataset for Compositional Language and Elementary Visual
Reasoning", arXiv 1612.06890) in 2-D: attribute queries, counting and spatial relations, with answers read off
the scene's metadata.

>>> qa = make_scene_qa(4, seed=0, split="test")
>>> qa[0].question, qa[0].answer
('What color is the square?', 'cyan')

Everything is a pure function of integer seeds: the same seed gives the same pixels and the same questions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from .splits import split_seed

#: Object colours (name -> RGB), saturated and far apart; the background is kept muted so none of them occurs there.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 90, 230),
    "yellow": (240, 210, 40),
    "purple": (150, 60, 190),
    "cyan": (40, 200, 210),
}
SHAPES = ("circle", "square", "triangle")
#: Half-extent of an object, as a fraction of a grid cell's side.
SIZES = {"small": 0.22, "large": 0.36}
#: Question types, in the order :func:`make_scene_qa` cycles through them.
QUESTION_KINDS = ("colour", "shape", "count", "relation", "size")
#: Every answer a scene question can have (counts are single digits: at most 9 objects).
ANSWERS = (*PALETTE, *SHAPES, *(str(d) for d in range(10)), "left", "right", "small", "large")


@dataclass(frozen=True)
class SceneObject:
    """One object of a scene.

    Attributes
    ----------
    shape : str
        One of :data:`SHAPES`.
    colour : str
        A key of :data:`PALETTE`; the object is filled with exactly that RGB value (no anti-aliasing).
    size : str
        A key of :data:`SIZES`.
    center : (int, int)
        ``(x, y)`` in pixels from the top-left corner; the pixel there always has the object's colour.
    radius : int
        Half-extent in pixels: the object lies inside the square ``center +- radius``.
    cell : (int, int)
        ``(row, col)`` of the grid cell that holds it; no two objects share a cell, so objects never overlap.
    """

    shape: str
    colour: str
    size: str
    center: tuple[int, int]
    radius: int
    cell: tuple[int, int]

    @property
    def name(self) -> str:
        """``"<colour> <shape>"``, e.g. ``"red circle"``; unique within a scene."""
        return f"{self.colour} {self.shape}"

    @property
    def rgb(self) -> tuple[int, int, int]:
        """The fill colour, ``PALETTE[colour]``."""
        return PALETTE[self.colour]


@dataclass
class Scene:
    """A rendered scene and what is in it.

    Attributes
    ----------
    image : PIL.Image.Image
        RGB, ``size x size`` pixels.
    objects : tuple of SceneObject
        In drawing order; colour-shape pairs are unique within a scene.
    seed : int
        The generator seed (:func:`make_scene`).
    """

    image: Image.Image
    objects: tuple[SceneObject, ...]
    seed: int


@dataclass
class SceneQA:
    """One question about one scene.

    Attributes
    ----------
    image : PIL.Image.Image
        The scene, RGB (shared, not copied, by the questions of one scene).
    question : str
        E.g. ``"What color is the triangle?"``.
    answer : str
        One word or one digit, a member of :data:`ANSWERS`.
    kind : str
        One of :data:`QUESTION_KINDS`.
    objects : tuple of SceneObject
        The scene's metadata, from which the answer was read.
    seed : int
        The scene's generator seed.
    """

    image: Image.Image
    question: str
    answer: str
    kind: str
    objects: tuple[SceneObject, ...]
    seed: int


def _num_objects_range(num_objects: int | tuple[int, int], grid: int) -> tuple[int, int]:
    lo, hi = (num_objects, num_objects) if isinstance(num_objects, int) else num_objects
    most = min(grid * grid, len(SHAPES) * len(PALETTE), 9)
    if not 1 <= lo <= hi <= most:
        raise ValueError(f"num_objects must be 1 <= low <= high <= {most} on a {grid}x{grid} grid, got {num_objects}")
    return lo, hi


def textured_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A muted, low-saturation texture: smooth blobs plus fine grain around a random grey-ish tint.

    Returns
    -------
    numpy.ndarray
        ``[size, size, 3]`` uint8; every channel stays within 40..190 and channels differ by at most about 40, so
        the saturated :data:`PALETTE` colours never appear in it.
    """
    tint = (rng.uniform(80.0, 150.0) + rng.uniform(-12.0, 12.0, size=3)).astype(np.float32)
    coarse = rng.normal(0.0, 18.0, size=(6, 6)).astype(np.float32)
    blobs = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BILINEAR))
    grain = rng.standard_normal(size=(size, size, 1), dtype=np.float32) * 5.0
    pixels = (blobs[:, :, None] + grain) + tint
    return np.clip(pixels, 40, 190).astype(np.uint8)


def _draw(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    (x, y), r = obj.center, obj.radius
    box = (x - r, y - r, x + r, y + r)
    if obj.shape == "circle":
        draw.ellipse(box, fill=obj.rgb)
    elif obj.shape == "square":
        draw.rectangle(box, fill=obj.rgb)
    else:  # upright; at height y it is r wide, so the center pixel is inside
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=obj.rgb)


def make_scene(
    seed: int,
    *,
    size: int = 168,
    grid: int = 4,
    num_objects: int | tuple[int, int] = (2, 5),
) -> Scene:
    """Render one scene: a few objects on a textured background.

    Parameters
    ----------
    seed : int
        Non-negative generator seed; the same arguments give the same pixels and objects. Use
        :func:`mmaccel.data.splits.split_seed` for held-out scenes.
    size : int
        Side of the square image in pixels (168 gives a ViT-S/14 a 12 x 12 patch grid).
    grid : int
        The image is cut into ``grid x grid`` cells; each object sits, jittered, in its own cell.
    num_objects : int or (int, int)
        How many objects, or an inclusive range to draw from uniformly (at most 9, and at most ``grid**2``).

    Returns
    -------
    Scene

    Raises
    ------
    ValueError
        If a cell is smaller than 16 pixels (``size < 16 * grid``), or ``num_objects`` is out of range.
    """
    cell = size // grid
    if cell < 16:
        raise ValueError(f"cells of {cell} px are too small to draw shapes in: use size >= {16 * grid} or a smaller grid")
    lo, hi = _num_objects_range(num_objects, grid)
    rng = np.random.default_rng(seed)
    pixels = textured_background(rng, size)
    n = int(rng.integers(lo, hi + 1))
    cells = rng.choice(grid * grid, size=n, replace=False)
    kinds = rng.choice(len(SHAPES) * len(PALETTE), size=n, replace=False)  # unique colour-shape pairs
    colours = list(PALETTE)
    margin = (size - cell * grid) // 2
    objects = []
    for c, k in zip(cells.tolist(), kinds.tolist()):
        row, col = divmod(c, grid)
        size_name = list(SIZES)[int(rng.integers(len(SIZES)))]
        radius = max(3, round(SIZES[size_name] * cell))
        slack = cell // 2 - radius - 1
        dx, dy = rng.integers(-slack, slack + 1, size=2).tolist()
        center = (margin + col * cell + cell // 2 + dx, margin + row * cell + cell // 2 + dy)
        objects.append(SceneObject(SHAPES[k // len(PALETTE)], colours[k % len(PALETTE)], size_name, center, radius,
                                   (row, col)))
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        _draw(draw, obj)
    return Scene(image=image, objects=tuple(objects), seed=seed)


# Attribute queries: kind (the attribute asked for) -> (the attribute that names the object, question).
_ATTRIBUTE_QUESTIONS = {
    "colour": ("shape", "What color is the {shape}?"),
    "shape": ("colour", "What shape is the {colour} object?"),
}


def _unique(objects, attr: str) -> list[SceneObject]:
    values = [getattr(o, attr) for o in objects]
    return [o for o in objects if values.count(getattr(o, attr)) == 1]


def ask(scene: Scene, kind: str, rng: np.random.Generator) -> tuple[str, str] | None:
    """One question of type ``kind`` about ``scene`` and its answer, or ``None`` when the scene has none.

    Kinds (see :data:`QUESTION_KINDS`):

    - ``"colour"``: "What color is the <shape>?" (the shape is unique in the scene) -> a colour name;
    - ``"shape"``: "What shape is the <colour> object?" (the colour is unique) -> a shape name;
    - ``"count"``: "How many <shape>s are there?" (any shape, possibly absent) -> a digit;
    - ``"relation"``: "Is the <colour shape> left or right of the <colour shape>?" (objects in different grid
      columns) -> ``"left"`` or ``"right"``;
    - ``"size"``: "Is the <colour shape> small or large?" -> ``"small"`` or ``"large"``.

    Questions say "color" (the spelling language models saw most).

    Parameters
    ----------
    rng : numpy.random.Generator
        Picks the object(s) asked about.

    Raises
    ------
    ValueError
        For an unknown kind.
    """
    objs = scene.objects
    if kind in _ATTRIBUTE_QUESTIONS:
        named_by, template = _ATTRIBUTE_QUESTIONS[kind]
        pool = _unique(objs, named_by)
        if not pool:
            return None
        o = pool[int(rng.integers(len(pool)))]
        return template.format(shape=o.shape, colour=o.colour), getattr(o, kind)
    if kind == "count":
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        return f"How many {shape}s are there?", str(sum(o.shape == shape for o in objs))
    if kind == "relation":
        pairs = [(a, b) for a in objs for b in objs if a.cell[1] != b.cell[1]]
        if not pairs:
            return None
        a, b = pairs[int(rng.integers(len(pairs)))]
        answer = "left" if a.center[0] < b.center[0] else "right"
        return f"Is the {a.name} left or right of the {b.name}?", answer
    if kind == "size":
        o = objs[int(rng.integers(len(objs)))]
        return f"Is the {o.name} small or large?", o.size
    raise ValueError(f"unknown question kind {kind!r}; use one of {QUESTION_KINDS}")


def describe_scene(objects) -> str:
    """A caption of a scene: every object as "a <size> <colour> <shape>", in reading order (grid row, then column).

    The caption names each object's attributes side by side, so a model that writes it must bind them per object:
    the supervision LLaVA's first stage gets from captions (Liu et al., "Visual Instruction Tuning", 2023,
    arXiv 2304.08485), here with one correct caption per scene.

    >>> describe_scene(make_scene_qa(1, seed=0, split="test")[0].objects)
    'a small yellow circle, a large cyan square, a large cyan triangle.'

    Parameters
    ----------
    objects : sequence of SceneObject
        A scene's objects (``Scene.objects`` or ``SceneQA.objects``), in any order.

    Returns
    -------
    str
        Objects joined by ", ", ending with ".".

    Raises
    ------
    ValueError
        For an empty ``objects``.
    """
    if not objects:
        raise ValueError("a scene to describe needs at least one object")
    ordered = sorted(objects, key=lambda o: o.cell)
    return ", ".join(f"a {o.size} {o.colour} {o.shape}" for o in ordered) + "."


def scene_questions(scene: Scene, per_scene: int = 1, *, kinds=QUESTION_KINDS, start: int = 0) -> list[SceneQA]:
    """``per_scene`` distinct questions about one scene, cycling through ``kinds``.

    Question ``q`` prefers ``kinds[(start + q) % len(kinds)]`` and falls through to the next kind the scene can
    answer; within a kind, a few draws look for a question not yet asked (a repeat is kept only when the scene has
    no other). Deterministic given the scene's seed, ``start`` and ``kinds``.

    Raises
    ------
    ValueError
        For an unknown kind or an empty ``kinds``.
    """
    kinds = tuple(kinds)
    if not kinds or any(k not in QUESTION_KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {QUESTION_KINDS}, got {kinds}")
    out: list[SceneQA] = []
    asked: set[str] = set()
    for q in range(per_scene):
        rng = np.random.default_rng([scene.seed, start + q])
        fresh = repeat = None
        for step in range(len(kinds)):
            kind = kinds[(start + q + step) % len(kinds)]
            for _ in range(4):
                qa = ask(scene, kind, rng)
                if qa is None:
                    break
                if qa[0] not in asked:
                    fresh = (kind, qa)
                    break
                repeat = repeat or (kind, qa)
            if fresh:
                break
        picked = fresh or repeat
        if picked is None:  # ``kinds`` holds only types this scene cannot answer
            continue
        kind, (question, answer) = picked
        asked.add(question)
        out.append(SceneQA(scene.image, question, answer, kind, scene.objects, scene.seed))
    return out


def make_scene_qa(
    n: int,
    seed: int = 0,
    *,
    split: str = "train",
    per_scene: int = 1,
    kinds=QUESTION_KINDS,
    size: int = 168,
    grid: int = 4,
    num_objects: int | tuple[int, int] = (2, 5),
) -> list[SceneQA]:
    """``n`` scene questions from the fixed ``split``, with question types balanced by cycling through ``kinds``.

    Parameters
    ----------
    n : int
        Number of questions; ``ceil(n / per_scene)`` scenes are rendered.
    seed : int
        Which draw of the split (:func:`mmaccel.data.splits.split_seed`); the same arguments give the same pixels
        and questions.
    split : {"train", "test"}
        Train and test scenes come from disjoint ranges of generator seeds.
    per_scene : int
        Questions per scene (they share one image object: cache the vision tower's features once per scene).
    kinds : sequence of str
        Question types to ask, a subset of :data:`QUESTION_KINDS`.
    size, grid, num_objects
        As in :func:`make_scene`.

    Returns
    -------
    list of SceneQA
        ``n`` items, except when ``kinds`` holds only types some scenes cannot answer: those scenes give fewer.

    Raises
    ------
    ValueError
        For ``n < 0``, ``per_scene < 1``, an unknown split or kind, or bad scene arguments.
    """
    if n < 0 or per_scene < 1:
        raise ValueError(f"need n >= 0 and per_scene >= 1, got n={n}, per_scene={per_scene}")
    out: list[SceneQA] = []
    for i in range(-(-n // per_scene)):
        scene = make_scene(split_seed(split, seed, i), size=size, grid=grid, num_objects=num_objects)
        out.extend(scene_questions(scene, min(per_scene, n - i * per_scene), kinds=kinds, start=i * per_scene))
    return out
