"""What one job does on the device: the part of a worker that runs on its thread.

A :class:`Runner` takes an :class:`~nostall.serve.jobs.ImageJob` (or a batch of like
ones) or a :class:`~nostall.serve.jobs.VideoJob` through the model cache: the switch (the pipeline's components the job
needs, LoRAs fused and a ControlNet attached as it asks), the prompt's embeddings (from
the embedding service, beside the switch, or the pipeline's own encoders), the pipeline
call and, for a decode, the asynchronous frame pipeline into an MP4. It measures each
job's activation peak into the device budget and runs a job once more after running out
of device memory (:class:`~nostall.errors.DeviceBusy` the second time). The queue, the
thread and the lifecycle around it are :class:`~nostall.serve.worker.Worker`'s.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from nostall.errors import (
    ArgumentError,
    Cancelled,
    CheckpointError,
    DeviceBusy,
    NostallError,
    UnknownModel,
    UnsupportedError,
)
from nostall.serve.budget import DeviceBudget, is_out_of_memory
from nostall.serve.calls import PhaseClock, batch_arguments, cat_embeds, image_kwargs, sync
from nostall.serve.jobs import GenerateJob, ImageJob, VideoJob, activation_key
from nostall.serve.results import Result

__all__ = ["Runner"]

log = logging.getLogger(__name__)


class Runner:
    """Runs jobs of ``cache`` (a :class:`~nostall.ModelCache`) within ``budget``.

    ``embed_url``: an embedding service for FLUX, SDXL and SD3 prompts (their text
    encoders then stay out of the switch); ``stop``: the event that ends a running job at
    its next denoiser step (a draining worker sets it). Owns the embedding client and its
    thread: :meth:`close` them.
    """

    def __init__(
        self,
        cache: Any,
        budget: DeviceBudget,
        *,
        embed_url: str | None = None,
        stop: threading.Event | None = None,
    ):
        self.cache, self.budget, self.device = cache, budget, cache.device
        self.stop = stop or threading.Event()
        # The embedding service, when configured: FLUX, SDXL and SD3 prompts are encoded
        # there (nostall.serve.prompts), the requests start before the switch and run
        # beside it.
        self._embed = None
        self._embed_pool = None
        self._embed_down_said = False
        if embed_url:
            from concurrent.futures import ThreadPoolExecutor

            from nostall.serve.client import EmbeddingClient

            self._embed = EmbeddingClient(embed_url)
            self._embed_pool = ThreadPoolExecutor(1, thread_name_prefix="nostall-embed-client")

        self._frames = None  # the asynchronous frame pipeline of generated videos
        # ``on_step(job, steps)``: called at each step boundary of a job running alone
        # (the worker preempts there); returns the seconds it ran other jobs
        self.on_step: Callable[[Any, int], float] | None = None

    def close(self) -> None:
        """Wait for the videos being written, then close the frame pipeline and the
        embedding client."""
        if self._frames is not None:
            self._frames.close()
        if self._embed_pool is not None:
            self._embed_pool.shutdown(wait=True)
            self._embed.close()

    def attempt(self, job: ImageJob | VideoJob, start: float) -> Result:
        """Run ``job``, its activation peak measured into the budget. Out of device
        memory: free what can be freed and run it once more; out again:
        :class:`DeviceBusy`. (The cache's GPU tier is one allocation: evicting from it
        frees no device memory, so nothing is evicted. What a failed attempt held is
        garbage once its frames are gone, and torch's cached blocks can be given back.)"""
        if isinstance(job, GenerateJob):
            run = self._generate_video
        else:
            run = self._video if isinstance(job, VideoJob) else self._image
        pipeline, shape = activation_key(job)
        try:
            with self.budget.measure(pipeline, shape):
                return run(job, start)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            log.warning("%s at %s ran out of device memory (%s); once more", pipeline, shape, first)
        # outside the handler: the failed attempt's frames, and their tensors, are garbage
        self.budget.memory.release()
        try:
            with self.budget.measure(pipeline, shape):
                return run(job, start)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            wait = min(30, max(1, round(time.perf_counter() - start)))
            raise DeviceBusy(
                f"{pipeline} at {shape} ran out of device memory twice ({first}); retry in "
                f"{wait} s. The next start reserves what it reached (this process's device "
                f"budget: {self.budget.describe()}); or give the worker a larger activation "
                "reserve (--activation-reserve-gb)",
                retry_after=wait,
            ) from e.with_traceback(None)  # its frames hold the attempt's tensors

    def _switch_report(self, name: str) -> dict[str, Any]:
        for r in reversed(self.cache.reports):
            if r.pipeline == name and not r.prefetch and not r.expert:
                return r.as_dict()
        return {}

    def remote_roles(self, model: str) -> tuple[str, ...]:
        """The text encoders ``model`` leaves to the embedding service (none without one,
        or for a pipeline the service cannot encode for)."""
        from nostall.serve.prompts import REMOTE_PIPELINES

        if self._embed is None:
            return ()
        entry = self.cache.store.entry(model)
        needed = REMOTE_PIPELINES.get(entry.class_name, ())
        if not needed or any(entry.components.get(r) is None for r in needed):
            return ()
        return needed

    def _remote_embeds(self, job: ImageJob) -> tuple[dict[str, torch.Tensor], float]:
        """The job's prompt embeddings from the embedding service and the seconds they
        took."""
        from nostall.serve.prompts import remote_prompt_embeds

        t = time.perf_counter()
        entry = self.cache.store.entry(job.model)
        embeds = remote_prompt_embeds(
            lambda enc, text, n, layer: self._embed.encode(enc, [text], n, layer),
            job.model,
            entry.class_name,
            {role for role, c in entry.components.items() if c is not None},
            job.prompt,
            job.negative_prompt,
            job.max_sequence_length,
            zeros_for_empty_negative=bool(entry.config.get("force_zeros_for_empty_prompt", True)),
        )
        return embeds, time.perf_counter() - t

    def _image(self, job: ImageJob, start: float) -> Result:
        # With the embedding service, the pipeline is switched in without its text
        # encoders (their bytes stay where they are) while the service encodes the
        # prompt; if the service fails, the encoders are switched in and encode locally.
        roles = self.without(job)
        self._read_loras(job)
        remote = self._embed_pool.submit(self._remote_embeds, job) if roles else None
        embeds, text_wait, service_s = None, 0.0, 0.0
        control = job.controlnet[0] if job.controlnet else None
        with self.cache.use(job.model, without=roles, loras=job.loras, controlnet=control) as pipe:
            switched = time.perf_counter()
            report = self._switch_report(job.model)
            if remote is not None:
                try:
                    embeds, service_s = remote.result()
                except NostallError as e:
                    if not self._embed_down_said:
                        self._embed_down_said = True
                        log.warning("embedding service unusable (%s); encoding locally", e)
                text_wait = time.perf_counter() - switched
            if embeds is not None or not roles:
                image, clock, done = self._generate(pipe, job, embeds)
        if roles and embeds is None:  # the service failed: the whole pipeline, locally
            with self.cache.use(job.model, loras=job.loras, controlnet=control) as pipe:
                switched = time.perf_counter()
                report = self._switch_report(job.model)
                image, clock, done = self._generate(pipe, job, None)
        phases = {"switch": switched - start, **_switch_phases(report), **clock.phases(done)}
        if embeds is not None:  # the text phase is the wait for the service after the switch
            phases["text"] = text_wait
            phases["text_service"] = service_s
        info = {"seed": job.seed, "size": image.size}
        return Result(b"", "image/png", phases, report, info, image=image)  # PNG: Settler

    def images(self, jobs: list[ImageJob], start: float) -> list[Result]:
        """:meth:`_image` for like jobs, in one pipeline call. The embedding service's
        failure fails the batch (its jobs then run alone, and encode locally)."""
        roles = self.without(jobs[0])
        self._read_loras(jobs[0])  # (a batch's jobs want the same LoRAs: lineup's shape)
        remote = [self._embed_pool.submit(self._remote_embeds, j) for j in jobs] if roles else []
        with self.cache.use(jobs[0].model, without=roles, loras=jobs[0].loras) as pipe:
            switched = time.perf_counter()
            report = self._switch_report(jobs[0].model)
            embeds = cat_embeds([f.result()[0] for f in remote]) if remote else None
            text_wait = time.perf_counter() - switched
            images, clock, done = self._generate(pipe, jobs, embeds)
        phases = {"switch": switched - start, **_switch_phases(report), **clock.phases(done)}
        if embeds is not None:
            phases["text"] = text_wait
        results = []
        for job, image in zip(jobs, images, strict=True):
            info = {"seed": job.seed, "size": image.size, "batch": len(jobs)}
            results.append(Result(b"", "image/png", dict(phases), report, info, image=image))
        return results

    def _read_loras(self, job: ImageJob) -> None:
        """Read the job's LoRAs (or find them read): a file the server cannot use is the
        request's 422 naming it, not the worker's 500."""
        for name, _ in job.loras:
            try:
                self.cache.lora(name, job.model)
            except (CheckpointError, UnknownModel, UnsupportedError) as e:
                raise ArgumentError(f"loras: {name!r} cannot be used: {e}", field="loras") from e

    def _generate(
        self, pipe: Any, job: ImageJob | list[ImageJob], embeds: dict[str, torch.Tensor] | None
    ):
        """Run ``pipe`` for ``job`` (with ``embeds`` in place of the prompts, if given):
        the image, the phase clock, and when it finished. For a list of like jobs: one
        call, their images in order."""
        from nostall.serve.prompts import apply

        clock = PhaseClock(pipe, self.device, stop=self.stop, on_step=self._boundary(job))
        try:
            jobs = job if isinstance(job, list) else [job]
            kwargs = image_kwargs(pipe, jobs[0], self.device)
            if jobs[0].controlnet is not None:  # (never batched: lineup)
                _, kwargs["image"], kwargs["controlnet_conditioning_scale"] = jobs[0].controlnet
            if len(jobs) > 1:
                kwargs.update(batch_arguments(jobs, self.device))
            if embeds is not None:
                apply(kwargs, embeds, pipe, self.device)
            with torch.inference_mode():
                images = pipe(**kwargs).images
            sync(self.device)
            return images if isinstance(job, list) else images[0], clock, time.perf_counter()
        finally:
            clock.remove()

    def _boundary(self, job: Any) -> Callable[[int], float] | None:
        """The step-boundary callback of a job that runs alone (a batch is not paused)."""
        on_step = self.on_step
        if on_step is None or isinstance(job, list):
            return None
        return lambda steps: on_step(job, steps)

    def without(self, job: ImageJob | VideoJob) -> tuple[str, ...]:
        """The weights components ``job`` does not need switched in: for a decode,
        everything but the VAE; for an image, the text encoders the embedding service
        stands in for."""
        if isinstance(job, GenerateJob):  # the whole pipeline: it encodes its prompt
            return ()
        if isinstance(job, VideoJob):
            entry = self.cache.store.entry(job.model)
            if entry.components.get("vae") is None:
                raise ArgumentError(f"pipeline {job.model!r} has no vae to decode latents with")
            return tuple(c.role for c in entry.weights if c.role != "vae")
        if job.loras or job.controlnet:  # (a LoRA may adapt the text encoders; a
            return ()  # ControlNet pipeline is another class): the whole pipeline, here
        return self.remote_roles(job.model)

    def _video(self, job: VideoJob, start: float) -> Result:
        from nostall.video import decode_to_file, denormalize

        fd, path = tempfile.mkstemp(suffix=".mp4", prefix="nostall-decode-")
        os.close(fd)
        os.remove(path)  # decode_to_file writes a temporary name and renames into it
        # the pipeline's VAE alone, through the cache (its tiers and budget): a decode
        # needs neither the transformer nor the text encoders
        with self.cache.use(job.model, without=self.without(job)) as pipe:
            switched = time.perf_counter()
            report = self._switch_report(job.model)
            vae = pipe.vae
            z = job.latents.to(self.device, next(vae.parameters()).dtype)
            if job.denormalize:
                z = denormalize(vae, z)
            try:
                t = time.perf_counter()
                with torch.inference_mode():
                    out = decode_to_file(vae, z, path, fps=job.fps, mode=job.mode)
                decode_s = time.perf_counter() - t
                with open(path, "rb") as f:
                    body = f.read()
            finally:
                if os.path.exists(path):
                    os.remove(path)
        phases = {"switch": switched - start, **_switch_phases(report), "decode": decode_s}
        return Result(body, "video/mp4", phases, report, {"frames": out.frames})

    def _generate_video(self, job: GenerateJob, start: float) -> Result:
        """Denoise ``job``'s latents with its pipeline, decode them chunk by chunk into the
        asynchronous frame pipeline and return once the decode is launched: the writer
        thread finishes the MP4 (``info["written"]``, a future of its
        :class:`~nostall.video.DecodeResult`) while the next job starts. ``progress``
        (``job.progress``, called with the steps and frames done) counts both."""
        from nostall.video import AsyncFramePipeline, check_sink_path, denormalize, submit_decode

        # Before a step is spent: the output is one file. A folder at its path (a stale
        # `<id>.mp4/`) would take PNG frames (sink_for_path's rule) and "complete" the job.
        check_sink_path(job.path, fps=job.fps, frames_folder=False)

        def step_end(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if job.cancel.is_set():
                raise Cancelled(f"cancelled after {i + 1} of {job.steps} steps")
            if job.progress is not None:
                job.progress(i + 1, 0)
            return {}

        if job.progress is not None:  # in progress from when this thread takes it
            job.progress(0, 0)
        with self.cache.use(job.model) as pipe:
            switched = time.perf_counter()
            report = self._switch_report(job.model)
            clock = PhaseClock(pipe, self.device, stop=self.stop, on_step=self._boundary(job))
            try:
                kwargs = _generate_kwargs(pipe, job, self.device)
                kwargs["callback_on_step_end"] = step_end
                with torch.inference_mode():
                    latents = pipe(**kwargs).frames
                    vae = pipe.vae
                    z = denormalize(vae, latents.to(next(vae.parameters()).dtype))
                    if self._frames is None:
                        self._frames = AsyncFramePipeline(device=self.device)
                    t = time.perf_counter()
                    written = submit_decode(
                        vae,
                        z,
                        job.path,
                        pipeline=self._frames,
                        fps=job.fps,
                        mode=job.mode,
                        progress=None
                        if job.progress is None
                        else (lambda n: job.progress(job.steps, n)),
                    )
                    launched = time.perf_counter()
                sync(self.device)
                done = time.perf_counter()
            finally:
                clock.remove()
            experts = getattr(pipe, "nostall_experts", None)
            boundary = [r.total_s for r in experts.reports] if experts is not None else []
        phases = {"switch": switched - start, **_switch_phases(report), **clock.phases(t)}
        if boundary:  # the second expert's switch, inside the denoise span
            phases["expert_switch"] = sum(boundary)
        phases["decode"] = launched - t  # launched; the writer thread finishes the file
        phases["sync"] = done - launched
        info = {"seed": job.seed, "frames": job.frames, "written": written}
        return Result(b"", "video/mp4", phases, report, info)


def _generate_kwargs(pipe: Any, job: GenerateJob, device: torch.device) -> dict[str, Any]:
    """The Wan pipeline call of ``job``: diffusers' own arguments, a generator seeded on
    the pipeline's device as a user would seed it, latents out (nostall decodes them)."""
    kwargs: dict[str, Any] = {
        "prompt": job.prompt,
        "height": job.height,
        "width": job.width,
        "num_frames": job.frames,
        "num_inference_steps": job.steps,
        "generator": torch.Generator(device=device.type).manual_seed(job.seed),
        "output_type": "latent",
    }
    for name, value in (
        ("negative_prompt", job.negative_prompt),
        ("guidance_scale", job.guidance),
        ("guidance_scale_2", job.guidance_2),
        ("max_sequence_length", job.max_sequence_length),
        ("image", job.image),
    ):
        if value is not None:
            kwargs[name] = value
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return kwargs


def _switch_phases(report: dict[str, Any]) -> dict[str, float]:
    comps = report.get("components", [])
    return {
        "read": sum(c.get("read_s", 0.0) for c in comps),
        "copy": sum(c.get("copy_s", 0.0) for c in comps),
        "build": sum(c.get("build_s", 0.0) for c in comps),
    }
