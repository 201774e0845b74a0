"""Construct modules whose parameters live on the ``meta`` device.

A parameter registered while :func:`empty_parameters` is active is replaced by a
meta tensor of the same shape and dtype, so the ``reset_parameters`` calls that
follow in ``__init__`` (Kaiming init for every Linear, ...) do no arithmetic
and the weights take no memory. Buffers are left alone: rotary tables,
``position_ids`` and similar values computed in ``__init__`` keep their real
values on the CPU, because no checkpoint carries the non-persistent ones.

This is the approach of accelerate's ``init_empty_weights(include_buffers=False)``,
written out here so nostall does not depend on accelerate.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn as nn

from nostall.assemble.resolve import config_path, library_of, read_config
from nostall.errors import CheckpointError

__all__ = ["build_empty", "empty_parameters", "gc_paused"]

M = TypeVar("M", bound=nn.Module)

# Serialises the class-level patch (and torch.set_default_dtype, which is
# process-wide) across threads. Re-entrant so a model whose __init__ itself
# builds an empty sub-model does not deadlock.
_PATCH_LOCK = threading.RLock()


# The in-place initialisers reset_parameters() calls. On a meta tensor they are
# no-ops in effect but not in cost: each one runs torch's Python decomposition
# (about 35 ms of FLUX's 80 ms construction).
_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


def _skip_on_meta(init: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # Decides by the tensor, not the thread: skipping init of a meta tensor is
    # correct for every caller, so a copy of this wrapper that outlives the
    # context (a library importing torch.nn.init names meanwhile) does no harm.
    @functools.wraps(init)
    def skip(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tensor.is_meta:
            return tensor
        return init(tensor, *args, **kwargs)

    return skip


def _to_meta(param: nn.Parameter) -> nn.Parameter:
    # empty_like makes the same meta tensor as detach().to("meta") (dtype, shape, strides,
    # no grad) in half the time: 6 ms instead of 11 over FLUX's 1160 parameters. Other
    # Parameter classes keep the call they may override.
    if type(param) is nn.Parameter:
        meta = torch.empty_like(param, device="meta")
    else:
        meta = param.detach().to("meta")
    try:
        new = type(param)(meta, requires_grad=param.requires_grad)
    except (TypeError, RuntimeError):
        # A Parameter subclass with another constructor: keep it real rather
        # than guess; adopt() replaces it all the same.
        return param
    # Libraries tag parameters with attributes (sharding hints, ...); they must
    # survive the move.
    new.__dict__.update(param.__dict__)
    # transformers' init helpers skip tensors carrying this flag. Without it,
    # post_init() runs torch's Python decomposition of normal_ on every meta
    # parameter: 90 % of a 110 ms T5-XXL build. Buffers stay unflagged, so
    # _init_weights still computes the non-persistent ones (position_ids).
    new._is_hf_initialized = True
    return new


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Within the block, parameters registered **by this thread** go to ``meta``.

    Patches ``nn.Module.register_parameter`` for the duration (restored on
    exit, exception included). Other threads keep constructing normal modules
    while the patch is active, because the patched method checks the calling
    thread; two threads entering the context at once are serialised by a lock.
    ``torch.nn.init`` functions return at once when given a meta tensor (for
    any thread), which halves the construction time of Linear-heavy models.
    Parameters that are already on ``meta`` are registered as they are, so ties
    made during construction (the same ``Parameter`` object under two names)
    survive.

    Tensors created in ``__init__`` before registration (``nn.Parameter(torch.randn(n))``)
    are still computed once and then dropped; for ``nn.Linear`` and friends the
    cost is an uninitialised allocation, which the OS hands out lazily.

    Example::

        >>> with empty_parameters():
        ...     layer = nn.Linear(4096, 4096)
        >>> layer.weight.device
        device(type='meta')
    """
    with _PATCH_LOCK:
        original = nn.Module.register_parameter
        owner = threading.get_ident()

        def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta and threading.get_ident() == owner:
                param = _to_meta(param)
            original(self, name, param)

        inits = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        try:
            for name, init in inits.items():
                setattr(nn.init, name, _skip_on_meta(init))
            yield
        finally:
            for name, init in inits.items():
                setattr(nn.init, name, init)
            nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Within the block, the cyclic garbage collector does not run (process-wide).

    For work that allocates many container objects, none of them garbage yet: building
    a module, reading headers, adopting tensors (``load_model`` pauses those, not its
    reads). Constructing ~1000 modules triggers several collections, now and then a
    full one: ~190 ms with diffusers and transformers imported, four times the
    construction. Paused, the passes fold into one, run by the first allocation after
    the block, and fewer objects live long enough to be promoted, which is what brings
    on the full collections: loading FLUX in FP8 21 times on a 2-core machine ran 3 full
    collections of ~300 ms without the pauses and 1 with them. A service that calls
    ``gc.freeze()`` after its imports makes the full collections cheap too. Nested or
    concurrent blocks leave the collector as the outermost found it.

    Example::

        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _move_stray_parameters(module: nn.Module) -> None:
    # Code that writes module._parameters directly bypasses the patch; the
    # values are already computed, but keeping every parameter on meta makes
    # "still on meta" mean "not adopted" without exceptions.
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and not param.is_meta:
                sub._parameters[name] = _to_meta(param)


def _build_diffusers(cls: type[M], config: dict[str, Any], folder: Path | None) -> M:
    module = cls.from_config(config)  # type: ignore[attr-defined]
    if folder is not None:
        # from_pretrained records this; pipelines and save_pretrained read it.
        module.register_to_config(_name_or_path=os.fspath(folder))
    return module


def _build_transformers(
    cls: type[M], config: dict[str, Any], folder: Path | None, dtype: torch.dtype | None
) -> M:
    config_cls = cls.config_class  # type: ignore[attr-defined]
    if folder is None:
        hf_config = config_cls.from_dict(config)
    else:
        # from_pretrained, not from_dict: a sub-model class (CLIPTextModel) can
        # then read its part of a composite config (CLIPConfig.text_config).
        hf_config = config_cls.from_pretrained(config_path(folder), local_files_only=True)
    kwargs = {} if dtype is None else {"dtype": dtype}
    # _from_config, not cls(config): it applies config.dtype as the default
    # dtype (as from_pretrained's dtype="auto" does) and transformers' patches.
    # post_init() then runs _init_weights, which skips the flagged meta
    # parameters and gives non-persistent buffers their values.
    return cls._from_config(hf_config, **kwargs)  # type: ignore[attr-defined]


def build_empty(
    cls: type[M],
    config: Mapping[str, Any] | str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
) -> M:
    """Construct ``cls`` with every parameter on ``meta`` and real buffers on the CPU.

    ``config`` is a checkpoint folder (its ``config.json`` is read) or the
    config as a dict. diffusers classes are built with ``cls.from_config``,
    transformers classes with ``cls._from_config(config_class.from_pretrained(folder))``,
    any other ``nn.Module`` with ``cls(**config)``.

    ``dtype`` is made the default dtype during construction, exactly as
    ``from_pretrained(torch_dtype=...)`` does, so buffers computed in ``__init__``
    get the dtype they would get there. The meta parameters' dtype does not
    matter: :func:`~nostall.assemble.adopt` replaces them with the checkpoint
    tensors as they are. ``None`` keeps torch's default for diffusers and uses
    ``config.dtype`` for transformers (what their ``from_pretrained`` does).

    Process-wide effects while it runs: the cyclic garbage collector is paused
    (a collection would find nothing and cost more than the construction), and,
    if ``dtype`` is given, the default dtype is set, which other threads creating
    floating-point tensors without an explicit dtype would see.

    Raises :class:`~nostall.errors.CheckpointError` if the folder has no usable
    config or the config does not construct the class.

    Example (a one-layer T5 from a config dict; a checkpoint folder such as
    ``/models/flux/transformer`` with ``resolve_model_class(folder)`` works the same)::

        >>> from transformers import T5EncoderModel
        >>> config = {"vocab_size": 32, "d_model": 8, "d_kv": 4, "d_ff": 16, "num_layers": 1, "num_heads": 2}
        >>> module = build_empty(T5EncoderModel, config, dtype=torch.bfloat16)
        >>> {p.device.type for p in module.parameters()}
        {'meta'}
    """
    folder = None if isinstance(config, Mapping) else Path(config)
    # Read (and fail on a bad file) before taking the lock and patching torch.
    config_dict = dict(config) if isinstance(config, Mapping) else read_config(config)
    library = library_of(cls)
    with _PATCH_LOCK, gc_paused(), _default_dtype(dtype), empty_parameters():
        try:
            if library == "diffusers":
                module = _build_diffusers(cls, config_dict, folder)
            elif library == "transformers":
                module = _build_transformers(cls, config_dict, folder, dtype)
            else:
                module = cls(**config_dict)
        except Exception as exc:
            raise CheckpointError(
                f"config does not construct {cls.__name__}: {type(exc).__name__}: {exc}; "
                "is this config from the same model family as the class?",
                path=None if folder is None else config_path(folder),
            ) from exc
    _move_stray_parameters(module)
    return module
