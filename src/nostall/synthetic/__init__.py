"""Synthetic stores and checkpoints: random-weight diffusers pipelines, laid out exactly as
``save_pretrained`` writes them, to try nostall on without downloading anything.

* :func:`write_store`: pipeline folders (FLUX, FLUX-b, SDXL, SD3, Wan) at ``tiny`` size (a
  few MB, built as real pipelines on the CPU in seconds: the demo's, the tests' and CI's
  store) or ``full`` size (FLUX.1-dev 33.98 GB, SDXL 6.94 GB; drawn on a GPU when there is
  one: the benchmarks' store). ``nostall synthetic DIR --size tiny`` writes one from the shell.
* :func:`make_checkpoint`: one random ``FluxTransformer2DModel`` component folder.
* :func:`write_transformer` and :func:`step_inputs`: a FLUX transformer and one denoising
  step's inputs for it.
* :func:`denoise`: a short denoising run, latents out.

>>> import nostall.synthetic, tempfile
>>> folders = nostall.synthetic.write_store(tempfile.mkdtemp(), ("sdxl",))  # doctest: +SKIP
"""

from nostall.synthetic.checkpoints import PRESETS, make_checkpoint
from nostall.synthetic.loras import write_lora
from nostall.synthetic.run import denoise
from nostall.synthetic.tiny import PIPELINES, VIDEO_PIPELINES, write_store
from nostall.synthetic.transformer import safetensors_bytes, step_inputs, write_transformer

__all__ = [
    "PIPELINES",
    "PRESETS",
    "VIDEO_PIPELINES",
    "denoise",
    "make_checkpoint",
    "safetensors_bytes",
    "step_inputs",
    "write_lora",
    "write_store",
    "write_transformer",
]
