"""Frame sinks: where decoded uint8 frames go (an mp4, a .npy, a .y4m, a PNG folder, nowhere).

Every file sink writes under a temporary name next to the target
(``.{name}.{random}.partial``) and renames it into place with ``os.replace`` only in
``close()``, so a reader never sees half a video under the final name, and ``abort()``
(or an exception inside a ``with`` block) leaves nothing behind.

Example::

    with sink_for_path("out/clip.mp4", fps=16) as sink:
        for chunk in decode_chunks(vae, z):
            sink.write(to_uint8_frames(chunk).cpu().numpy())   # uint8 (t, H, W, 3)
    # out/clip.mp4 now exists; on an exception it would not.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import struct
from fractions import Fraction
from types import ModuleType
from typing import Any

import numpy as np

from nostall.errors import InternalError, SinkError
from nostall.video.sink_base import (
    AtomicSink,
    FrameSink,
    NullSink,
)

__all__ = [
    "FrameSink",
    "Mp4Sink",
    "NpySink",
    "NullSink",
    "PngSink",
    "Y4mSink",
    "check_sink_path",
    "sink_for_path",
]

log = logging.getLogger(__name__)


_X264_PRESETS = (
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
    "placebo",
)

_SUPPORTED = (
    ".mp4 (H.264), .npy (uint8 array), .y4m (raw YUV 4:4:4), or a folder path with no "
    "suffix or a trailing '/' (PNG frames)"
)


class NpySink(AtomicSink):
    """Write frames to a ``.npy`` file holding uint8 ``(frames, H, W, 3)``.

    The frame count is unknown while streaming, so a fixed 128-byte header is written
    first and rewritten with the real shape at ``close()``; the data is aligned to 64
    bytes, and ``numpy.load(path)`` and ``numpy.load(path, mmap_mode="r")`` read it.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     with NpySink(f"{tmp}/clip.npy") as sink:
        ...         sink.write(np.zeros((2, 16, 16, 3), np.uint8))   # uint8 (t, H, W, 3), any number of times
        ...     np.load(f"{tmp}/clip.npy", mmap_mode="r").shape    # (frames, H, W, 3)
        (2, 16, 16, 3)
    """

    _HEADER_BYTES = 128

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file: Any = None
        super().__init__(path)

    def _create_temp(self, tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._file = os.fdopen(fd, "wb")

    def _header(self, frames: int, height: int, width: int) -> bytes:
        shape = (frames, height, width, 3)
        text = f"{{'descr': '|u1', 'fortran_order': False, 'shape': {shape!r}, }}"
        room = self._HEADER_BYTES - 10 - 1  # magic + version + length, trailing newline
        if len(text) > room:
            raise SinkError(f"shape {shape} does not fit the .npy header", path=self._path)
        body = (text + " " * (room - len(text)) + "\n").encode("latin1")
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body

    def _start(self, height: int, width: int) -> None:
        # Placeholder shape; _finish_temp rewrites it in place (same length) with the count.
        self._file.write(self._header(0, height, width))

    def _write(self, frames: np.ndarray) -> None:
        self._file.write(memoryview(frames).cast("B"))

    def _finish_temp(self) -> None:
        if self._size is None:  # close() refuses a sink without frames before this
            raise InternalError("NpySink finished with no frame size; no frame was written")
        self._file.seek(0)
        self._file.write(self._header(self._frames_written, *self._size))
        self._file.close()

    def _release(self) -> None:
        if self._file is not None:
            self._file.close()


class PngSink(AtomicSink):
    """Write each frame to ``folder/frame_000000.png``, ``frame_000001.png``, ...

    Frames go to a temporary sibling folder that ``close()`` renames to ``folder``. The
    target must not exist, or be an empty folder (replaced at close); a non-empty folder
    is refused so an old run's frames never mix with new ones. ``compress_level`` is
    zlib's 0-9; the default 1 is several times faster than PIL's 6 for ~10% larger files.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, PngSink(f"{tmp}/frames") as sink:
        ...     sink.write(np.zeros((3, 16, 16, 3), np.uint8))   # uint8 (t, H, W, 3)
    """

    def __init__(self, folder: str | os.PathLike[str], *, compress_level: int = 1) -> None:
        if isinstance(compress_level, bool) or compress_level not in range(10):
            raise SinkError(f"compress_level must be an int in 0..9, got {compress_level!r}")
        try:
            from PIL import Image
        except ImportError as e:
            raise ImportError("PngSink needs Pillow: pip install pillow") from e
        self._image = Image
        self._compress_level = compress_level
        super().__init__(self._strip(os.fspath(folder)))

    @staticmethod
    def _strip(folder: str) -> str:
        return folder.rstrip("/" + os.sep) or folder

    @classmethod
    def _check_path(cls, path: str) -> None:
        super()._check_path(cls._strip(path))

    @classmethod
    def _check_target(cls, path: str) -> None:
        if os.path.lexists(path) and not os.path.isdir(path):
            raise SinkError(
                f"{path!r} exists and is not a folder; PngSink needs a folder path", path=path
            )
        if os.path.isdir(path) and os.listdir(path):
            raise SinkError(
                f"the folder {path!r} already holds files; PngSink writes only into a "
                f"new or empty folder so frames of different runs never mix: remove it or "
                f"choose another folder",
                path=path,
            )

    def _create_temp(self, tmp: str) -> None:
        os.mkdir(tmp)

    def _remove_temp(self) -> None:
        shutil.rmtree(self._tmp)

    def _start(self, height: int, width: int) -> None:
        pass

    def _write(self, frames: np.ndarray) -> None:
        for i, frame in enumerate(frames):
            name = os.path.join(self._tmp, f"frame_{self._frames_written + i:06d}.png")
            self._image.fromarray(frame).save(
                name, format="PNG", compress_level=self._compress_level
            )

    def _finish_temp(self) -> None:
        pass

    def _release(self) -> None:
        pass


def _import_av(who: str) -> ModuleType:
    try:
        import av
    except ImportError as e:
        raise ImportError(f"{who} needs PyAV: pip install 'nostall[video]' (or av)") from e
    return av


def _check_fps(fps: float | Fraction, path: str | os.PathLike[str] | None) -> Fraction:
    if isinstance(fps, bool) or not isinstance(fps, (int, float, Fraction)):
        raise SinkError(f"fps must be a number, got {type(fps).__name__}", path=path)
    if not math.isfinite(fps) or fps <= 0:
        raise SinkError(f"fps must be positive and finite, got {fps!r}", path=path)
    # Containers store rates as small rationals; Fraction(24000, 1001) passes through exact.
    return Fraction(fps).limit_denominator(100_000)


class _AvSink(AtomicSink):
    """Shared PyAV muxing: one video stream, frames with pts = frame index."""

    _format: str
    _codec: str

    def __init__(self, path: str | os.PathLike[str], *, fps: float | Fraction) -> None:
        self._fps = _check_fps(fps, path)
        self._av = self._check_codec(path)
        self._container: Any = None
        self._stream: Any = None
        super().__init__(path)  # (its last step: the temporary made, then _open_temp)

    def _open_temp(self) -> None:
        try:
            self._container = self._av.open(self._tmp, "w", format=self._format)
        except (OSError, self._av.FFmpegError) as e:
            raise SinkError(f"cannot open {self._tmp!r} for writing: {e}", path=self._path) from e

    @classmethod
    def _check_codec(cls, path: str | os.PathLike[str]) -> ModuleType:
        av = _import_av(cls.__name__)
        if cls._codec not in av.codecs_available:
            raise SinkError(
                f"this PyAV build has no {cls._codec!r} encoder; install the PyAV wheel "
                f"from PyPI (pip install av), which bundles it",
                path=path,
            )
        return av

    def _io_errors(self) -> tuple[type[BaseException], ...]:
        return (OSError, self._av.FFmpegError)

    def _start(self, height: int, width: int) -> None:
        stream = self._container.add_stream(self._codec, rate=self._fps)
        stream.width = width
        stream.height = height
        self._configure(stream)
        self._stream = stream

    def _configure(self, stream: Any) -> None:
        """Set pixel format and codec options on a new stream."""

    def _to_frame(self, rgb: np.ndarray) -> Any:
        # from_ndarray copies, so the caller's buffer is free once write() returns even
        # though the encoder holds frames for look-ahead.
        return self._av.VideoFrame.from_ndarray(rgb, format="rgb24")

    def _write(self, frames: np.ndarray) -> None:
        for i, rgb in enumerate(frames):
            frame = self._to_frame(rgb)
            frame.pts = self._frames_written + i  # time base is 1/fps
            for packet in self._stream.encode(frame):
                self._container.mux(packet)

    def _finish_temp(self) -> None:
        for packet in self._stream.encode(None):  # drain the encoder's delayed frames
            self._container.mux(packet)
        container, self._container = self._container, None
        container.close()

    def _release(self) -> None:
        if self._container is not None:
            container, self._container = self._container, None
            container.close()


# FFmpeg's AVColorPrimaries / AVColorTransferCharacteristic / AVColorSpace / AVColorRange
# values for BT.709 and limited ("tv", "mpeg") range; stable across FFmpeg versions.
_AVCOL_BT709 = 1
_AVCOL_RANGE_MPEG = 1


def _check_x264(preset: str, crf: float, threads: int, path: str | os.PathLike[str]) -> None:
    if preset not in _X264_PRESETS:
        raise SinkError(
            f"unknown x264 preset {preset!r}; use one of {', '.join(_X264_PRESETS)}", path=path
        )
    if isinstance(crf, bool) or not isinstance(crf, (int, float)) or not 0 <= crf <= 51:
        raise SinkError(f"crf must be a number in 0..51 (lower is better), got {crf!r}", path=path)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise SinkError(f"threads must be an int >= 0 (0 = automatic), got {threads!r}", path=path)


class Mp4Sink(_AvSink):
    """Encode frames to H.264 (libx264, yuv420p) in an MP4, via PyAV.

    RGB is converted with BT.709 coefficients to limited-range YUV and the stream is
    tagged BT.709, which is what players assume for HD video (untagged streams converted
    with FFmpeg's BT.601 default look shifted in hue). ``crf`` (0-51, lower is better) and
    ``preset`` are libx264's; ``threads=0`` lets x264 choose. yuv420p needs even width and
    height, so an odd size raises :class:`SinkError` on the first write.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, Mp4Sink(f"{tmp}/clip.mp4", fps=16, crf=18) as sink:
        ...     sink.write(np.zeros((4, 64, 64, 3), np.uint8))   # uint8 (t, H, W, 3), H and W even
    """

    _format = "mp4"
    _codec = "libx264"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fps: float | Fraction = 16,
        preset: str = "veryfast",
        crf: float = 23,
        threads: int = 0,
    ) -> None:
        _check_x264(preset, crf, threads, path)
        self._preset = preset
        self._crf = crf
        self._threads = threads
        _import_av(type(self).__name__)
        from av.video.reformatter import ColorRange, Colorspace

        self._yuv = {
            "format": "yuv420p",
            "dst_colorspace": Colorspace.ITU709,
            "dst_color_range": ColorRange.MPEG,
        }
        super().__init__(path, fps=fps)  # last: it makes the temporary

    def _check_size(self, height: int, width: int) -> None:
        if height % 2 or width % 2:
            raise SinkError(
                f"frame size {height}x{width} (H x W) is odd, but H.264 in yuv420p needs even "
                f"height and width: crop or pad the frames to {height + height % 2}x"
                f"{width + width % 2}, or write .npy / .y4m / PNG, which take any size",
                path=self._path,
            )

    def _configure(self, stream: Any) -> None:
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(self._crf), "preset": self._preset}
        ctx = stream.codec_context
        ctx.thread_count = self._threads
        ctx.thread_type = "FRAME"  # x264 frame threads: best throughput, a few frames' latency
        ctx.color_primaries = _AVCOL_BT709
        ctx.color_trc = _AVCOL_BT709
        ctx.colorspace = _AVCOL_BT709
        ctx.color_range = _AVCOL_RANGE_MPEG

    def _to_frame(self, rgb: np.ndarray) -> Any:
        # Convert here rather than letting the encoder do it: its implicit conversion uses
        # BT.601, which would contradict the BT.709 tags.
        return super()._to_frame(rgb).reformat(**self._yuv)


class Y4mSink(_AvSink):
    """Write raw YUV 4:4:4 frames to a YUV4MPEG2 (``.y4m``) file, via PyAV.

    Y4M has no RGB mode, so frames are converted with FFmpeg's default (BT.601,
    limited range); decoding back with FFmpeg/PyAV gives each channel within ~2 levels of
    the input. Any frame size works. Useful as lossless-ish input to encoders and metrics
    tools (x264, VMAF).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, Y4mSink(f"{tmp}/clip.y4m", fps=16) as sink:
        ...     sink.write(np.zeros((2, 15, 17, 3), np.uint8))   # uint8 (t, H, W, 3), any size
    """

    _format = "yuv4mpegpipe"
    _codec = "wrapped_avframe"

    def __init__(self, path: str | os.PathLike[str], *, fps: float | Fraction = 16) -> None:
        super().__init__(path, fps=fps)

    def _configure(self, stream: Any) -> None:
        stream.pix_fmt = "yuv444p"


def sink_for_path(
    path: str | os.PathLike[str],
    *,
    fps: float | Fraction = 16,
    preset: str = "veryfast",
    crf: float = 23,
    threads: int = 0,
) -> FrameSink:
    """Choose a sink from the output path.

    ``.mp4`` → :class:`Mp4Sink`, ``.npy`` → :class:`NpySink`, ``.y4m`` →
    :class:`Y4mSink` (suffixes are case-insensitive); a path ending in ``/``, an existing
    folder, or a path without suffix → :class:`PngSink`; ``os.devnull`` →
    :class:`NullSink`. Anything else raises :class:`SinkError` listing what is supported.
    ``preset``/``crf``/``threads`` only apply to mp4, ``fps`` to mp4 and y4m (it is
    validated for every kind).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     type(sink_for_path(f"{tmp}/clip.mp4", fps=24)).__name__, type(sink_for_path(f"{tmp}/frames/")).__name__
        ('Mp4Sink', 'PngSink')
    """
    raw = os.fspath(path)
    _check_fps(fps, raw)
    kind = _sink_class(raw)
    if kind is Mp4Sink:
        return Mp4Sink(raw, fps=fps, preset=preset, crf=crf, threads=threads)
    if kind is Y4mSink:
        return Y4mSink(raw, fps=fps)
    if kind is NullSink:
        return NullSink()
    return kind(raw)


def check_sink_path(
    path: str | os.PathLike[str],
    *,
    fps: float | Fraction = 16,
    preset: str = "veryfast",
    crf: float = 23,
    threads: int = 0,
    frames_folder: bool = True,
) -> None:
    """Raise :class:`SinkError` where :func:`sink_for_path` would; create nothing.

    Checks the suffix, the folder, what is already at ``path``, ``fps`` and, for mp4,
    ``preset``/``crf``/``threads`` and the encoder, so a caller can refuse a bad output
    before loading a model or decoding anything. ``frames_folder=False`` also refuses a
    path :func:`sink_for_path` would fill with PNG frames (an existing folder, even one
    named ``clip.mp4``; a trailing ``/``; no suffix): for a caller that wants one file.

    Example::

        >>> check_sink_path("out/clip.mp4", crf=60)
        Traceback (most recent call last):
        nostall.errors.SinkError: out/clip.mp4: crf must be a number in 0..51 ...
    """
    raw = os.fspath(path)
    _check_fps(fps, raw)
    kind = _sink_class(raw)
    if kind is PngSink and not frames_folder:
        what = "is a folder" if os.path.isdir(raw) else "names a folder ('/' or no suffix)"
        raise SinkError(
            f"{what}, which would receive PNG frames, but one video file is written here: "
            "remove or rename the folder, or give a file path (.mp4, .npy, .y4m)",
            path=raw,
        )
    if kind is Mp4Sink:
        _check_x264(preset, crf, threads, raw)
    if issubclass(kind, _AvSink):
        kind._check_codec(raw)
    if issubclass(kind, AtomicSink):
        kind._check_path(raw)


def _sink_class(raw: str) -> type[FrameSink]:
    if raw == os.devnull:
        return NullSink
    if raw.endswith(("/", os.sep)) or os.path.isdir(raw):
        return PngSink
    suffix = os.path.splitext(raw)[1].lower()
    kinds: dict[str, type[FrameSink]] = {
        "": PngSink,
        ".mp4": Mp4Sink,
        ".npy": NpySink,
        ".y4m": Y4mSink,
    }
    if suffix not in kinds:
        raise SinkError(f"unsupported output suffix {suffix!r}; supported: {_SUPPORTED}", path=raw)
    return kinds[suffix]
