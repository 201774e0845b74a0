"""nostall: keep GPUs busy in diffusion inference.

Load safetensors checkpoints from storage to the GPU at the speed of the link
(``load_state_dict``, ``load_model``, ``PinnedPool``), and stream decoded video
out of the GPU without stalling it (``nostall.video``).

Nothing here touches CUDA at import: streams, pools and threads belong to the
objects that create them.
"""

from nostall.api import load_model, load_state_dict
from nostall.cache import CacheStats, ModelCache, SwitchReport
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
from nostall.memory.pool import PinnedPool, PoolStats
from nostall.quant import QuantizeReport, quantize
from nostall.transfer.loader import Loader, LoadResult, LoadStats

__version__ = "0.1.0"

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
