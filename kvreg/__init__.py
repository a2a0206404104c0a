"""kvreg: the KV cache of an LLM inference engine, with pluggable backends.

``import kvreg`` imports numpy and pluggy only; backends (numba, pyopencl)
load when selected.
"""

from .batch import attend_batch
from .cache import EvictionPolicy, KvCache, resident_bytes
from .decode_step import DecodeStep
from .errors import BackendError, ConfigError, KvregError, SealError, ShapeError, StateError, WireError
from .layer import LayerKvCache
from .lifecycle import Lifecycle
from .modes import KV_COL_WARMUP, KV_K_GROUP, KvMode
from .registry import backends, get_backend, refresh
from .threads import get_num_threads, set_num_threads
from .wire import WIRE_MAGIC, WIRE_VERSION, WireKind

__version__ = "0.1.0"

__all__ = [
    "BackendError", "ConfigError", "DecodeStep", "attend_batch", "EvictionPolicy", "KV_COL_WARMUP", "KV_K_GROUP",
    "KvCache", "KvMode", "KvregError", "LayerKvCache", "Lifecycle", "SealError", "ShapeError", "StateError",
    "WIRE_MAGIC", "WIRE_VERSION", "WireError", "WireKind", "backends", "get_backend", "get_num_threads", "refresh",
    "resident_bytes", "set_num_threads", "__version__",
]
