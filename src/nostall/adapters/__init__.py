"""Adapters attached to cached pipelines per request: LoRAs fused into resident weights
(the base restored bit for bit), read in the formats diffusers converts."""

from nostall.adapters.fuse import Fusions
from nostall.adapters.lora import Lora, LoraLayer, check_fits, read_lora
from nostall.adapters.shelf import Shelf, lora_bytes, lora_weights

__all__ = [
    "Fusions",
    "Lora",
    "LoraLayer",
    "Shelf",
    "check_fits",
    "lora_bytes",
    "lora_weights",
    "read_lora",
]
