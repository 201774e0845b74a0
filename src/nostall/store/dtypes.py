"""The dtypes of the safetensors format and their torch counterparts.

The format names a dtype by a short string (``"BF16"``); the size of a tensor's
byte range must equal ``numel × bits / 8``. Sub-byte dtypes (F4, F6) are part of
the format; torch has no element type for F6, and F4 only packed two per byte.
"""

from __future__ import annotations

import torch

from nostall.errors import ArgumentError

__all__ = ["BITS", "dtype_name", "nbytes_of", "to_torch"]

# Bits per element for every dtype the safetensors format defines (safetensors 0.8,
# `Dtype` in safetensors/src/tensor.rs).
BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

# torch attribute names; looked up lazily because older torch lacks some of them
# (uint16/32/64 arrived in 2.3, float8_e8m0fnu in 2.7).
_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes a tensor of ``dtype`` and ``shape`` occupies, or ``None`` if not whole bytes.

    >>> nbytes_of("BF16", (3, 4))
    24
    """
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * BITS[dtype]
    return bits // 8 if bits % 8 == 0 else None


def to_torch(dtype: str) -> torch.dtype | None:
    """The torch dtype for a safetensors dtype name, or ``None`` if this torch has none.

    >>> to_torch("F8_E4M3")
    torch.float8_e4m3fn
    """
    name = _TORCH_NAMES.get(dtype)
    return getattr(torch, name, None) if name is not None else None


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (the inverse of :func:`to_torch`).

    >>> dtype_name(torch.bfloat16)
    'BF16'
    """
    for name, attr in _TORCH_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return name
    raise ArgumentError(
        f"torch dtype {dtype} has no safetensors name; cast the tensor to one of "
        f"{', '.join(_TORCH_NAMES.values())} before saving"
    )
