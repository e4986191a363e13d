"""`GrammarCompiler`: compiles grammars off the scheduling loop and caches them by key.

One background thread does all the slow work: building the backend (converting the tokenizer
takes about a second, paid by the first constrained request, never by start-up) and compiling
each distinct `(kind, source)`. Results, failures included, are kept in an LRU of futures, so
every request with a known key gets a finished future at once and a key being compiled is
compiled once however many requests wait on it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from radixrt.grammar.base import GrammarBackend, GrammarMatcher

GrammarKey = tuple[str, str]


class GrammarCompiler:
    """`make_backend` runs once, on the worker thread, before the first compile. Thread
    safety: `submit` / `matcher` are called from the scheduler thread only; the worker only
    runs `_compile`."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], max_cached: int = 256):
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self.max_cached = max_cached
        self.compiles = 0  # keys compiled (cache misses), for stats and tests

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (by whichever thread gets there first)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _compile(self, key: GrammarKey) -> object:
        return self.backend.compile(*key)

    def submit(self, key: GrammarKey) -> Future:
        """The future compiled grammar of `key` (done at once when cached). Its exception is
        a `GrammarError` for a bad grammar, anything else for a broken backend."""
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            return fut
        self.compiles += 1
        fut = self._pool.submit(self._compile, key)
        self._cache[key] = fut
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)  # running futures finish for their waiters
        return fut

    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher for a grammar `submit` compiled (so the backend exists)."""
        return self.backend.matcher(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
