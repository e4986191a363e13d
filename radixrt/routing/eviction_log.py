"""`EvictionLog`: a worker's recent cache evictions, numbered, for routers to catch up on.

Each entry is a prefix the worker no longer extends (see `ApproxPrefixTree.drop_extensions`; an
empty prefix means the whole cache was flushed). A reader remembers the sequence number it has
read up to and asks for what came after; when entries it has not read were already dropped from
the ring (`lost`), or the log belongs to another run of the worker (`epoch` changed), the reader
must forget its whole view of that worker.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EvictionSlice:
    """Entries after a reader's position: `next_seq` is where to ask from next time."""

    epoch: str
    next_seq: int
    prefixes: list[list[int]]
    lost: bool


class EvictionLog:
    """Bounded, thread-safe ring of evicted prefixes with monotonic sequence numbers."""

    def __init__(self, capacity: int = 4096):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.epoch = uuid.uuid4().hex[:12]
        self._ring: deque[list[int]] = deque(maxlen=capacity)
        self._next = 0  # sequence number of the next entry appended
        self._lock = threading.Lock()

    def append(self, prefixes: Iterable[Sequence[int]]) -> None:
        with self._lock:
            for p in prefixes:
                self._ring.append(list(p))
                self._next += 1

    def since(self, seq: int) -> EvictionSlice:
        """Entries numbered >= `seq` (a negative or future `seq` reads as lost)."""
        with self._lock:
            first = self._next - len(self._ring)
            if seq < first or seq > self._next:
                return EvictionSlice(self.epoch, self._next, list(self._ring), True)
            return EvictionSlice(self.epoch, self._next,
                                 [list(p) for p in list(self._ring)[seq - first:]], False)
