"""mmaccel.data: every seeded synthetic task, and media input.

- :mod:`~mmaccel.data.haystack` -- prose and planted needles for text NIAH (RULER-style) and micro-model training.
- :mod:`~mmaccel.data.scenes` -- CLEVR-style scenes (shapes, colours, sizes, positions) with one-word questions.
- :mod:`~mmaccel.data.clips` -- video NIAH clips: a slowly changing scene with one needle frame.
- :mod:`~mmaccel.data.splits` -- fixed, disjoint train/test ranges of generator seeds.
- :mod:`~mmaccel.data.media` -- users' images and videos (Pillow, PyAV), with one clear error per bad file.

Generators are pure functions of integer seeds. The names below are imported on first use, so that importing the
text haystack does not import Pillow or PyAV.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "HaystackTokens": "haystack",
    "NIAHSample": "haystack",
    "make_niah_sample": "haystack",
    "stdlib_paragraphs": "haystack",
    "Scene": "scenes",
    "SceneObject": "scenes",
    "SceneQA": "scenes",
    "QUESTION_KINDS": "scenes",
    "make_scene": "scenes",
    "make_scene_qa": "scenes",
    "scene_questions": "scenes",
    "describe_scene": "scenes",
    "Clip": "clips",
    "CLIP_KINDS": "clips",
    "make_clip": "clips",
    "split_seed": "splits",
    "load_image": "media",
    "load_video": "media",
    "write_video": "media",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
