"""FP8 checkpoints: convert (``quantize``) and the scheme they follow (:mod:`.fp8`)."""

from nostall.quant.convert import QuantizeReport, quantize

__all__ = ["QuantizeReport", "quantize"]
