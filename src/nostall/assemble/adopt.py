"""Make already-loaded tensors a module's parameters and buffers, without copying.

The tensors may be views into one flat device buffer; they become the
module's storage as they are (same ``data_ptr``), in their own dtype. All
checks run before the module is touched, so a failed :func:`adopt` leaves the
module as it was.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from nostall.errors import ArgumentError, ModelMismatchError

__all__ = ["adopt"]

# Names shown per category in an error message; the exception keeps them all.
_SHOWN = 12


@dataclass(frozen=True)
class _Slot:
    owner: nn.Module
    attr: str
    tensor: torch.Tensor


@dataclass
class _Layout:
    params: dict[str, _Slot]
    persistent: dict[str, _Slot]
    transient: dict[str, _Slot]  # non-persistent buffers: never in a checkpoint


def _layout(module: nn.Module) -> _Layout:
    # remove_duplicate=False: a submodule shared under two names (module-level
    # tying) must be reachable under both, like state_dict() does.
    layout = _Layout({}, {}, {})
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, param in sub._parameters.items():
            if param is not None:
                layout.params[dot + attr] = _Slot(sub, attr, param)
        transient_names = sub._non_persistent_buffers_set
        for attr, buf in sub._buffers.items():
            if buf is not None:
                target = layout.transient if attr in transient_names else layout.persistent
                target[dot + attr] = _Slot(sub, attr, buf)
    return layout


def _patterns(module: nn.Module, attr: str) -> re.Pattern[str] | None:
    # transformers (both major versions) and diffusers declare regexes of keys
    # their from_pretrained stays quiet about, e.g. T5EncoderModel: r"decoder".
    # Read from the instance dict or the class: Module.__getattr__ is slow.
    found: list[str] = []
    for sub in module.modules():
        value = sub.__dict__.get(attr)
        if value is None:
            value = getattr(type(sub), attr, None)
        found.extend(value or ())
    unique = sorted(set(found))
    # re.compile keeps its own cache, so repeated loads do not recompile.
    return re.compile("|".join(f"(?:{p})" for p in unique)) if unique else None


def _classify(
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, _Slot],
    transient: Mapping[str, _Slot],
) -> tuple[dict[str, torch.Tensor], list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    adopted: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{key!r}] is a {type(value).__name__}, not a tensor")
        slot = expected.get(key)
        if slot is None:
            # A non-persistent buffer's value computed in __init__ is
            # authoritative; old checkpoints (CLIP's position_ids) still carry one.
            if key not in transient:
                unexpected.append(key)
        elif value.shape != slot.tensor.shape:
            mismatched.append((key, tuple(value.shape), tuple(slot.tensor.shape)))
        else:
            adopted[key] = value
    return adopted, unexpected, mismatched


class _Groups:
    """Union-find over tensor names that must end up as one tensor (ties)."""

    def __init__(self, names: Iterable[str]):
        self._parent = {name: name for name in names}

    def find(self, name: str) -> str:
        parent = self._parent
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def union(self, a: str, b: str) -> None:
        if a in self._parent and b in self._parent:
            self._parent[self.find(b)] = self.find(a)


def _tie_groups(module: nn.Module, expected: Mapping[str, _Slot]) -> _Groups:
    groups = _Groups(expected)
    # Ties made at construction (transformers' post_init ties; a Parameter
    # assigned to two modules) show up as one tensor object under two names.
    first: dict[int, str] = {}
    for name, slot in expected.items():
        other = first.setdefault(id(slot.tensor), name)
        if other != name:
            groups.union(other, name)
    # Ties transformers 5 declares but construction may have skipped (a model
    # built under transformers' no_tie_weights(), say): {target: source}.
    declared = getattr(module, "all_tied_weights_keys", None)
    if isinstance(declared, Mapping):
        for target, source in declared.items():
            groups.union(source, target)
    return groups


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    # The commonest real-world mismatch: the same tensors under a prefix
    # ("model.diffusion_model.", "transformer.") or without one.
    for have, want, verb in (
        (unexpected, set(missing), "strip"),
        (missing, set(unexpected), "add"),
    ):
        for key in have[:64]:
            parts = key.split(".")
            for cut in range(1, min(len(parts), 4)):
                if ".".join(parts[cut:]) in want:
                    prefix = ".".join(parts[:cut]) + "."
                    if verb == "strip":
                        return f"the checkpoint's keys carry an extra prefix {prefix!r}; strip it"
                    return (
                        f"the module's keys start with {prefix!r}, the checkpoint's do not; add it"
                    )
    return None


def _listing(title: str, items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return f"\n  {title} ({len(items)}): {shown}{more}"


def _mismatch_error(
    module: nn.Module,
    *,
    path: str | os.PathLike | None,
    missing: list[str],
    unexpected: list[str],
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    strict: bool,
) -> ModelMismatchError:
    counts = []
    if missing:
        counts.append(f"{len(missing)} missing")
    if unexpected:
        counts.append(f"{len(unexpected)} unexpected")
    if mismatched:
        counts.append(f"{len(mismatched)} with another shape")
    message = f"checkpoint does not fit {type(module).__name__}: {', '.join(counts)}"
    if missing:
        message += _listing("missing from the checkpoint", missing)
    if unexpected:
        message += _listing("in the checkpoint but not in the module", unexpected)
    if mismatched:
        message += _listing(
            "shape differs",
            [f"{name} checkpoint {tuple(a)} vs module {tuple(b)}" for name, a, b in mismatched],
        )
    hints = []
    prefix = _prefix_hint(missing, unexpected)
    if prefix:
        hints.append(prefix)
    if mismatched or missing:
        hints.append(
            "check that config.json belongs to these weights (same model and variant, "
            "e.g. FLUX.1-dev vs a distilled or LoRA-merged variant, SD 1.5 vs SD 2.x) and that "
            "the weights are in diffusers/transformers layout, not an original single-file "
            "checkpoint"
        )
    if strict and unexpected and not mismatched and not missing:
        hints.append("pass strict=False to ignore tensors the module does not use")
    if hints:
        message += "\n  hint: " + "; ".join(hints)
    return ModelMismatchError(
        message, path=path, missing=missing, unexpected=unexpected, mismatched=mismatched
    )


def _buffer_device(
    adopted: Mapping[str, torch.Tensor], device: torch.device | str | None
) -> torch.device | None:
    if device is not None:
        return torch.device(device)
    devices = {t.device for t in adopted.values()}
    if len(devices) > 1:
        raise ArgumentError(
            f"adopted tensors are on several devices ({', '.join(sorted(map(str, devices)))}); "
            "pass device= to say where the module's computed buffers should go"
        )
    return next(iter(devices), None)


def adopt(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str | None = None,
    strict: bool = True,
    path: str | os.PathLike | None = None,
    requires_grad: bool = False,
) -> nn.Module:
    """Install ``state_dict``'s tensors as ``module``'s parameters and buffers, as-is.

    Meant for a module from :func:`~nostall.assemble.build_empty` (parameters on
    ``meta``, buffers real on the CPU). Each tensor is adopted without a copy
    (``module.get_parameter(name).data_ptr() == state_dict[name].data_ptr()``)
    and keeps its own dtype and device: cast before adopting if needed, see
    :func:`~nostall.assemble.target_dtypes`. Then:

    * ties are restored: names that shared one tensor in the module (T5's
      ``shared.weight`` and ``encoder.embed_tokens.weight``), or that
      transformers declares tied, get the same adopted ``Parameter`` when the
      checkpoint holds only one of them; if it holds several, each is adopted;
    * buffers not adopted (non-persistent ones such as CLIP's ``position_ids``,
      computed in ``__init__``) move to ``device``, by default the device of the
      adopted tensors;
    * the module is put in eval mode.

    Parameters are created with ``requires_grad=False`` unless asked: nostall
    loads for inference, and a frozen parameter cannot start an autograd graph
    by accident. Checkpoint entries naming a non-persistent buffer (old CLIP
    checkpoints carry ``position_ids``) are ignored, as are keys matching the
    module's ``_keys_to_ignore_on_load_unexpected``.

    Every problem is reported at once in one
    :class:`~nostall.errors.ModelMismatchError` (with ``path`` in the message)
    before anything is changed: missing parameters and persistent buffers,
    unexpected keys, and shape mismatches. ``strict=False`` tolerates unexpected
    keys and missing tensors that have a real value (buffers computed in
    ``__init__``), but a parameter or buffer left on ``meta`` is always an
    error: it would be unusable. With :func:`build_empty`, every parameter is
    on ``meta``, so a missing parameter always raises.

    Example (a module built on ``meta`` takes two CPU tensors as they are)::

        >>> import torch
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(4, 2)
        >>> tensors = {"weight": torch.ones(2, 4), "bias": torch.zeros(2)}
        >>> model = adopt(model, tensors)
        >>> model.weight.data_ptr() == tensors["weight"].data_ptr()
        True

    A real checkpoint on the GPU (not run here: it needs the files and CUDA)::

        >>> from nostall.assemble import build_empty, resolve_model_class
        >>> from safetensors.torch import load_file
        >>> folder = "/models/flux/transformer"
        >>> tensors = load_file(f"{folder}/diffusion_pytorch_model.safetensors", device="cuda")  # doctest: +SKIP
        >>> model = adopt(build_empty(resolve_model_class(folder), folder), tensors, path=folder)  # doctest: +SKIP
    """
    layout = _layout(module)
    expected = {**layout.params, **layout.persistent}
    adopted, unexpected, mismatched = _classify(state_dict, expected, layout.transient)
    fix_keys = getattr(module, "_fix_state_dict_keys_on_load", None)
    if unexpected and callable(fix_keys):
        # diffusers renames the attention keys of pre-0.14 VAE/UNet checkpoints
        # (query/key/value/proj_attn -> to_q/to_k/to_v/to_out.0), in place, so
        # on a copy; only worth its tree walk when some keys did not match.
        renamed = dict(state_dict)
        fix_keys(renamed)
        adopted, unexpected, mismatched = _classify(renamed, expected, layout.transient)
    if unexpected:
        ignore = _patterns(module, "_keys_to_ignore_on_load_unexpected")
        if ignore is not None:
            unexpected = [key for key in unexpected if not ignore.search(key)]

    conflicting = {name for name, _, _ in mismatched}
    groups = _tie_groups(module, expected)
    source_of: dict[str, str] = {}
    for key in adopted:
        source_of.setdefault(groups.find(key), key)
    tied: dict[str, str] = {}
    missing: list[str] = []
    ignore_missing: list[re.Pattern[str] | None] = []  # computed on first need
    for key, slot in expected.items():
        if key in adopted or key in conflicting:
            continue
        source = source_of.get(groups.find(key))
        if source is not None:
            tied[key] = source
            continue
        if not slot.tensor.is_meta:
            # A real tensor (a buffer computed in __init__) keeps its value:
            # fine when not strict, and for buffers the module says may be absent.
            if not strict:
                continue
            if key in layout.persistent:
                if key.endswith("num_batches_tracked"):  # torch's BatchNorm leniency
                    continue
                if not ignore_missing:
                    ignore_missing.append(_patterns(module, "_keys_to_ignore_on_load_missing"))
                if ignore_missing[0] is not None and ignore_missing[0].search(key):
                    continue
        missing.append(key)
    missing += [key for key, slot in layout.transient.items() if slot.tensor.is_meta]

    if mismatched or missing or (strict and unexpected):
        raise _mismatch_error(
            module,
            path=path,
            missing=missing,
            unexpected=unexpected,
            mismatched=mismatched,
            strict=strict,
        )

    target = _buffer_device(adopted, device)

    # One Parameter per source tensor, so tied names share the very object.
    made: dict[int, torch.Tensor] = {}

    def install(key: str, value: torch.Tensor) -> None:
        slot = expected[key]
        if key in layout.params:
            param = made.get(id(value))
            if param is None:
                grad = requires_grad and (value.is_floating_point() or value.is_complex())
                if isinstance(value, nn.Parameter):
                    param = value.requires_grad_(grad)
                else:
                    param = nn.Parameter(value, requires_grad=grad)
                made[id(value)] = param
            slot.owner._parameters[slot.attr] = param
        else:
            slot.owner._buffers[slot.attr] = value

    for key, value in adopted.items():
        install(key, value)
    for key, source in tied.items():
        install(key, adopted[source])

    if target is not None:
        moved: dict[int, torch.Tensor] = {}
        for key, slot in (*layout.transient.items(), *layout.persistent.items()):
            if key in adopted or key in tied:
                continue
            buf = moved.get(id(slot.tensor))
            if buf is None:
                buf = moved[id(slot.tensor)] = slot.tensor.to(target)
            slot.owner._buffers[slot.attr] = buf

    return module.eval()
