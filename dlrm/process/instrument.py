"""Instrumentation points of our collectives, for probes and fault injection.

* Which embedding all-to-all runs on this thread now: the compressed all-to-all
  (:mod:`dlrm.embedding_comm.comm_ops`) issues its collectives (the size exchange, the byte all-to-all, the
  wait for it) inside :func:`embedding_collective`. A tool that times collectives
  (:mod:`dlrm.bench.netprobe`) asks :func:`current` to tell them from the sparse input all-to-all
  and the dense all-reduce, and wraps TorchRec's own pooled all-to-all in the same context for the
  stock (QComms) path. Costs one context-variable set per collective when no one asks.
* What a payload looks like on the wire: tests install :func:`set_payload_hook` to corrupt or
  inspect every payload a sender is about to send (the all-to-alls' and the dense gradients').
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# fn(payload, src=, dst=, direction=, iteration=) -> payload; direction "forward", "backward" or
# "dense" (dst -1: every rank receives it). None in normal runs.
PayloadHook = Callable[..., torch.Tensor]
_payload_hook: PayloadHook | None = None


def set_payload_hook(hook: PayloadHook | None) -> None:
    """Install (or clear with None) a hook that may alter each payload before it is sent."""
    global _payload_hook
    _payload_hook = hook


def payload_hooked() -> bool:
    """Whether a hook sees payloads before they are sent (then their bytes must be known first)."""
    return _payload_hook is not None


def on_the_wire(payload: torch.Tensor, *, src: int, dst: int, direction: str, iteration: int) -> torch.Tensor:
    """The payload as sent: ``payload``, or what the installed hook makes of it."""
    if _payload_hook is None:
        return payload
    return _payload_hook(payload, src=src, dst=dst, direction=direction, iteration=iteration)


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
