"""What makes the workbench safe to put on a network (issue 33): who may connect, what the model pickers may load,
where uploads and work files live, how large an image or a video may be, and which text may reach the page.

- :func:`exposure_error`, :func:`read_auth` -- a non-loopback ``--host`` or ``--share`` needs Gradio's own login
  (``launch(auth=...)``);
- :class:`ModelGate` -- the pickers and method specs load zoo names, the models preset at launch and directories under
  ``--model-root``; hub ids only with ``--allow-hub``; a checkpoint with its own code only with
  ``--allow-remote-code`` and the box ticked. Everything else gets one message that does not say whether a path
  exists;
- :class:`PrivateFolder` -- the app's temp folder (0700, files 0600), one folder per request removed when the request
  ends, the whole folder removed on close and at exit;
- :func:`bounded_image`, :func:`check_video` -- a pixel cap read from the header before anything is decoded, and caps
  on a video's frames and frame size;
- :func:`scrub` -- no server path in a status line or an error.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

from .common import InputError, scrub

DEFAULT_MAX_IMAGE_PIXELS = 16_000_000
"""Default pixel cap of an uploaded image and of a video frame (16 megapixels, ``--max-image-pixels``)."""
DEFAULT_MAX_VIDEO_FRAMES = 3000
"""Most frames an uploaded video may have (decoding walks every frame up to the last one sampled)."""


# ------------------------------------------------------------------------------------------------------ launching
def is_loopback(host: str) -> bool:
    """Whether ``host`` (``--host``) binds only this machine: ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    host = str(host).strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_auth(pairs=(), auth_file=None) -> list[tuple[str, str]]:
    """Login pairs for Gradio's ``launch(auth=...)`` from ``--auth USER:PASSWORD`` values and an ``--auth-file``.

    Parameters
    ----------
    pairs : iterable of str
        ``USER:PASSWORD`` (the password may contain ``:``).
    auth_file : path, optional
        A file of ``USER:PASSWORD`` lines; blank lines and lines starting with ``#`` are skipped.

    Returns
    -------
    list of (str, str)

    Raises
    ------
    ValueError
        A pair without a user or a password (the message never repeats the password), or an unreadable file.
    """
    items = [("--auth", p) for p in pairs or ()]
    if auth_file is not None:
        try:
            lines = Path(auth_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--auth-file {auth_file}: cannot read it ({type(exc).__name__}); give a UTF-8 file of "
                             "USER:PASSWORD lines") from exc
        items += [(f"--auth-file line {i}", line.strip()) for i, line in enumerate(lines, 1)
                  if line.strip() and not line.lstrip().startswith("#")]
    out = []
    for where, text in items:
        user, sep, password = text.partition(":")
        if not sep or not user.strip() or not password:
            raise ValueError(f"{where}: expected USER:PASSWORD with both parts non-empty")
        out.append((user.strip(), password))
    return out


def exposure_error(host: str, share: bool, auth) -> str | None:
    """Why the app must not start, or ``None``: a non-loopback ``host`` or ``share`` without any login."""
    if auth:
        return None
    if share:
        return ("--share opens a public link: add --auth USER:PASSWORD (or --auth-file FILE) so that only people "
                "with a login can use the app")
    if not is_loopback(host):
        return (f"--host {host} makes the app reachable from other machines: add --auth USER:PASSWORD (or "
                "--auth-file FILE), or bind 127.0.0.1")
    return None


# ---------------------------------------------------------------------------------------------------------- models
def _hub_like(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(p and p not in (".", "..") for p in parts) and not name.startswith(("~", "."))


def _custom_code(folder: Path) -> bool:
    """Whether a checkpoint folder ships its own code: an ``auto_map`` in its config or tokenizer config."""
    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json"):
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "auto_map" in data:
            return True
    return False


@dataclass(frozen=True)
class ModelGate:
    """What the model pickers and the ``key=value`` paths of method specs may name.

    Parameters
    ----------
    roots : tuple of Path
        ``--model-root`` folders: a checkpoint directory under one of them (an absolute path, or a path relative to a
        root) is accepted, after symlinks are resolved.
    allow_hub : bool
        ``--allow-hub``: accept hub ids (``org/name``).
    presets : tuple of str
        The models given at launch (``--model``, ``--vision-model``, ``--vlm-model``): the operator chose them.
    allow_remote_code : bool
        ``--allow-remote-code``: a checkpoint with its own code may load when the request ticks "trust remote code".
    """

    roots: tuple = ()
    allow_hub: bool = False
    presets: tuple = ()
    allow_remote_code: bool = False

    def refusal(self, name: str) -> InputError:
        """The one message for every name the gate refuses (the same text whether the path exists or not)."""
        from mmaccel.models import BUILT, FETCHED, ZOO

        where = " or a checkpoint folder under the app's model roots (its path relative to a root)" if self.roots \
            else ""
        hub = "" if self.allow_hub else "; hub ids need the app launched with --allow-hub"
        return InputError(f"unknown model {name!r}: pick a zoo model ({', '.join([*ZOO, *FETCHED, *BUILT])}){where}"
                          f"{hub}; other folders need the app launched with --model-root DIR")

    def _under_roots(self, name: str) -> Path | None:
        candidates = [Path(name).expanduser()] if Path(name).expanduser().is_absolute() else \
            [Path(root, name) for root in self.roots]
        for candidate in candidates:
            real = Path(os.path.realpath(candidate))
            for root in self.roots:
                if real.is_relative_to(os.path.realpath(root)) and real.exists():
                    return real
        return None

    def check(self, name, trust_remote_code: bool = False) -> str:
        """The name to load for a picker's value.

        Returns
        -------
        str
            The zoo name, preset or hub id as given, or the resolved folder under a root.

        Raises
        ------
        InputError
            An empty name; a name outside the zoo, the presets and the roots (:meth:`refusal`); a checkpoint with its
            own code while ``trust_remote_code`` is off or the app was launched without ``--allow-remote-code``.
        """
        from mmaccel.models import BUILT, FETCHED, ZOO

        name = str(name or "").strip()
        if not name:
            raise InputError("no model given: pick a zoo model or type a checkpoint folder under the model roots")
        if name in ZOO or name in FETCHED or name in BUILT or name in self.presets:
            return name
        folder = self._under_roots(name) if "\x00" not in name else None
        if folder is None:
            if self.allow_hub and _hub_like(name) and not Path(name).exists():
                return name
            raise self.refusal(name)
        if _custom_code(folder) and not (trust_remote_code and self.allow_remote_code):
            how = ("tick 'trust remote code' if you trust it" if self.allow_remote_code else
                   "the app runs it only when launched with --allow-remote-code and 'trust remote code' is ticked")
            raise InputError(f"the checkpoint {name!r} ships its own Python code (an auto_map in its config): {how}")
        return str(folder)

    def check_spec(self, spec: str) -> None:
        """Refuse a method spec whose ``key=value`` values name a path or hub id the pickers would refuse
        (e.g. ``draft:model=/home/x/model``, ``layer_skip:skip_set=/etc/passwd``): paths must be absolute and under
        the roots.

        Raises
        ------
        InputError
            The same message as :meth:`refusal`.
        """
        for value in re.findall(r"=\s*([^:,()\s]+)", str(spec or "")):
            if not any(c in value for c in "/\\~") and not value.startswith("."):
                continue
            if self.allow_hub and _hub_like(value) and not Path(value).exists():
                continue
            if not Path(value).is_absolute() or self._under_roots(value) is None:
                raise self.refusal(value)


# ----------------------------------------------------------------------------------------------------------- files
class PrivateFolder:
    """The app's own temp folder: mode 0700, one subfolder per request (removed when the request ends), removed
    whole by :meth:`close` and at interpreter exit.

    Parameters
    ----------
    path : path, optional
        Use this folder (created 0700 if missing; tests pass one); default a new ``mmaccel-app-*`` folder in the
        system temp dir.
    """

    def __init__(self, path=None):
        if path is None:
            self.path = Path(tempfile.mkdtemp(prefix="mmaccel-app-"))
        else:
            self.path = Path(path)
            self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.path), ignore_errors=True)  # also at exit

    def close(self) -> None:
        """Remove the folder and everything in it (idempotent; a relaunched app's next request makes it again and
        the next close removes it again)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def request(self, prefix: str) -> tempfile.TemporaryDirectory:
        """A per-request folder (0700) as a context manager: ``with folder.request("niah-") as out: ...``."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(prefix=prefix, dir=self.path)

    @staticmethod
    def take(upload, folder) -> Path | None:
        """Copy an upload (a path in Gradio's cache) into ``folder`` as a 0600 file; ``None`` when there is none.

        Raises
        ------
        InputError
            The upload is gone (Gradio's cache was cleaned): upload the file again.
        """
        if not upload:
            return None
        src = Path(upload)
        dest = Path(folder) / (src.name or "upload")
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
                shutil.copyfileobj(inp, out)
        except FileNotFoundError as exc:
            raise InputError(f"the uploaded file {src.name} is no longer on the server: upload it again") from exc
        return dest


# ----------------------------------------------------------------------------------------------------------- media
def bounded_image(path, max_pixels: int, name: str):
    """An uploaded image as RGB, after a pixel cap read from its header (nothing is decoded before the check).

    Parameters
    ----------
    path : path
    max_pixels : int
        Most pixels (width x height) accepted.
    name : str
        What the messages call the file (never its server path).

    Returns
    -------
    PIL.Image.Image
        RGB (:func:`mmaccel.data.media.load_image`).

    Raises
    ------
    InputError
        Too many pixels (including Pillow's ``DecompressionBombError``), or not a readable image.
    """
    from PIL import Image

    from mmaccel.data.media import load_image

    def too_big(size) -> InputError:
        what = f"{size[0]} x {size[1]} pixels" if size else "too many pixels for Pillow"
        return InputError(f"{name} is {what}; the limit is {max_pixels / 1e6:g} megapixels (--max-image-pixels): "
                          "upload a smaller image")

    try:
        with Image.open(path) as opened:
            size = opened.size
    except Image.DecompressionBombError as exc:
        raise too_big(None) from exc
    except (OSError, ValueError, SyntaxError, EOFError):
        size = None  # load_image names what is wrong with the file
    if size is not None and size[0] * size[1] > max_pixels:
        raise too_big(size)
    try:
        return load_image(path)
    except Image.DecompressionBombError as exc:
        raise too_big(None) from exc
    except (ValueError, OSError) as exc:
        raise InputError(scrub(str(exc).replace(str(path), name))) from exc


def check_video(path, max_pixels: int, max_frames: int, name: str) -> None:
    """Refuse a video whose frames are larger than ``max_pixels`` or that has more than ``max_frames`` frames, from
    its header and packets (no frame is decoded). A file PyAV cannot open passes: the decoder's own error follows.

    Raises
    ------
    InputError
        A frame size or frame count over the caps.
    """
    import av

    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError, ValueError):
        return
    with container:
        if not container.streams.video:
            return
        stream = container.streams.video[0]
        w, h = stream.codec_context.width or 0, stream.codec_context.height or 0
        if w * h > max_pixels:
            raise InputError(f"{name} has {w} x {h} frames; the limit is {max_pixels / 1e6:g} megapixels per frame "
                             "(--max-image-pixels): upload a smaller video")
        count = int(stream.frames or 0)
        if not count:
            try:
                for packet in container.demux(stream):
                    count += bool(packet.size)
                    if count > max_frames:
                        break
            except av.error.FFmpegError:
                pass
        if count > max_frames:
            raise InputError(f"{name} has more than {max_frames} frames, the app's limit: upload a shorter clip")
