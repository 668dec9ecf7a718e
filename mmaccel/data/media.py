"""Media input: users' images and videos as RGB, with one clear error for each kind of bad file.

Images go through Pillow; videos through PyAV (FFmpeg's decoders), which mmaccel depends on. Video frames can be
sampled uniformly (``num_frames``), by rate (``fps``) or by ``stride``, as VLM video pipelines do, and decoding stops
as soon as enough frames are kept, so a long video is never held in memory whole.
"""
from __future__ import annotations

import io
import logging
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageOps

logger = logging.getLogger(__name__)

_PIL_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError)  # what Pillow raises for corrupt or truncated data


def _existing_file(path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no {what} file at {path}: check the path")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: pass one {what} file")
    return path


def load_image(source) -> Image.Image:
    """Load an image as RGB.

    Parameters
    ----------
    source : str, os.PathLike, bytes or PIL.Image.Image
        A file path, the file's bytes, or an image already open. EXIF orientation is applied; transparent pixels
        are composited onto white.

    Returns
    -------
    PIL.Image.Image
        Mode ``"RGB"``, fully decoded (the file is closed).

    Raises
    ------
    FileNotFoundError, IsADirectoryError
        If the path does not exist, or is a folder.
    ValueError
        If Pillow cannot decode the data (corrupt, truncated or not an image).
    TypeError
        For any other kind of ``source``.
    """
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, (bytes, bytearray, memoryview)):
            name, stream = f"the {len(source)} bytes given", io.BytesIO(bytes(source))
        elif isinstance(source, (str, os.PathLike)):
            path = _existing_file(source, "image")
            name, stream = str(path), path
        else:
            raise TypeError(f"load_image takes a path, bytes or a PIL image, not {type(source).__name__}")
        try:
            with Image.open(stream) as opened:
                opened.load()
                image = opened.copy()
        except _PIL_DECODE_ERRORS as err:
            raise ValueError(
                f"{name} is not a readable image (PIL could not decode it): {err}. Pass a PNG, JPEG, WebP, BMP or "
                "GIF file, or re-save the image with an image editor"
            ) from err
    image = ImageOps.exif_transpose(image)
    if "A" in image.getbands() or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return image.convert("RGB")


def _no_frames(path: Path, why: str) -> ValueError:
    return ValueError(
        f"{path} has no decodable video frames ({why}); pass a video with at least one frame, or re-encode it: "
        f"ffmpeg -i {path} -c:v libx264 out.mp4"
    )


def _open_video(path: Path):
    _existing_file(path, "video")
    try:
        container = av.open(str(path))
    except av.error.FFmpegError as err:
        raise ValueError(
            f"{path} is not a readable video (PyAV could not open it: {err}); pass an MP4, WebM, MKV or AVI file, "
            f"or re-encode it: ffmpeg -i {path} -c:v libx264 out.mp4"
        ) from err
    if not container.streams.video:
        container.close()
        raise _no_frames(path, "it has no video stream")
    return container


def _count_frames(path: Path) -> int:
    """Frames in the first video stream: the container's count, or the demuxed packets when it has none."""
    with _open_video(path) as container:
        stream = container.streams.video[0]
        if stream.frames:
            return int(stream.frames)
        return sum(1 for packet in container.demux(stream) if packet.size)


def load_video(
    path,
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    stride: int | None = None,
    max_frames: int | None = None,
) -> np.ndarray:
    """Decode a video file into RGB frames, optionally sampled.

    Parameters
    ----------
    path : str or os.PathLike
    num_frames : int, optional
        Keep this many frames spread uniformly over the video (by the container's frame count, or by counting
        packets when the container does not say).
    fps : float, optional
        Keep frames at this rate (by their timestamps): one frame every ``1 / fps`` seconds.
    stride : int, optional
        Keep every ``stride``-th frame (0, stride, 2 * stride, ...).
    max_frames : int, optional
        Stop after keeping this many frames (applied after the sampling above).

    At most one of ``num_frames``, ``fps`` and ``stride``; none keeps every frame.

    Returns
    -------
    numpy.ndarray
        ``[T, H, W, 3]`` uint8 RGB frames, in display order.

    Raises
    ------
    FileNotFoundError, IsADirectoryError
        If the path does not exist, or is a folder.
    ValueError
        If the file is not a video PyAV can open, has no video stream, or has no decodable frames; or for
        conflicting or non-positive sampling arguments.
    """
    given = {k: v for k, v in {"num_frames": num_frames, "fps": fps, "stride": stride}.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"sample by one of num_frames, fps or stride, not {' and '.join(given)}")
    for name, value in {**given, "max_frames": max_frames}.items():
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    path = Path(path)
    wanted = None
    if num_frames is not None:
        total = _count_frames(path)
        wanted = set(np.linspace(0, max(total - 1, 0), num_frames).round().astype(int).tolist())
    frames: list[np.ndarray] = []
    next_time = 0.0
    with _open_video(path) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate
        try:
            for i, frame in enumerate(container.decode(stream)):
                if wanted is not None:
                    keep = i in wanted
                elif stride is not None:
                    keep = i % stride == 0
                elif fps is not None:
                    t = frame.time if frame.time is not None else (i / float(rate) if rate else None)
                    if t is None:
                        raise ValueError(f"{path} has no timestamps or frame rate: sample with num_frames or stride")
                    keep = t + 1e-6 >= next_time
                    if keep:
                        next_time += 1.0 / fps
                else:
                    keep = True
                if keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if max_frames is not None and len(frames) >= max_frames:
                    break
        except av.error.FFmpegError as err:
            if not frames:
                raise _no_frames(path, f"PyAV: {err}") from err
            logger.warning("%s: decoding stopped after %d kept frames: %s", path, len(frames), err)
    if not frames:
        raise _no_frames(path, "its video stream is empty")
    return np.stack(frames)


def _encoder(codec: str | None) -> str:
    for name in [codec] if codec else ["libx264", "mpeg4"]:
        try:
            av.codec.Codec(name, "w")
            return name
        except (av.error.FFmpegError, ValueError) as err:
            if codec:
                raise ValueError(f"this PyAV build has no {codec!r} encoder ({err}); leave codec=None") from err
    raise ValueError("this PyAV build has neither a libx264 nor an mpeg4 encoder; reinstall PyAV from its wheels")


def write_video(frames, path, fps: float = 8, *, codec: str | None = None) -> Path:
    """Encode RGB frames into a video file with PyAV (H.264 in yuv420p when the build has libx264, else MPEG-4).

    Parameters
    ----------
    frames : iterable
        ``[H, W, 3]`` uint8 arrays or PIL images, all the same size: a ``[T, H, W, 3]`` array, a list, or a
        :class:`~mmaccel.data.clips.Clip` (rendered one frame at a time). ``H`` and ``W`` must be even.
    path : str or os.PathLike
        Output file; the container follows the suffix (``.mp4``, ``.mkv``, ...).
    fps : float
        Frames per second.
    codec : str, optional
        An FFmpeg encoder name; default ``"libx264"``, or ``"mpeg4"`` without it.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    ValueError
        For no frames, frames that are not ``[H, W, 3]``, odd or changing sizes, a non-positive ``fps``, or an
        encoder this PyAV build lacks.
    """
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    path = Path(path)
    name = _encoder(codec)
    container = None
    stream = None
    try:
        for k, item in enumerate(frames):
            array = np.asarray(item.convert("RGB") if isinstance(item, Image.Image) else item, dtype=np.uint8)
            if array.ndim != 3 or array.shape[2] != 3:
                raise ValueError(f"frame {k} has shape {array.shape}; frames must be [H, W, 3] RGB")
            h, w = array.shape[:2]
            if stream is None:
                if h % 2 or w % 2:
                    raise ValueError(f"frames are {h}x{w}; yuv420p video needs an even height and width")
                container = av.open(str(path), mode="w")
                stream = container.add_stream(name, rate=Fraction(fps).limit_denominator(1001))
                stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            elif (h, w) != (stream.height, stream.width):
                raise ValueError(f"frame {k} is {h}x{w}, but frame 0 was {stream.height}x{stream.width}")
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        if stream is None:
            raise ValueError("no frames to write")
        for packet in stream.encode():
            container.mux(packet)
    except BaseException:
        if container is not None:
            container.close()
            path.unlink(missing_ok=True)  # no half-written file behind
        raise
    container.close()
    return path
