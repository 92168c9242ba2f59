"""Instrumentation points of our collectives, for probes and tests.

* Which collective runs on this thread now: the compressed all-to-all
  (:mod:`dlrm.embedding_comm.comm_ops`) issues its collectives (the size exchange, the byte
  all-to-all, the wait for it) inside :func:`embedding_collective`, which names its direction and
  iteration. A tool that times collectives (:mod:`dlrm.bench.netprobe`) asks :func:`current` to
  tell them from the sparse input all-to-all and the dense all-reduce, and wraps TorchRec's own
  pooled all-to-all in the same context for the stock (QComms) path; a test that tampers with the
  bytes on the wire (``tests/wire_tap.py``, a wrapper of ``torch.distributed``'s collectives)
  asks :func:`marked` which payloads, of which iteration, a collective carries. Costs one
  context-variable set per collective when no one asks.
* What a dense payload looks like on the wire: tests install :func:`set_payload_hook` to corrupt
  or inspect every payload the dense gradient hook (:mod:`dlrm.dense_comm.hook`) is about to send.
  The embedding all-to-all has no such branch: tests reach its bytes through the wrapper above,
  which the dense hook can serve as well once it marks its collectives (:func:`collective` with
  channel ``dense``); this hook stays until then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

DIRECTIONS = ("forward", "backward")  # the embedding all-to-all's channels

# fn(payload, src=, dst=, direction=, iteration=) -> payload; direction "dense" (dst -1: every
# rank receives it). None in normal runs.
PayloadHook = Callable[..., torch.Tensor]
_payload_hook: PayloadHook | None = None


def set_payload_hook(hook: PayloadHook | None) -> None:
    """Install (or clear with None) a hook that may alter each dense payload before it is sent."""
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


@dataclass(frozen=True)
class Marked:
    """What the collectives issued inside a :func:`collective` carry: their channel (``forward``
    or ``backward``: the pooled-embedding all-to-all's direction; ``dense``: the dense
    gradients) and the training iteration they belong to (-1: not said)."""

    channel: str
    iteration: int = -1


_current: ContextVar[Marked | None] = ContextVar("dlrm_collective", default=None)


@contextmanager
def collective(channel: str, iteration: int = -1) -> Iterator[None]:
    """Mark the collectives issued inside as carrying ``channel``'s payloads of ``iteration``."""
    token = _current.set(Marked(channel, iteration))
    try:
        yield
    finally:
        _current.reset(token)


def embedding_collective(direction: str, iteration: int = -1) -> AbstractContextManager[None]:
    """Mark the collectives issued inside as the pooled-embedding all-to-all of ``direction``."""
    return collective(direction, iteration)


def current() -> str | None:
    """``forward`` or ``backward`` inside an embedding all-to-all, else None."""
    m = _current.get()
    return m.channel if m is not None and m.channel in DIRECTIONS else None


def marked() -> Marked | None:
    """The innermost :func:`collective` around this call, if any."""
    return _current.get()
