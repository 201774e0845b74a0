"""Read latents saved by a pipeline run (``output_type="latent"``) from disk."""

from __future__ import annotations

import os

import numpy as np
import torch

from nostall.errors import LatentsError

__all__ = ["load_latents"]


def load_latents(path: str | os.PathLike) -> torch.Tensor:
    """Latents from a ``.safetensors`` (the tensor ``latents``, or its only tensor),
    a ``.pt`` (a tensor, loaded with ``weights_only=True``) or a ``.npy`` file.

    >>> z = load_latents("latents.safetensors")  # doctest: +SKIP
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LatentsError(f"{path}: no such latents file")
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(path)
            if "latents" in tensors:
                return tensors["latents"]
            if len(tensors) == 1:
                return next(iter(tensors.values()))
            raise LatentsError(
                f"{path}: holds {sorted(tensors)}; name the latents tensor 'latents'"
            )
        if suffix == ".pt":
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(obj, dict) and "latents" in obj:
                obj = obj["latents"]
            if not isinstance(obj, torch.Tensor):
                raise LatentsError(f"{path}: holds a {type(obj).__name__}, not a tensor")
            return obj
        if suffix == ".npy":
            return torch.from_numpy(np.load(path))
    except LatentsError:
        raise
    except Exception as e:
        raise LatentsError(f"{path}: cannot read latents: {e}") from e
    raise LatentsError(f"{path}: unknown latents format {suffix!r}; use .safetensors, .pt or .npy")
