"""Find the module class a checkpoint folder was saved from.

A diffusers folder's ``config.json`` names its class in ``_class_name``; a
transformers folder names it in ``architectures[0]``. The libraries are imported
lazily: importing diffusers costs seconds, and a process that only ever loads
transformers models should not pay for it.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Literal

import torch.nn as nn

from nostall.errors import CheckpointError
from nostall.store.files import open_regular, parse_json

__all__ = ["Library", "config_path", "library_of", "read_config", "resolve_model_class"]

Library = Literal["diffusers", "transformers", "torch"]

CONFIG_NAME = "config.json"


def config_path(folder: str | os.PathLike) -> Path:
    """Return the ``config.json`` inside ``folder`` (or ``folder`` itself if it is a JSON file).

    Example::

        >>> config_path("/models/flux/transformer")
        PosixPath('/models/flux/transformer/config.json')
    """
    path = Path(folder)
    if path.suffix == ".json" and not path.is_dir():
        return path
    return path / CONFIG_NAME


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """Parse a checkpoint folder's ``config.json`` into a dict.

    Raises :class:`~nostall.errors.CheckpointError` naming the file when it is
    missing, unreadable, not a regular file (a FIFO or a device is never opened),
    not JSON, or not a JSON object.

    Example (a folder holding only a config, written here)::

        >>> import json, os, tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with open(os.path.join(tmp.name, "config.json"), "w") as f:
        ...     json.dump({"_class_name": "FluxTransformer2DModel", "num_layers": 1}, f)
        >>> read_config(tmp.name)["_class_name"]
        'FluxTransformer2DModel'
        >>> tmp.cleanup()
    """
    path = config_path(folder)
    try:
        with open_regular(os.fspath(path), what="config") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            "no config.json here; pass the model's own folder (e.g. 'transformer/' or "
            "'text_encoder/' inside a pipeline), not the pipeline root",
            path=path,
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read config: {exc}", path=path) from exc
    config = parse_json(
        raw,
        what="config",
        fix="download the model folder again, or re-save it with save_pretrained()",
        path=os.fspath(path),
    )
    if not isinstance(config, dict):
        raise CheckpointError(
            f"config must be a JSON object, found {type(config).__name__}", path=path
        )
    return config


def _lookup(library: str, name: str, path: Path) -> type[nn.Module]:
    try:
        lib = importlib.import_module(library)
    except ImportError as exc:
        raise CheckpointError(
            f"config names {library} class {name!r} but {library} is not importable ({exc}); "
            f"install it with `pip install {library}`",
            path=path,
        ) from exc
    try:
        cls = getattr(lib, name)
    except (AttributeError, ImportError, RuntimeError):
        # diffusers and transformers resolve names lazily; a missing optional
        # dependency of one model surfaces here as ImportError/RuntimeError.
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        version = getattr(lib, "__version__", "?")
        raise CheckpointError(
            f"{library} {version} has no model class {name!r}; the checkpoint may need a "
            f"newer {library}, or it uses custom code, which nostall does not run",
            path=path,
        )
    return cls


def resolve_model_class(folder: str | os.PathLike) -> type[nn.Module]:
    """Return the diffusers or transformers class that ``folder/config.json`` names.

    diffusers configs carry ``_class_name``; transformers configs carry
    ``architectures`` (the first entry is used). Raises
    :class:`~nostall.errors.CheckpointError` naming the file if the config is
    missing, unreadable, names neither, or names a class the installed library
    lacks.

    Example (two folders holding only a config, written here)::

        >>> import json, os, tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> for name, config in (
        ...     ("transformer", {"_class_name": "FluxTransformer2DModel"}),
        ...     ("text_encoder_2", {"architectures": ["T5EncoderModel"]}),
        ... ):
        ...     os.mkdir(os.path.join(tmp.name, name))
        ...     with open(os.path.join(tmp.name, name, "config.json"), "w") as f:
        ...         json.dump(config, f)
        >>> resolve_model_class(os.path.join(tmp.name, "transformer"))
        <class 'diffusers.models.transformers.transformer_flux.FluxTransformer2DModel'>
        >>> resolve_model_class(os.path.join(tmp.name, "text_encoder_2"))
        <class 'transformers.models.t5.modeling_t5.T5EncoderModel'>
        >>> tmp.cleanup()
    """
    path = config_path(folder)
    config = read_config(folder)
    name = config.get("_class_name")
    if name is not None:
        if not isinstance(name, str):
            raise CheckpointError(f"'_class_name' must be a string, found {name!r}", path=path)
        return _lookup("diffusers", name, path)
    architectures = config.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise CheckpointError(
                f"'architectures' must be a list of class names, found {architectures!r}",
                path=path,
            )
        return _lookup("transformers", architectures[0], path)
    raise CheckpointError(
        "config names no model class (neither diffusers '_class_name' nor transformers "
        "'architectures'); is this a model folder, and not a scheduler or tokenizer folder?",
        path=path,
    )


def library_of(cls: type[nn.Module]) -> Library:
    """Tell which library's construction conventions ``cls`` follows.

    Checked by base class, not by module name, so subclasses defined outside
    the libraries are recognised too. Only already-imported libraries are
    consulted: a class cannot derive from a library that was never imported.

    Example::

        >>> import torch
        >>> from transformers import T5EncoderModel
        >>> library_of(T5EncoderModel), library_of(torch.nn.Linear)
        ('transformers', 'torch')
    """
    transformers = sys.modules.get("transformers")
    if transformers is not None and issubclass(cls, transformers.PreTrainedModel):
        return "transformers"
    diffusers = sys.modules.get("diffusers")
    if diffusers is not None:
        # ConfigMixin rather than ModelMixin: it is what provides from_config.
        config_mixin = importlib.import_module("diffusers.configuration_utils").ConfigMixin
        if issubclass(cls, config_mixin):
            return "diffusers"
    return "torch"
