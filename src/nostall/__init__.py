"""nostall: keep GPUs busy in diffusion inference.

Load safetensors checkpoints from storage to the GPU at the speed of the link
(``load_state_dict``, ``load_model``, ``PinnedPool``), and stream decoded video
out of the GPU without stalling it (``nostall.video``).

Nothing here touches CUDA at import: streams, pools and threads belong to the
objects that create them. ``import nostall`` loads only the exceptions; the rest (and
torch) load on first use of a name.
"""

import importlib as _importlib

from nostall.errors import (
    AdapterError,
    ArgumentError,
    BudgetExceeded,
    BusyError,
    Cancelled,
    CheckpointError,
    ClosedError,
    DegradedError,
    DeviceError,
    EmbeddingUnavailable,
    FileChanged,
    InternalError,
    LatentsError,
    ModelMismatchError,
    NostallError,
    PoolExhausted,
    QueueFull,
    ReadError,
    RemoteError,
    ServeError,
    ShuttingDown,
    SinkError,
    UnknownModel,
    UnsupportedError,
)

__version__ = "0.1.0"

# Where each public name lives: imported on first use (PEP 562).
_LAZY = {
    "load_model": "nostall.api",
    "load_state_dict": "nostall.api",
    "CacheStats": "nostall.cache",
    "ModelCache": "nostall.cache",
    "SwitchReport": "nostall.cache",
    "PinnedPool": "nostall.memory.pool",
    "PoolStats": "nostall.memory.pool",
    "QuantizeReport": "nostall.quant",
    "quantize": "nostall.quant",
    "Loader": "nostall.transfer.loader",
    "LoadResult": "nostall.transfer.loader",
    "LoadStats": "nostall.transfer.loader",
}

__all__ = [
    "AdapterError",
    "ArgumentError",
    "BudgetExceeded",
    "BusyError",
    "CacheStats",
    "Cancelled",
    "CheckpointError",
    "ClosedError",
    "DegradedError",
    "DeviceError",
    "EmbeddingUnavailable",
    "FileChanged",
    "InternalError",
    "LatentsError",
    "LoadResult",
    "LoadStats",
    "Loader",
    "ModelCache",
    "ModelMismatchError",
    "NostallError",
    "PinnedPool",
    "PoolExhausted",
    "PoolStats",
    "QuantizeReport",
    "QueueFull",
    "ReadError",
    "RemoteError",
    "ServeError",
    "ShuttingDown",
    "SinkError",
    "SwitchReport",
    "UnknownModel",
    "UnsupportedError",
    "__version__",
    "load_model",
    "load_state_dict",
    "quantize",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nostall' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
