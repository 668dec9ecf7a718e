"""Trainers of the zoo's models; each module is a ``python -m mmaccel.zoo.train.NAME`` script as well.

- ``lm``: micro-lm and micro-draft on needle documents; ``micro_ar``: the palette-token picture model;
  ``smol_llava``: LLaVA projectors and LoRA adapters (smol-llava, micro-llava); ``clips``: video-clip conversations
  for smol-llava; ``eagle``: the EAGLE head of smollm2-135m; ``schedule``: the one learning-rate schedule.
"""
from __future__ import annotations

from pathlib import Path

from ...models.built import BUILT, _function


def train_built(name: str, out_dir: str | Path | None = None, **kwargs) -> dict:
    """Train built model ``name``'s piece with its entry's trainer (``mmaccel zoo train NAME``).

    Parameters
    ----------
    name : str
        A key of :data:`mmaccel.models.built.BUILT` (``smol-llava``, ``micro-llava``).
    out_dir : str or Path, optional
        Where the trained piece and card go; default the entry's folder under ``assets/models``.
    **kwargs
        Passed to the trainer (``steps``, ``batch_size``, ``lr``, ``threads``, ``device``; see
        :func:`mmaccel.zoo.train.smol_llava.train`).

    Returns
    -------
    dict
        The trainer's summary.

    Raises
    ------
    KeyError
        ``name`` is not a built model.
    """
    return _function(BUILT[name].trainer)(out_dir, **kwargs)
