"""Where a checkpoint is: a fetched or trained zoo name, a local HF checkpoint directory, or a hub id.

The one resolver below :mod:`mmaccel.models.loading` (which adds the built zoo models) and
:mod:`mmaccel.models.built` (whose parts are fetched or trained zoo models or local directories), so neither imports
the other.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .fetched import FETCHED, FetchError, fetch, is_fetched, verify
from .zoo import ZOO, zoo_path

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the fix."""


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve_checkpoint(name_or_path: str | os.PathLike, *, cache_dir=None, known=()) -> str:
    """Turn a fetched or trained zoo name, a local directory or a hub id into what ``from_pretrained`` takes.

    A fetched zoo model is downloaded and converted on first use (:func:`mmaccel.models.fetched.fetch`), and its
    cached files are checked against their sha256 on every call.

    Parameters
    ----------
    name_or_path : str or os.PathLike
        The model to find.
    cache_dir : str or Path, optional
        The zoo's cache of fetched models (default ``~/.cache/mmaccel/models``).
    known : iterable of str
        Further names to list in the unknown-model message (the built zoo models).

    Returns
    -------
    str
        A local checkpoint directory, or the hub id itself.

    Raises
    ------
    ModelLoadError
        As :func:`mmaccel.models.loading.resolve_model_path`, for every case but a built zoo model.
    """
    name = str(name_or_path)
    if name in FETCHED:
        try:
            if not is_fetched(name, cache_dir):
                logger.warning("%s is not in the cache yet: fetching and converting it once", name)
                fetch(name, cache_dir=cache_dir)
            return str(verify(name, cache_dir))
        except FetchError as exc:
            raise ModelLoadError(str(exc)) from exc
    if name in ZOO:
        path = zoo_path(name)
        if not (path / "config.json").exists():
            raise ModelLoadError(f"zoo model {name!r} has no weights at {path}; run `mmaccel zoo train {name}`")
        return str(path)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a Hugging Face checkpoint directory (no config.json in it)")
        return str(path)
    if _looks_like_hub_id(name):
        return name
    raise ModelLoadError(
        f"unknown model {name!r}: not a zoo model ({', '.join([*ZOO, *FETCHED, *known])}), not an existing local "
        "directory, "
        "and not a hub id of the form 'org/name'"
    )
