"""The Wan decoder's ``exact`` mode: the same arithmetic as diffusers, fewer passes.

Profiled on the H200 (720p, bf16), the decoder's convolutions are about a third of
its GPU time; the rest is memory traffic around them: each causal conv's input is built
by ``cat`` (the cached frames before the new ones) and ``F.pad``, the RMS norm makes a
float copy and five more full passes, every up-sampler converts to float and back.
This mode runs the decoder's own modules and weights (nothing is patched or copied)
through a forward that:

* lays each causal conv's input out in one zero-bordered working buffer: its two
  cached frames, then the new frames written straight into the interior, so the conv
  reads the exact tensor eager builds with ``cat`` + ``F.pad`` (same shape, same
  layout, same cuDNN algorithm, same bits) without either copy;
* fuses RMS norm and SiLU into one kernel that writes there (:mod:`.kernels`);
* interleaves the temporal up-sampler's output and reorders it for the spatial
  up-sampler in one copy, and up-samples in the activation dtype (nearest neighbour
  moves values, so skipping the float round trip changes no bit).

Convolutions, attention, residual adds and the clamp are eager's own calls. The
frames are bit-identical to ``vae.decode`` (tested on CPU with tiny VAEs and on the
GPU at 720p, Wan 2.1 and 2.2).
"""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nostall.video.kernels import (
    add_bias_,
    bias_residual,
    copy_into,
    rms_silu_cl_into,
    rms_silu_into,
    triton_available,
    upsample2x_cl,
)

__all__ = ["ExactDecoder", "ExactState", "FastDecoder", "unsupported_reason"]

log = logging.getLogger(__name__)


class ExactState:
    """One video's decoder state: each causal conv's last two input frames (padded, as the
    conv reads them), which temporal up-samplers have seen their first chunk, and one
    working buffer that every causal conv's input is laid out in, one conv after another
    (sized for the largest; its border is zeroed when the layout changes, about five
    times a chunk). Per video, so videos decoded at once never share a buffer;
    :meth:`clear` (at the end of the video) gives it all back."""

    def __init__(self) -> None:
        self.history: dict[int, torch.Tensor] = {}
        self.started: set[int] = set()
        self.flat: dict[torch.device, torch.Tensor] = {}  # per device (one per stage)
        self.layout: dict[torch.device, tuple] = {}
        # fast mode: the shape key of the last chunk run eagerly, and the captured graph
        # (key, graph, static input, static output) that replays the steady chunk
        self.warm: tuple | None = None
        self.graph: tuple | None = None

    def buffer(
        self, shape: tuple[int, ...], like: torch.Tensor, channels_last: bool = False
    ) -> torch.Tensor:
        """A zero-bordered buffer of ``shape`` on ``like``'s device, viewing the working
        memory of that device (``channels_last``: channels adjacent in memory)."""
        need = 1
        for n in shape:
            need *= n
        dev = like.device
        flat = self.flat.get(dev)
        if flat is None or flat.numel() < need:
            self.flat.pop(dev, None)  # the old one goes before the new one is taken
            flat = self.flat[dev] = like.new_empty(need)
            self.layout.pop(dev, None)
        if channels_last:
            b, c, t, h, w = shape
            buf = flat[:need].view(b, t, h, w, c).permute(0, 4, 1, 2, 3)
        else:
            buf = flat[:need].view(shape)
        key = (shape, like.dtype, channels_last)
        if self.layout.get(dev) != key:
            buf.zero_()  # only interiors and whole history frames are written from now on
            self.layout[dev] = key
        return buf

    def clear(self) -> None:
        self.graph = None
        self.warm = None
        self.history.clear()
        self.started.clear()
        self.flat.clear()
        self.layout.clear()


class _Head(nn.Module):
    """The decoder's head (``norm_out`` + SiLU + ``conv_out``) as a module of its own."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.norm_out, self.conv_out = decoder.norm_out, decoder.conv_out


def _copy_to(m: nn.Module, kind: str, dev: torch.device | None) -> nn.Module:
    """A copy of step ``m`` on ``dev`` (the head: only ``norm_out`` and ``conv_out``)."""
    src = _Head(m) if kind == "head" else m
    out = copy.deepcopy(src)
    return out.to(dev) if dev is not None else out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _on(dev: torch.device | None):
    if dev is not None and dev.type == "cuda":
        return torch.cuda.device(dev)
    return _Nothing()


def _steps(decoder: nn.Module, wan: Any) -> list[tuple[str, nn.Module]]:
    """The decoder after its middle block as a list of steps a stage boundary may fall
    between: each residual block and up-sampler of a Wan 2.1 up block, each Wan 2.2 up
    block whole (its shortcut needs the block's input at its end), then the head."""
    steps: list[tuple[str, nn.Module]] = []
    for up in decoder.up_blocks:
        if isinstance(up, wan.WanResidualUpBlock):
            steps.append(("up", up))
            continue
        steps += [("res", r) for r in up.resnets]
        if up.upsamplers is not None:
            steps.append(("resample", up.upsamplers[0]))
    steps.append(("head", decoder))
    return steps


def split_points(decoder: nn.Module, wan: Any, stages: int) -> list[int]:
    """Where to cut the decoder's up blocks (and head) into ``stages`` contiguous groups,
    the first also running ``conv_in`` and the middle block: the cut that makes the most
    expensive stage cheapest, by the estimated work of a steady-state chunk
    (:func:`_step_costs`)."""
    costs = _step_costs(decoder, wan)
    base, steps = costs[0], costs[1:]
    if stages < 2:
        return []
    n = len(steps)
    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        loads = [sum(steps[bounds[k] : bounds[k + 1]]) for k in range(stages)]
        loads[0] += base
        worst = max(loads)
        if best is None or worst < best[0]:
            best = (worst, list(cuts))
    return best[1] if best is not None else []


# Work per activation element that is not a multiply-accumulate (the fused norm, the
# buffer copies, bias and residual adds, cuDNN's layout transposes), in MAC
# equivalents, calibrated on the H200 (720p bf16, 21 latent frames, exact over two
# GPUs): cutting after step 9, 10, 11 or 12 took 2.14, 1.92, 1.71 and 1.60 s
# (bench/diag/vae-exact-two-gpus-045851d.json). At 4,000 (the op profile's estimate)
# the model chose 11; the full-resolution steps weigh more than their MACs say (their
# convs run a slower cuDNN kernel and their element passes are the largest), and 8,000
# is the value at which it chooses the measured best, 12.
_ELEMENT_WORK = 8000.0


def _step_costs(decoder: nn.Module, wan: Any) -> list[float]:
    """Relative work per chunk of conv_in + middle, then each of :func:`_steps` (latent
    area 1): each conv's MACs plus its input's elements times :data:`_ELEMENT_WORK`."""

    def conv(m: nn.Module, area: float, t: float) -> float:
        if isinstance(m, nn.Conv3d):
            k = m.kernel_size[0] * m.kernel_size[1] * m.kernel_size[2]
        elif isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1]
        else:
            return 0.0
        return m.in_channels * (m.out_channels * k + _ELEMENT_WORK) * area * t

    def block(m: nn.Module, area: float, t: float) -> float:
        return sum(conv(c, area, t) for c in m.modules() if isinstance(c, (nn.Conv2d, nn.Conv3d)))

    def resample(m: nn.Module, area: float, t: float) -> tuple[float, float, float]:
        cost = 0.0
        if m.mode == "upsample3d":
            cost += conv(m.time_conv, area, t)
            t *= 2
        area *= 4
        return cost + conv(m.resample[1], area, t), area, t

    area, t = 1.0, 1.0
    out = [conv(decoder.conv_in, area, t) + block(decoder.mid_block, area, t)]
    for kind, m in _steps(decoder, wan):
        if kind == "res":
            out.append(block(m, area, t))
        elif kind == "resample":
            cost, area, t = resample(m, area, t)
            out.append(cost)
        elif kind == "up":
            cost = sum(block(r, area, t) for r in m.resnets)
            if m.upsampler is not None:
                more, area, t = resample(m.upsampler, area, t)
                cost += more
            out.append(cost)
        else:
            out.append(conv(m.conv_out, area, t))
    return out


def unsupported_reason(decoder: nn.Module, wan: Any) -> str | None:
    """Why ``exact`` cannot run this decoder (``None`` if it can)."""
    need = ("conv_in", "mid_block", "up_blocks", "norm_out", "conv_out", "nonlinearity")
    missing = [n for n in need if not hasattr(decoder, n)]
    if missing:
        return f"the decoder has no {', '.join(missing)}"
    for m in decoder.modules():
        if getattr(m, "_hf_hook", None) is not None:
            # accelerate's offload hooks move weights in on each module call; exact calls
            # some convs below the module call, where no hook runs
            return "an accelerate-offloaded decoder (its hooks move weights per call)"
        if isinstance(m, wan.WanRMS_norm):
            if not m.channel_first or not isinstance(m.bias, float) or m.bias != 0.0:
                return "an RMS norm with a bias or channels last"
        elif isinstance(m, wan.WanResidualBlock):
            if not isinstance(m.nonlinearity, nn.SiLU):
                return f"a residual block with {type(m.nonlinearity).__name__}, not SiLU"
        elif isinstance(m, wan.WanCausalConv3d):
            if tuple(m.stride) != (1, 1, 1) or tuple(m.dilation) != (1, 1, 1) or m.groups != 1:
                return "a strided, dilated or grouped causal conv"
            if m._padding[4] not in (0, 2) or m._padding[4] != 2 * (m.kernel_size[0] // 2):
                return f"a causal conv with temporal padding {m._padding[4]}"
        elif isinstance(m, wan.WanResample) and m.mode not in ("upsample2d", "upsample3d"):
            return f"a {m.mode} resampler in the decoder"
    if not isinstance(decoder.nonlinearity, nn.SiLU):
        return f"a decoder head with {type(decoder.nonlinearity).__name__}, not SiLU"
    for up in decoder.up_blocks:
        if not isinstance(up, (wan.WanUpBlock, wan.WanResidualUpBlock)):
            return f"an up block of type {type(up).__name__}"
    return None


class ExactDecoder:
    """Runs ``decoder`` (diffusers' ``WanDecoder3d``) one latent frame at a time; all
    state is in the :class:`ExactState` passed to :meth:`forward`.

    ``devices`` (two or more) splits the decoder into a pipeline of stages, one per
    device, cut between up blocks where the estimated work is most even (for Wan 2.1 at
    any resolution: the last up block and the head on the second GPU, everything before
    on the first). Chunk ``i``'s second stage runs while chunk ``i + 1``'s first stage
    does: the launches are asynchronous, and the activation crosses over (NVLink on our
    machines) once per chunk. Every stage runs the same kernels on the same inputs as
    one device would, so the frames are bit-identical to one-device ``exact`` (and to
    ``vae.decode``) on identical GPUs. The later stages' modules are copies of the
    user's, made when the decoder is built (the user's module stays where it is).
    """

    def __init__(
        self,
        decoder: nn.Module,
        wan: Any,
        *,
        fused: bool = True,
        devices: list[torch.device] | None = None,
    ):
        self.decoder = decoder
        self.wan = wan
        self.fused = fused
        steps = _steps(decoder, wan)
        cuts = split_points(decoder, wan, len(devices)) if devices and len(devices) > 1 else []
        # stage k runs steps[bounds[k]:bounds[k + 1]] on devices[k]; stage 0 also conv_in + mid
        bounds = [0, *cuts, len(steps)]
        self.stages: list[tuple[torch.device | None, list[tuple[str, nn.Module]]]] = []
        for k in range(len(bounds) - 1):
            part = steps[bounds[k] : bounds[k + 1]]
            dev = devices[k] if devices else None
            if k > 0:
                part = [(kind, _copy_to(m, kind, dev)) for kind, m in part]
            self.stages.append((dev, part))

    def forward(self, x: torch.Tensor, state: ExactState, *, first: bool) -> torch.Tensor:
        d = self.decoder
        x = self._causal(d.conv_in, x, state)
        mid = d.mid_block
        x = self._resblock(mid.resnets[0], x, state)
        for attn, res in zip(mid.attentions, mid.resnets[1:], strict=True):
            if attn is not None:
                x = attn(x)
            x = self._resblock(res, x, state)
        for k, (dev, part) in enumerate(self.stages):
            if k > 0:
                # On the source's stream, ordered both ways with the target's (PyTorch's
                # cross-device copy): the next chunk's first stage queues behind it.
                x = x.to(dev, non_blocking=True)
            with _on(dev):
                for kind, m in part:
                    if kind == "res":
                        x = self._resblock(m, x, state)
                    elif kind == "resample":
                        x = self._resample(m, x, state)
                    elif kind == "up":
                        x = self._up(m, x, state, first)
                    else:
                        x = self._norm_silu_conv(m.norm_out, m.conv_out, x, state)
        return x

    def _up(self, up: nn.Module, x: torch.Tensor, state: ExactState, first: bool):
        x_in = x
        for res in up.resnets:
            x = self._resblock(res, x, state)
        if isinstance(up, self.wan.WanResidualUpBlock):
            if up.upsampler is not None:
                x = self._resample(up.upsampler, x, state)
            if up.avg_shortcut is not None:
                x = x + up.avg_shortcut(x_in, first_chunk=first)
        elif up.upsamplers is not None:
            x = self._resample(up.upsamplers[0], x, state)
        return x

    # ---- blocks ------------------------------------------------------------------

    def _resblock(self, r: nn.Module, x: torch.Tensor, state: ExactState) -> torch.Tensor:
        if isinstance(r.conv_shortcut, nn.Conv3d) and _bias_apart(x):
            h = self._causal(r.conv_shortcut, x, state)  # 1x1x1: the conv, then its bias
        else:
            h = r.conv_shortcut(x)  # identity, or eager's own call
        if not _bias_apart(x):
            y = self._norm_silu_conv(r.norm1, r.conv1, x, state)
            y = self._norm_silu_conv(r.norm2, r.conv2, y, state)
            return y + h
        # cuDNN convs have no bias: ATen adds it after the conv, in the output's dtype.
        # Doing that ourselves is the same arithmetic in fewer passes: conv1's bias in one
        # vectorised pass, conv2's bias together with the residual add.
        y = self._norm_silu_conv(r.norm1, r.conv1, x, state, bias=False)
        add_bias_(y, r.conv1.bias)
        y = self._norm_silu_conv(r.norm2, r.conv2, y, state, bias=False)
        return bias_residual(y, r.conv2.bias, h)

    def _resample(self, m: nn.Module, x: torch.Tensor, state: ExactState) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if m.mode == "upsample3d":
            if id(m) not in state.started:
                state.started.add(id(m))  # eager's "Rep": the first chunk skips the time conv
                frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
            else:
                y = self._causal(m.time_conv, x, state)  # (b, 2c, t, h, w)
                # eager: reshape (b, 2, c, t, h, w), stack the halves on a new axis 3,
                # then permute (b, t', c, h, w) and reshape; one copy does both.
                frames = y.view(b, 2, c, t, h, w).permute(0, 3, 1, 2, 4, 5)
                t *= 2
                frames = frames.reshape(b * t, c, h, w)
        else:
            frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        up, conv = m.resample[0], m.resample[1]
        frames = F.interpolate(
            frames,
            size=up.size,
            scale_factor=up.scale_factor,
            mode=up.mode,
            align_corners=up.align_corners,
            recompute_scale_factor=up.recompute_scale_factor,
        )
        frames = self._conv2d(conv, frames)
        return frames.view(b, t, *frames.shape[1:]).permute(0, 2, 1, 3, 4)

    def _conv2d(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not _bias_apart(x):
            return conv(x)
        return add_bias_(nn.Conv2d._conv_forward(conv, x, self._weight(conv), None), conv.bias)

    def _norm_silu_conv(
        self,
        norm: nn.Module,
        conv: nn.Module,
        x: torch.Tensor,
        state: ExactState,
        *,
        bias: bool = True,
    ) -> torch.Tensor:
        def fill(dst: torch.Tensor) -> None:
            rms_silu_into(x, norm.gamma, norm.scale, dst, fused=self.fused)

        return self._causal(conv, x, state, fill, bias=bias)

    channels_last = False  # the working buffer's layout (fast mode: channels last)

    def _weight(self, conv: nn.Module) -> torch.Tensor:
        return conv.weight

    def _causal(self, conv: nn.Module, x: torch.Tensor, state: ExactState, fill=None, *, bias=True):
        """``conv(x, cache)`` as WanCausalConv3d computes it, through a padded buffer.

        ``fill(dst)`` writes the conv's input frames into ``dst`` (default: a copy of
        ``x``); the buffer's first two frames are the cached ones, its border is zero.
        ``bias=False``: the conv without its bias (the caller adds it)."""
        pw, _, ph, _, pt, _ = conv._padding
        b, _, t, h, w = x.shape
        if pt == 0:  # a 1x1x1 conv: no cache, no padding (eager pads by nothing)
            src = x if fill is None else torch.empty_like(x)
            if fill is not None:
                fill(src)
            return self._conv3d(conv, src, bias)
        c = conv.in_channels
        cl = self.channels_last
        hp, wp = h + 2 * ph, w + 2 * pw
        buf = state.buffer((b, c, pt + t, hp, wp), x, cl)
        hist = state.history.get(id(conv))
        if hist is None:
            hist = (
                x.new_zeros(b, pt, hp, wp, c).permute(0, 4, 1, 2, 3)
                if cl
                else x.new_zeros(b, c, pt, hp, wp)
            )
            state.history[id(conv)] = hist
        copy_into(buf[:, :, :pt], hist)
        dst = buf[:, :, pt:, ph : ph + h, pw : pw + w]
        if fill is None:
            dst.copy_(x)
        else:
            fill(dst)
        out = self._conv3d(conv, buf, bias)
        copy_into(hist, buf[:, :, t : t + pt])  # the last two frames the conv saw
        return out

    def _conv3d(self, conv: nn.Module, x: torch.Tensor, bias: bool) -> torch.Tensor:
        """The conv (``bias``: with its bias; where cuDNN runs it, added by our kernel in
        the pass ATen would make: the same arithmetic, vectorised)."""
        if not bias:
            return nn.Conv3d._conv_forward(conv, x, self._weight(conv), None)
        if not _bias_apart(x):
            return nn.Conv3d._conv_forward(conv, x, self._weight(conv), conv.bias)
        return add_bias_(nn.Conv3d._conv_forward(conv, x, self._weight(conv), None), conv.bias)


def _bias_apart(x: torch.Tensor) -> bool:
    """Whether this device's convs add their bias after the conv, as cuDNN's do (ATen
    adds it in a pass of its own), and nostall's kernels can run there."""
    return x.is_cuda and torch.backends.cudnn.enabled and triton_available(x.device)


class FastDecoder(ExactDecoder):
    """The decoder's ``fast`` mode: exact mode's forward with activations channels last
    (channels adjacent in memory, which is how cuDNN's convolution kernels read them, so
    the per-conv layout transposes go), channels-last copies of the conv weights (made
    here; the user's module is not touched), the norm computed inside the fused kernel
    with the previous conv's bias added on the way in, and, on CUDA, the steady-state
    chunk captured once per video as a CUDA graph and replayed for every later chunk
    (one launch instead of hundreds; the feature cache and working buffer already live
    at fixed addresses in :class:`ExactState`).

    Frames are not bit-identical to ``vae.decode`` (the conv algorithms and the norm's
    summation order differ); the bench reports their PSNR against an fp32 decode. One
    device only."""

    channels_last = True

    def __init__(self, decoder: nn.Module, wan: Any, *, graphs: bool = True):
        super().__init__(decoder, wan)
        self.graphs = graphs
        self._weights: dict[int, torch.Tensor] = {}
        for m in decoder.modules():
            if isinstance(m, nn.Conv3d):
                fmt = torch.channels_last_3d
            elif isinstance(m, nn.Conv2d):
                fmt = torch.channels_last
            else:
                continue
            self._weights[id(m)] = m.weight.detach().contiguous(memory_format=fmt)

    def _weight(self, conv: nn.Module) -> torch.Tensor:
        return self._weights.get(id(conv), conv.weight)

    def forward(self, x: torch.Tensor, state: ExactState, *, first: bool) -> torch.Tensor:
        # cuDNN's heuristics give the 96-channel 720p convs a Hopper-less kernel; letting
        # it time its algorithms (once per shape per process, in the first chunks, before
        # any capture) is part of what fast trades for not being bit-identical.
        # (Only this flag: cudnn.flags() would reset the others, TF32 among them.)
        cudnn = torch.backends.cudnn
        before = cudnn.benchmark
        cudnn.benchmark = True
        try:
            return self._forward(x, state, first=first)
        finally:
            cudnn.benchmark = before

    def _forward(self, x: torch.Tensor, state: ExactState, *, first: bool) -> torch.Tensor:
        if not (self.graphs and x.is_cuda) or first:
            return self._eager(x, state, first=first)
        key = (tuple(x.shape), x.dtype, x.device)
        if state.warm != key:
            # The first chunk of this shape runs as is: Triton compiles, cuDNN picks its
            # algorithms, and the buffers reach their steady size before a capture.
            state.warm, state.graph = key, None
            return self._eager(x, state, first=False)
        if state.graph is None:
            static_in = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._eager(static_in, state, first=False)
            state.graph = (graph, static_in, static_out)
        graph, static_in, static_out = state.graph
        static_in.copy_(x)
        graph.replay()
        # Read by the caller (unpatchify, clamp) on this stream before the next replay.
        return static_out

    def _eager(self, x: torch.Tensor, state: ExactState, *, first: bool) -> torch.Tensor:
        return super().forward(
            x.contiguous(memory_format=torch.channels_last_3d), state, first=first
        )

    def _resblock(self, r: nn.Module, x: torch.Tensor, state: ExactState) -> torch.Tensor:
        if isinstance(r.conv_shortcut, nn.Conv3d):
            h = self._causal(r.conv_shortcut, x, state)
        else:
            h = r.conv_shortcut(x)
        y = self._norm_silu_conv(r.norm1, r.conv1, x, state, bias=False)
        y = self._norm_silu_conv(r.norm2, r.conv2, y, state, bias=False, pending=r.conv1.bias)
        return bias_residual(y, r.conv2.bias, h)

    def _norm_silu_conv(
        self,
        norm: nn.Module,
        conv: nn.Module,
        x: torch.Tensor,
        state: ExactState,
        *,
        bias: bool = True,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``pending``: the bias of the conv that made ``x``, not yet added."""
        if not x.is_contiguous(memory_format=torch.channels_last_3d):
            x = x.contiguous(memory_format=torch.channels_last_3d)

        def fill(dst: torch.Tensor) -> None:
            rms_silu_cl_into(x, norm.gamma, norm.scale, dst, pending)

        return self._causal(conv, x, state, fill, bias=bias)

    def _resample(self, m: nn.Module, x: torch.Tensor, state: ExactState) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if m.mode == "upsample3d" and id(m) in state.started:
            y = self._causal(m.time_conv, x, state)  # (b, 2c, t, h, w), channels last
            # frame 2i + k is half k of y's channels at time i, laid out channels last
            frames = x.new_empty(b, t, 2, h, w, c)
            frames.copy_(y.view(b, 2, c, t, h, w).permute(0, 3, 1, 4, 5, 2))
            t *= 2
            frames = frames.view(b * t, h, w, c).permute(0, 3, 1, 2)
        else:
            if m.mode == "upsample3d":
                state.started.add(id(m))
            frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
            frames = frames.contiguous(memory_format=torch.channels_last)
        up, conv = m.resample[0], m.resample[1]
        doubled = upsample2x_cl(frames) if _nearest_2x(up) else None
        if doubled is None:
            doubled = F.interpolate(
                frames,
                size=up.size,
                scale_factor=up.scale_factor,
                mode=up.mode,
                align_corners=up.align_corners,
                recompute_scale_factor=up.recompute_scale_factor,
            )
        frames = self._conv2d(conv, doubled)
        return frames.view(b, t, *frames.shape[1:]).permute(0, 2, 1, 3, 4)


def _nearest_2x(up: nn.Module) -> bool:
    """Whether ``up`` (an ``nn.Upsample``) doubles each side by nearest neighbour."""
    factor = up.scale_factor
    if isinstance(factor, (tuple, list)):
        factor = tuple(float(f) for f in factor)
    two = factor in (2.0, (2.0, 2.0))
    return up.size is None and two and up.mode in ("nearest", "nearest-exact")
