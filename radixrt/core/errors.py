"""Typed errors shared by every layer: bad input names its field; broken invariants say which."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request is malformed or cannot be served. `field` names the offending input (the
    OpenAI error body's `param`); `str(err)` is the human message, starting with the field."""

    def __init__(self, field: str, message: str, code: str | None = None):
        self.field = field
        self.message = message
        self.code = code  # a machine-readable kind, e.g. "context_length_exceeded"
        super().__init__(f"{field}: {message}")


class InvariantError(RuntimeError):
    """A pool or the radix tree is inconsistent (a leaked or doubly owned slot, a bad lock
    count). Raised by the invariant checks instead of `assert`, so `python -O` keeps them."""


class EngineDeadError(RuntimeError):
    """A runtime child process died; the engine cannot serve any more requests."""


class ReplicaDeadError(EngineDeadError):
    """One `--dp` replica died: the requests it was running end with this error, the other
    replicas keep serving (the engine is dead only once every replica is)."""
