"""One diffusers pipeline call for image jobs: its arguments, for one job or a batch of
like jobs, and the clock that times its phases.

A batch shares one call: a list of prompts and one generator per image, each seeded as
the job alone would seed it (diffusers draws each image's latents from its own
generator). The batched call's float math is not the single call's (BLAS and
convolution kernels are chosen by batch size: on the CPU, the tiny test pipelines'
images differ from the same requests run alone by one level in a few pixels), which is
why the worker batches only when asked (:class:`~nostall.serve.schedule.Policy`).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from nostall.errors import ArgumentError, ShuttingDown

__all__ = ["PhaseClock", "batch_arguments", "cat_embeds", "image_kwargs", "sync"]


def image_kwargs(pipe: Any, job: Any, device: torch.device) -> dict[str, Any]:
    """The pipeline call for ``job`` (an :class:`~nostall.serve.worker.ImageJob`):
    diffusers' own arguments, a generator seeded on the pipeline's device as a user
    would seed it, PIL output."""
    params: Any = {}
    for cls in type(pipe).__mro__:  # the pipeline's own __call__ (the cache wraps it)
        call = cls.__dict__.get("__call__")
        if call is not None:
            params = inspect.signature(call).parameters
            if "prompt" in params:
                break
    kwargs: dict[str, Any] = {
        "prompt": job.prompt,
        "height": job.height,
        "width": job.width,
        "num_inference_steps": job.steps,
        "generator": torch.Generator(device=device.type).manual_seed(job.seed),
        "output_type": "pil",
    }
    if job.guidance is not None:
        kwargs["guidance_scale"] = job.guidance
    if job.negative_prompt is not None:
        if "negative_prompt" not in params:
            raise ArgumentError(f"{type(pipe).__name__} takes no negative_prompt")
        kwargs["negative_prompt"] = job.negative_prompt
    if job.max_sequence_length is not None:
        if "max_sequence_length" not in params:
            raise ArgumentError(f"{type(pipe).__name__} takes no max_sequence_length")
        kwargs["max_sequence_length"] = job.max_sequence_length
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    return kwargs


def batch_arguments(jobs: list[Any], device: torch.device) -> dict[str, Any]:
    """The per-image arguments of one pipeline call for like image ``jobs``: their
    prompts, one generator per image seeded as each job alone seeds it (diffusers draws
    each image's latents from its own generator), and their negative prompts."""
    out: dict[str, Any] = {
        "prompt": [j.prompt for j in jobs],
        "generator": [torch.Generator(device=device.type).manual_seed(j.seed) for j in jobs],
    }
    if jobs[0].negative_prompt is not None:
        out["negative_prompt"] = [j.negative_prompt for j in jobs]
    return out


def cat_embeds(embeds: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-job prompt embeddings (batch of one each) as one batch, in job order."""
    return {k: torch.cat([e[k] for e in embeds]) for k in embeds[0]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseClock:
    """Text-encoder time and the denoising span of one pipeline call, from forward hooks.

    On CUDA the hooks record events on the current stream (no synchronisation inside
    the call: the GPU's queue keeps running) and :meth:`phases` reads them after the
    caller's one synchronisation at the end; elsewhere they read the clock.

    ``stop``: an event that, once set, ends the call at its next denoiser step with
    :class:`~nostall.errors.ShuttingDown` (a worker that drains). ``on_step(steps)``:
    called before each denoiser call after the first (a step boundary) with the calls
    done; it may run other work there and returns the seconds it took, which the
    ``preempted`` phase counts and the denoise span leaves out.
    """

    _TEXT = ("text_encoder", "text_encoder_2", "text_encoder_3")
    _DENOISE = ("transformer", "transformer_2", "unet")

    def __init__(
        self,
        pipe: Any,
        device: torch.device,
        *,
        stop: threading.Event | None = None,
        on_step: Callable[[int], float] | None = None,
    ):
        self.cuda = device.type == "cuda"
        self.stop = stop
        self.on_step = on_step
        self.paused_s = 0.0  # seconds on_step ran other work
        self.steps = 0  # denoiser calls begun
        self.start_s = time.perf_counter()
        self.start = self._mark()
        self.text: list[tuple[Any, Any]] = []  # (begin, end) marks per encoder call
        self.first: Any = None
        self.last: Any = None
        self._open: Any = None
        self._hooks = []
        self._removed = False
        self._hooked: set[int] = set()
        for name in self._TEXT + self._DENOISE:
            self._watch(name, getattr(pipe, name, None))
        experts = getattr(pipe, "nostall_experts", None)
        if experts is not None:  # a two-expert pipeline's second comes in mid-call
            experts.on_swap(self._watch)

    def _watch(self, role: str, m: Any) -> None:
        if not isinstance(m, torch.nn.Module) or id(m) in self._hooked or self._removed:
            return
        self._hooked.add(id(m))
        text = role in self._TEXT  # (a text encoder brought back for a second call)
        self._hooks.append(m.register_forward_pre_hook(self._text_in if text else self._denoise_in))
        self._hooks.append(m.register_forward_hook(self._text_out if text else self._denoise_out))

    def _mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _between(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def _text_in(self, module, args) -> None:
        self._open = self._mark()

    def _text_out(self, module, args, out) -> None:
        self.text.append((self._open, self._mark()))

    def _denoise_in(self, module, args) -> None:
        if self.stop is not None and self.stop.is_set():
            raise ShuttingDown(
                f"the worker is shutting down: the job was stopped after {self.steps} "
                "denoiser calls"
            )
        if self.on_step is not None and self.steps:
            self.paused_s += self.on_step(self.steps)
        self.steps += 1
        if self.first is None:
            self.first = self._mark()

    def _denoise_out(self, module, args, out) -> None:
        self.last = self._mark()

    def remove(self) -> None:
        self._removed = True
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def phases(self, done: float) -> dict[str, float]:
        """``done``: the clock after the call and a synchronisation."""
        text = sum(self._between(a, b) for a, b in self.text)
        if self.first is None or self.last is None:
            return {"text": text, "denoise": 0.0, "decode": done - self.start_s}
        to_last = self._between(self.start, self.last)
        out = {
            "text": text,
            "denoise": max(0.0, self._between(self.first, self.last) - self.paused_s),
            "decode": max(0.0, (done - self.start_s) - to_last),
        }
        if self.paused_s:
            out["preempted"] = self.paused_s
        return out
