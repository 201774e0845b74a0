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
    ArgumentError,
    BudgetExceeded,
    BusyError,
    CheckpointError,
    ClosedError,
    DeviceError,
    FileChanged,
    LatentsError,
    ModelMismatchError,
    NostallError,
    PoolExhausted,
    ReadError,
    SinkError,
    UnknownModel,
    UnsupportedError,
)
from nostall.memory.pool import PinnedPool, PoolStats
from nostall.quant import QuantizeReport, quantize
from nostall.transfer.loader import Loader, LoadResult, LoadStats

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "BudgetExceeded",
    "BusyError",
    "CacheStats",
    "CheckpointError",
    "ClosedError",
    "DeviceError",
    "FileChanged",
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
    "ReadError",
    "SinkError",
    "SwitchReport",
    "UnknownModel",
    "UnsupportedError",
    "__version__",
    "load_model",
    "load_state_dict",
    "quantize",
]
