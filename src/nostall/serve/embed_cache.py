"""The embedding service's exact-match cache: least recently used out first, within a byte
budget that counts keys and values alike."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import torch

__all__ = ["EmbeddingCache", "entry_bytes"]

# Memory around an entry beyond its tensors' bytes: the OrderedDict's node and hash slot
# (_ENTRY) and, per tensor, its Python object, TensorImpl and StorageImpl (_TENSOR;
# about 400 bytes of RSS per CPU tensor, measured with torch 2.9).
_ENTRY = 128
_TENSOR = 512


def entry_bytes(key: tuple, value: dict[str, torch.Tensor]) -> int:
    """Bytes the cache accounts for one entry: its key and its value with the objects
    around them, so neither large keys nor many small entries pass the budget.

    >>> entry_bytes(("digest", b"0" * 32, 77), {"pooled": torch.zeros(768)}) > 768 * 4
    True
    """
    keys = sys.getsizeof(key) + sum(sys.getsizeof(k) for k in key)
    values = sys.getsizeof(value) + sum(
        sys.getsizeof(k) + t.untyped_storage().nbytes() + _TENSOR for k, t in value.items()
    )
    return _ENTRY + keys + values


class EmbeddingCache:
    """Exact-match embeddings within ``budget`` bytes (:func:`entry_bytes` each), least
    recently used out first; an entry larger than the whole budget is not kept.
    Thread-safe. The tensors it returns are shared with the cache: read them, do not
    write them."""

    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._d: OrderedDict[tuple, tuple[dict[str, torch.Tensor], int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> dict[str, torch.Tensor] | None:
        with self._lock:
            got = self._d.get(key)
            if got is None:
                self.misses += 1
                return None
            self._d.move_to_end(key)
            self.hits += 1
            return got[0]

    def put(self, key: tuple, value: dict[str, torch.Tensor]) -> None:
        size = entry_bytes(key, value)
        if size > self.budget:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._d[key] = (value, size)
            self.bytes += size
            while self.bytes > self.budget:
                _, (_, out) = self._d.popitem(last=False)
                self.bytes -= out

    def clear(self) -> None:
        """Drop every entry (their tensors may be on the device)."""
        with self._lock:
            self._d.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._d)
