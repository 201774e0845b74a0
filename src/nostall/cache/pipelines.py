"""Real diffusers pipeline objects around the cache's modules.

``DiffusionPipeline.from_pretrained`` loads every component anew. Here the weights
components are the cache's persistent modules; tokenizers, image processors and the
like are loaded from their folders once per content digest and copied into each
pipeline object (fast tokenizers keep per-call settings); schedulers, which keep
per-run state, are built per pipeline object from a cached config. The pipeline is constructed exactly as diffusers does:
the index's components by keyword, its other keys (``force_zeros_for_empty_prompt``)
as pipeline options, and ``_name_or_path`` registered.

Each pipeline object is an instance of a subclass of the folder's pipeline class that
adds one check to ``__call__``: a pipeline whose components were switched out since
(evicted, or a shared module now holding another checkpoint's weights) raises
:class:`~nostall.ClosedError` instead of computing with the wrong weights. A two-expert
pipeline's ``use()`` block also routes each call through its
:class:`~nostall.cache.experts.Experts` (the attribute ``nostall_experts``), which
switches the second expert in at the boundary step.

Pipeline objects carry per-run state (the scheduler's timesteps), so :class:`Pipelines`
lends each ``use()`` block one that no other block is using, and keeps them for reuse.
"""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nostall.cache.holds import Hold
from nostall.cache.modules import Instance
from nostall.errors import CheckpointError, ClosedError, UnsupportedError
from nostall.store.catalog import ComponentEntry, PipelineEntry

__all__ = ["Assembler", "Pipelines"]


@dataclass(eq=False)
class _Kept:
    pipe: Any
    modules: tuple[tuple[int, str], ...]  # (module identity, digest of its weights) per role
    hold: Hold | None = None  # the use() block it is lent to (None: free)


class Pipelines:
    """Pipeline objects kept for reuse, per pipeline, roles left out and module set;
    the owner (the cache) locks."""

    def __init__(self) -> None:
        self.assembler = Assembler()
        self._kept: dict[tuple[str, frozenset[str]], list[_Kept]] = {}

    def get(
        self,
        entry: PipelineEntry,
        expect: dict[str, tuple[Instance, str]],
        without: frozenset[str],
        hold: Hold | None,
        *,
        closed: Callable[[], bool],
        stream: Callable[[], Any],
    ) -> Any:
        """A pipeline of ``entry`` over the modules of ``expect`` (role → the instance
        and the digest of the weights it holds now) that no ``use()`` block has; lent to
        ``hold`` if given. ``closed()`` says whether the cache is closed; ``stream()`` is
        the calling thread's current CUDA stream (``None`` on a CPU)."""
        # Same modules holding other weights (a file rewritten, copied in place) are
        # another pipeline: the old one's check refuses those weights.
        ident = tuple((id(inst.module), digest) for inst, digest in expect.values())
        key = (entry.name, without)
        kept = [k for k in self._kept.get(key, []) if k.modules == ident]
        for k in kept:
            if k.hold is None or not k.hold.open:
                k.hold = hold
                return k.pipe
        new = _Kept(None, ident, hold)

        def check() -> None:
            _check(entry.name, expect, new.hold, closed(), stream())

        modules = {role: inst.module for role, (inst, _) in expect.items()}
        new.pipe = self.assembler.build(entry, modules, check, without)
        self._kept[key] = [*kept, new]
        return new.pipe

    def give_back(self, hold: Hold) -> None:
        """The block holding ``hold`` ended: its pipeline may be lent again."""
        for kept in self._kept.values():
            for k in kept:
                if k.hold is hold:
                    k.hold = None

    def clear(self) -> None:
        self._kept.clear()


class Assembler:
    """Files components (cached by digest) and pipeline classes (with the call check)."""

    def __init__(self) -> None:
        self._files: dict[str, Any] = {}
        self._scheduler_configs: dict[str, tuple[type, dict]] = {}
        self._guarded: dict[type, type] = {}

    def files_component(self, c: ComponentEntry) -> Any:
        cls = _import(c.library, c.class_name, c.folder)
        if _is_scheduler(cls):
            cached = self._scheduler_configs.get(c.digest)
            if cached is None:
                try:
                    config = cls.load_config(c.folder)
                except Exception as e:
                    raise CheckpointError(
                        f"cannot read the scheduler config: {e}", path=c.folder
                    ) from e
                cached = self._scheduler_configs[c.digest] = (cls, config)
            return cached[0].from_config(cached[1])  # per-run state: one per pipeline object
        obj = self._files.get(c.digest)
        if obj is None:
            obj = self._files[c.digest] = _load_files(cls, c)
        # Each pipeline object gets its own copy: fast tokenizers change their padding and
        # truncation settings on every call, so one shared by two pipelines running in two
        # threads returns mixed-up shapes.
        return copy.deepcopy(obj)

    def build(
        self,
        entry: PipelineEntry,
        modules: dict[str, Any],
        check: Callable[[], None],
        without: frozenset[str] = frozenset(),
    ) -> Any:
        """The pipeline of ``entry`` with ``modules`` (role → module) as its weights and
        ``None`` for the roles in ``without``."""
        base = _import("diffusers", entry.class_name, entry.folder)
        cls = self._guarded_class(base)
        expected, optional = base._get_signature_keys(base)
        optional_components = set(getattr(base, "_optional_components", []) or [])
        init_dict, _, _ = base.extract_init_dict(dict(entry.config))
        kwargs: dict[str, Any] = {
            k: init_dict[k] for k in optional if k in init_dict and k not in optional_components
        }
        for role in expected:
            if role in without:
                kwargs[role] = None
            elif role in modules:
                kwargs[role] = modules[role]
            elif role in entry.components:
                c = entry.components[role]
                kwargs[role] = None if c is None else self.files_component(c)
            elif role in optional_components or role in optional:
                kwargs.setdefault(role, None)
            else:
                raise CheckpointError(
                    f"{entry.class_name} needs component {role!r}, which model_index.json does "
                    "not list; the pipeline folder is incomplete",
                    path=os.path.join(entry.folder, "model_index.json"),
                )
        try:
            pipe = cls(**kwargs)
        except Exception as e:
            raise CheckpointError(
                f"{entry.class_name}(...) refused the components: {type(e).__name__}: {e}",
                path=entry.folder,
            ) from e
        pipe.register_to_config(_name_or_path=entry.folder)
        # A plain attribute (not a registered module): DiffusionPipeline.__setattr__
        # only records modules and config values.
        object.__setattr__(pipe, "_nostall_check", check)
        return pipe

    def _guarded_class(self, base: type) -> type:
        cls = self._guarded.get(base)
        if cls is None:

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                experts = self.__dict__.get("nostall_experts")
                if experts is not None:  # two experts: the first in, the boundary's switch
                    kwargs, args = experts.call_kwargs(args, kwargs), ()
                check = getattr(self, "_nostall_check", None)
                if check is not None:
                    check()
                return base.__call__(self, *args, **kwargs)

            __call__.__doc__ = base.__call__.__doc__
            cls = type(
                base.__name__,
                (base,),
                {"__call__": __call__, "__module__": base.__module__, "__doc__": base.__doc__},
            )
            self._guarded[base] = cls
        return cls


def _check(
    name: str,
    expect: dict[str, tuple[Instance, str]],
    hold: Hold | None,
    closed: bool,
    stream: Any,
) -> None:
    """Before each call of pipeline ``name``: refuse weights switched out since it was
    handed out; order a stream new to its ``use()`` block after the copies."""
    if closed:
        raise ClosedError(f"the model cache is closed; pipeline {name!r} is gone")
    for role, (inst, digest) in expect.items():
        if inst.digest != digest or inst.slot is None or not inst.slot.ready:
            raise ClosedError(
                f"pipeline {name!r} was switched out: its {role} now holds other weights or "
                f"left the device; get it again with cache.pipeline({name!r}), or hold it "
                f"with `with cache.use({name!r})`"
            )
    if hold is not None and hold.note(stream):
        # A stream new to this block (another thread's, or a side stream) must not read
        # the weights before their copies have ended.
        for inst, _ in expect.values():
            if inst.slot.done is not None:
                stream.wait_event(inst.slot.done)


def _load_files(cls: type, c: ComponentEntry) -> Any:
    try:
        return cls.from_pretrained(c.folder, local_files_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot load component {c.role!r} ({c.library}.{c.class_name}) from its "
            f"folder: {type(e).__name__}: {e}",
            path=c.folder,
        ) from e


def _import(library: str, name: str, where: str) -> type:
    try:
        lib = importlib.import_module(library)
    except ImportError as e:
        raise UnsupportedError(
            f"{where}: needs {library}.{name}, but {library} is not importable ({e}); "
            f"pip install {library}"
        ) from e
    obj = getattr(lib, name, None)
    if not isinstance(obj, type):
        version = getattr(lib, "__version__", "?")
        raise UnsupportedError(
            f"{where}: {library} {version} has no class {name!r}; the folder may need a newer "
            f"{library}, or custom code, which nostall does not run"
        )
    return obj


def _is_scheduler(cls: type) -> bool:
    try:
        from diffusers import SchedulerMixin
    except ImportError:
        return False
    return issubclass(cls, SchedulerMixin)
