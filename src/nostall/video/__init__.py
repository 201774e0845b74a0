"""Stall-free video output: chunked Wan VAE decode, the async frame pipeline, frame sinks.

>>> from nostall.video import decode_to_file
>>> decode_to_file(vae, latents, "out.mp4", fps=16)  # doctest: +SKIP
"""

from nostall.video.decode import DecodeResult, decode_to_file, submit_decode
from nostall.video.frames import to_uint8_frames
from nostall.video.pipeline import AsyncFramePipeline, FrameStats, SyncFramePipeline, drain
from nostall.video.sinks import (
    FrameSink,
    Mp4Sink,
    NpySink,
    NullSink,
    PngSink,
    Y4mSink,
    sink_for_path,
)
from nostall.video.wan import check_latents, decode_chunks, denormalize, frame_count

__all__ = [
    "AsyncFramePipeline",
    "DecodeResult",
    "FrameSink",
    "FrameStats",
    "Mp4Sink",
    "NpySink",
    "NullSink",
    "PngSink",
    "SyncFramePipeline",
    "Y4mSink",
    "check_latents",
    "decode_chunks",
    "decode_to_file",
    "denormalize",
    "drain",
    "frame_count",
    "sink_for_path",
    "submit_decode",
    "to_uint8_frames",
]
