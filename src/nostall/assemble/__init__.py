"""Skip-init assembly: build a module without initialising it, then adopt loaded tensors.

Building a FLUX-size diffusers module the ordinary way spends seconds in
``reset_parameters`` (an init the checkpoint overwrites anyway) and holds the
weights twice. Here the module is built with its parameters on ``meta`` and
its buffers real, then the already-loaded tensors (possibly views into one flat
device buffer) become its parameters without a copy::

    from safetensors.torch import load_file
    from nostall.assemble import adopt, build_empty, resolve_model_class

    folder = "/models/flux/transformer"
    tensors = load_file(f"{folder}/diffusion_pytorch_model.safetensors", device="cuda")
    model = adopt(build_empty(resolve_model_class(folder), folder), tensors, path=folder)
"""

from __future__ import annotations

from nostall.assemble.adopt import adopt
from nostall.assemble.dtypes import as_stored_dtypes, target_dtypes
from nostall.assemble.meta import build_empty, empty_parameters, gc_paused
from nostall.assemble.resolve import read_config, resolve_model_class

__all__ = [
    "adopt",
    "as_stored_dtypes",
    "build_empty",
    "empty_parameters",
    "gc_paused",
    "read_config",
    "resolve_model_class",
    "target_dtypes",
]
