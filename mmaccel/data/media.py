"""Media input: users' images and videos as RGB, with one clear error for each kind of bad file.

Images go through Pillow; videos through PyAV (FFmpeg's decoders), which mmaccel depends on. Video frames can be
sampled uniformly (``num_frames``), by rate (``fps``) or by ``stride``, as VLM video pipelines do, and decoding stops
as soon as enough frames are kept, so a long video is never held in memory whole.
"""
from __future__ import annotations

import io
import logging
import os
import warnings
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageOps

logger = logging.getLogger(__name__)

_PIL_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError)  # what Pillow raises for corrupt or truncated data

#: Default cap on an image's pixels (width x height), and on a video frame's: 16 megapixels (4096 x 4096), 48 MiB as
#: RGB. Read from the file's header before anything is decoded.
DEFAULT_MAX_PIXELS = 4096 * 4096
#: Default cap on the frames :func:`load_video` keeps: 256 (at most 12 GiB of RGB at the frame cap; sample with
#: ``num_frames`` to keep fewer).
DEFAULT_FRAME_CAP = 256


def _existing_file(path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no {what} file at {path}: check the path")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: pass one {what} file")
    return path


def _too_many_pixels(name: str, size: tuple[int, int] | None, max_pixels: int | None,
                     bomb: BaseException | None = None) -> ValueError:
    if bomb is not None:  # PIL.Image.DecompressionBombError, raised by Image.open before any pixel is decoded
        return ValueError(f"{name} has too many pixels: Pillow refuses it as a decompression bomb ({bomb}); "
                          "downscale it, e.g. to 4096 x 4096")
    return ValueError(f"{name} is {size[0]} x {size[1]} pixels; the limit is {max_pixels:,} pixels "
                      f"({max_pixels / 1e6:.1f} megapixels; max_pixels / --max-image-pixels): downscale it, e.g. to "
                      "4096 x 4096, or raise the limit")


def _not_an_image(name: str, err: BaseException) -> ValueError:
    return ValueError(
        f"{name} is not a readable image (PIL could not decode it): {err}. Pass a PNG, JPEG, WebP, BMP or "
        "GIF file, or re-save the image with an image editor"
    )


def _image_stream(source) -> tuple[str, object]:
    """(name for messages, what ``Image.open`` reads) of a path or bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"the {len(source)} bytes given", io.BytesIO(bytes(source))
    if isinstance(source, (str, os.PathLike)):
        path = _existing_file(source, "image")
        return str(path), path
    raise TypeError(f"expected an image path, bytes or a PIL image, not {type(source).__name__}")


def _open_quietly(stream, max_pixels: int | None) -> Image.Image:
    """``Image.open``, without Pillow's ``DecompressionBombWarning`` when our own cap is the stricter one (the size
    check that follows says what is wrong, in one line). The warning filter is restored on return."""
    if max_pixels is None or max_pixels > (Image.MAX_IMAGE_PIXELS or 0):
        return Image.open(stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(stream)


def _check_size(name: str, size: tuple[int, int], max_pixels: int | None) -> None:
    if max_pixels is not None and size[0] * size[1] > max_pixels:
        raise _too_many_pixels(name, size, max_pixels)


def check_image_pixels(source, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Check an image's size from its header, decoding nothing: the check an upload gets before :func:`load_image`.

    Parameters
    ----------
    source : str, os.PathLike, bytes or PIL.Image.Image
        A file path, the file's bytes, or an image already open.
    max_pixels : int or None
        Most pixels (width x height) accepted; default :data:`DEFAULT_MAX_PIXELS` (16 megapixels). ``None``: only
        Pillow's own decompression-bomb limit (``2 * PIL.Image.MAX_IMAGE_PIXELS``).

    Returns
    -------
    (width, height) : tuple of int
        In pixels.

    Raises
    ------
    ValueError
        For more pixels than ``max_pixels`` (or than Pillow accepts: its ``DecompressionBombError``), data that is
        not an image, or a ``max_pixels`` that is not a positive integer.
    FileNotFoundError, IsADirectoryError
        If the path does not exist, or is a folder.
    TypeError
        For any other kind of ``source``.
    """
    _check_max_pixels(max_pixels)
    if isinstance(source, Image.Image):
        _check_size("the image given", source.size, max_pixels)
        return source.size
    name, stream = _image_stream(source)
    try:
        with _open_quietly(stream, max_pixels) as opened:  # lazy: reads the header only
            size = opened.size
    except Image.DecompressionBombError as err:
        raise _too_many_pixels(name, None, max_pixels, err) from err
    except _PIL_DECODE_ERRORS as err:
        raise _not_an_image(name, err) from err
    _check_size(name, size, max_pixels)
    return size


def _check_max_pixels(max_pixels) -> None:
    if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1):
        raise ValueError(f"max_pixels must be a positive integer (pixels) or None, got {max_pixels!r}")


def load_image(source, *, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Load an image as RGB, refusing one with more than ``max_pixels`` pixels before decoding it.

    Parameters
    ----------
    source : str, os.PathLike, bytes or PIL.Image.Image
        A file path, the file's bytes, or an image already open. EXIF orientation is applied; transparent pixels
        are composited onto white.
    max_pixels : int or None
        Most pixels (width x height) accepted, checked on the header right after ``Image.open`` (Pillow opens
        lazily, so a pixel bomb is refused without being decoded); default :data:`DEFAULT_MAX_PIXELS` (16
        megapixels). ``None``: only Pillow's own limit. Pillow's global ``MAX_IMAGE_PIXELS`` is left as it is.

    Returns
    -------
    PIL.Image.Image
        Mode ``"RGB"``, fully decoded (the file is closed).

    Raises
    ------
    FileNotFoundError, IsADirectoryError
        If the path does not exist, or is a folder.
    ValueError
        If the image has more than ``max_pixels`` pixels (or more than Pillow accepts: its
        ``DecompressionBombError``), or Pillow cannot decode the data (corrupt, truncated or not an image).
    TypeError
        For any other kind of ``source``.
    """
    _check_max_pixels(max_pixels)
    if isinstance(source, Image.Image):
        _check_size("the image given", source.size, max_pixels)
        image = source
    else:
        name, stream = _image_stream(source)
        image = None
        try:
            with _open_quietly(stream, max_pixels) as opened:  # lazy: the header is read, nothing decoded yet
                size = opened.size
                if max_pixels is None or size[0] * size[1] <= max_pixels:
                    opened.load()
                    image = opened.copy()
        except Image.DecompressionBombError as err:
            raise _too_many_pixels(name, None, max_pixels, err) from err
        except _PIL_DECODE_ERRORS as err:
            raise _not_an_image(name, err) from err
        if image is None:
            raise _too_many_pixels(name, size, max_pixels)
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


def _truncated(path: Path, why: str) -> ValueError:
    return ValueError(f"{path} is truncated or damaged ({why}); pass the whole file, or re-encode what is left: "
                      f"ffmpeg -i {path} -c:v libx264 out.mp4")


def _declared_seconds(container, stream) -> float | None:
    """The video stream's length as the container declares it (``None`` when it does not, or when only the whole
    container's length is known and other streams, e.g. a longer audio track, may make it up)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration and len(container.streams) == 1:
        return container.duration / av.time_base
    return None


def _check_frame_size(path: Path, width: int, height: int, max_pixels: int | None) -> None:
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(f"{path} has {width} x {height} frames; the limit is {max_pixels:,} pixels per frame "
                         f"({max_pixels / 1e6:.1f} megapixels; max_pixels / --max-image-pixels): downscale it, e.g. "
                         f"ffmpeg -i {path} -vf scale=1280:-2 out.mp4, or raise the limit")


def load_video(
    path,
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    stride: int | None = None,
    max_frames: int | None = None,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    frame_cap: int | None = DEFAULT_FRAME_CAP,
) -> np.ndarray:
    """Decode a video file into RGB frames, optionally sampled, within caps on frame size and frame count.

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
        Stop after keeping this many frames (applied after the sampling above): a deliberate cut, never an error.
    max_pixels : int or None
        Most pixels (width x height) per frame, checked on the stream's header before any frame is decoded and on
        every decoded frame; default :data:`DEFAULT_MAX_PIXELS` (16 megapixels). ``None``: no cap.
    frame_cap : int or None
        Most frames the sampling may keep (default :data:`DEFAULT_FRAME_CAP`, 256); a video that would keep more is
        refused rather than cut (pass ``max_frames`` to cut). Memory is at most ``frame_cap * max_pixels * 3``
        bytes. ``None``: no cap.

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
        If the file is not a video PyAV can open, has no video stream, or has no decodable frames; is truncated or
        damaged (decoding fails part way, frames end well before the length the container declares, or fewer frames
        decode than it lists); has frames over ``max_pixels`` or would keep more than ``frame_cap`` frames; or for
        conflicting or non-positive sampling arguments.
    """
    given = {k: v for k, v in {"num_frames": num_frames, "fps": fps, "stride": stride}.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"sample by one of num_frames, fps or stride, not {' and '.join(given)}")
    for name, value in {**given, "max_frames": max_frames, "frame_cap": frame_cap}.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    _check_max_pixels(max_pixels)
    if num_frames is not None and frame_cap is not None and num_frames > frame_cap:
        raise ValueError(f"num_frames={num_frames} is over the cap of {frame_cap} frames (frame_cap / --max-frames): "
                         "sample fewer frames or raise the cap")
    path = Path(path)
    wanted = None
    if num_frames is not None:
        with _open_video(path) as container:  # the header's frame size first: nothing is decoded for a bomb
            ctx = container.streams.video[0].codec_context
            _check_frame_size(path, ctx.width or 0, ctx.height or 0, max_pixels)
        total = _count_frames(path)
        wanted = set(np.linspace(0, max(total - 1, 0), num_frames).round().astype(int).tolist())
    frames: list[np.ndarray] = []
    next_time = 0.0
    last_time = None
    cut = False
    with _open_video(path) as container:
        stream = container.streams.video[0]
        _check_frame_size(path, stream.codec_context.width or 0, stream.codec_context.height or 0, max_pixels)
        rate = stream.average_rate
        try:
            for i, frame in enumerate(container.decode(stream)):
                _check_frame_size(path, frame.width, frame.height, max_pixels)
                last_time = frame.time if frame.time is not None else last_time
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
                    if frame_cap is not None and len(frames) >= frame_cap:
                        raise ValueError(
                            f"{path} keeps more than {frame_cap} frames at this sampling, the cap (frame_cap / "
                            "--max-frames): sample fewer (num_frames, fps or stride), cut with max_frames, or raise "
                            "the cap")
                    frames.append(frame.to_ndarray(format="rgb24"))
                if max_frames is not None and len(frames) >= max_frames:
                    cut = True
                    break
        except av.error.FFmpegError as err:
            if not frames:
                raise _no_frames(path, f"PyAV: {err}") from err
            raise _truncated(path, f"decoding failed after {len(frames)} kept frames: {err}") from err
        declared = None if cut else _declared_seconds(container, stream)
        step = 1.0 / float(rate) if rate else 0.0
    if not frames:
        raise _no_frames(path, "its video stream is empty")
    if wanted is not None and len(frames) < len(wanted):
        raise _truncated(path, f"it lists {total} frames, but only frames up to {i} decode")
    if declared is not None and last_time is not None and last_time + step < declared - max(2 * step, 0.1 * declared):
        raise _truncated(path, f"its frames end at {last_time + step:.2f} s of the {declared:.2f} s it declares")
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
