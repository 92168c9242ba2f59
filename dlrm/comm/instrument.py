"""The instrumentation point of the embedding all-to-alls: which one is running on this thread now.

The compressed all-to-all (:mod:`dlrm.comm.comm_ops`) issues its collectives (the size exchange,
the byte all-to-all, the wait for it) inside :func:`embedding_collective`. A tool that times
collectives (:mod:`dlrm.bench.netprobe`) asks :func:`current` to tell them from the sparse input
all-to-all and the dense all-reduce, and wraps TorchRec's own pooled all-to-all in the same
context for the stock (QComms) path. Costs one context-variable set per collective when no one
asks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_current: ContextVar[str | None] = ContextVar("dlrm_embedding_collective", default=None)


@contextmanager
def embedding_collective(direction: str) -> Iterator[None]:
    """Mark the collectives issued inside as the pooled-embedding all-to-all of ``direction``."""
    token = _current.set(direction)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> str | None:
    """``forward`` or ``backward`` inside an embedding all-to-all, else None."""
    return _current.get()
