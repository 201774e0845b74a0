"""Stall-free video output: chunked Wan VAE decode, the async frame pipeline, frame sinks.

One video from a tensor, or a batch of latents files (what ``nostall decode`` runs):

>>> from nostall.video import decode_files, decode_to_file, output_paths
>>> decode_to_file(vae, latents, "out.mp4", fps=16)  # doctest: +SKIP
>>> paths = ["a.pt", "b.pt"]
>>> decode_files(paths, vae, output_paths(paths, "videos/"), denormalize=True)  # doctest: +SKIP
"""

from nostall.video.decode import DecodeResult, decode_to_file, submit_decode
from nostall.video.files import decode_files, output_paths
from nostall.video.frames import to_uint8_frames
from nostall.video.pipeline import AsyncFramePipeline, FrameStats, SyncFramePipeline, drain
from nostall.video.sinks import (
    FrameSink,
    Mp4Sink,
    NpySink,
    NullSink,
    PngSink,
    Y4mSink,
    check_sink_path,
    sink_for_path,
)
from nostall.video.wan import check_latents, decode_chunks, denormalize, frame_count, vae_placement

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
    "check_sink_path",
    "decode_chunks",
    "decode_files",
    "decode_to_file",
    "denormalize",
    "drain",
    "frame_count",
    "output_paths",
    "sink_for_path",
    "submit_decode",
    "to_uint8_frames",
    "vae_placement",
]
