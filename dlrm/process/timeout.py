"""Collectives that time out by name.

A peer that stops answering (stopped, hung, cut off) makes gloo raise, after the process group's
timeout (config key ``comm_timeout_s``), only "Timed out waiting Nms for recv operation to
complete" or "Application timeout caused pair closure": neither the collective nor the peer. Code
that issues collectives wraps them in :func:`named_collective`, which re-raises that error as
:class:`CollectiveTimeout` naming the collective, this rank, and the ranks that did not answer a
roll call in the process group's store (under torchrun the store lives in the agent, so a stalled
rank cannot hold it up). The innermost name wins. A connection a peer closed or reset (the peer
died, or its own timeout fired first and closed the pair) raises :class:`PeerLost`, named the same
way; torchrun restarts the job where allowed.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

# gloo's words for it: the waiting op's own, or the pair's once a timeout closed it (DDP's all-reduce)
GLOO_TIMEOUT = re.compile(r"Timed out waiting \d+ms for (send|recv) operation|Application timeout caused pair closure")
# a peer whose own timeout fired first closes its pairs: the others see it as a closed connection
PEER_CLOSED = re.compile(r"Connection closed by peer|Connection reset by peer")
ROLL_CALL_S = 5.0  # how long a timed-out rank waits for the other survivors to report in


class CollectiveTimeout(RuntimeError):
    """A collective waited ``comm_timeout_s`` for a peer; the message names it and the silent ranks."""


class PeerLost(RuntimeError):
    """A peer closed or reset its connection during a collective; the message names it and the ranks
    that did not answer the roll call."""


@dataclass(frozen=True)
class _RollCall:
    store: dist.Store
    rank: int
    world_size: int
    timeout_s: float


_roll_call: _RollCall | None = None


def enable_roll_call(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Let timeouts name the silent ranks: ``store`` is the process group's (one per attempt)."""
    global _roll_call
    _roll_call = _RollCall(store, rank, world_size, timeout_s)


def silent_ranks(rc: _RollCall, collective: str, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """Report in, then wait up to ``wait_s`` for every rank to: those that never do are stalled or
    gone (survivors time out too, at about the same moment). None if the store cannot be reached.

    The store is asked from a daemon thread given ``wait_s`` and a second more: from a rank cut off
    from the store's host, a store call can block for TCP's retransmission timeout (many minutes),
    whatever the store's own timeout; such a call is abandoned (the rank is about to fail anyway)."""
    answer: list[list[int] | None] = []

    def ask() -> None:
        answer.append(_ask_store(rc, collective, wait_s))

    asking = threading.Thread(target=ask, name="dlrm-roll-call", daemon=True)
    asking.start()
    asking.join(wait_s + 1.0)
    return answer[0] if answer else None


def _ask_store(rc: _RollCall, collective: str, wait_s: float) -> list[int] | None:
    key = "dlrm/timed_out/{}".format
    try:
        rc.store.set_timeout(timedelta(seconds=wait_s))
        rc.store.set(key(rc.rank), collective)
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(rc.world_size) if not rc.store.check([key(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except RuntimeError:  # the store went too (its host stalled or died): we do not know
        return None


def describe(collective: str, error: BaseException, closed: bool = False) -> str:
    """The message of a timed-out ``collective``: this rank, the timeout, the silent ranks, gloo's words
    (``closed``: a peer closed its connection before this rank's own timeout fired)."""
    rc = _roll_call
    if rc is None:
        return f"{collective} {'lost a peer' if closed else 'timed out waiting for a peer'} ({error})"
    silent = silent_ranks(rc, collective)
    if silent is None:
        who = (
            "which ranks stopped answering is unknown (the store is unreachable too: this rank may be the one cut off)"
        )
    elif silent:
        who = f"rank(s) {silent} did not answer a roll call within {ROLL_CALL_S:g} s more (stalled, stopped or cut off)"
    else:
        who = "every rank answered a roll call afterwards (a slow peer, or collectives issued in different orders)"
    what = "timed out after"
    if closed:
        what = "lost a peer's connection (closed by its own timeout, or its death) within"
    return (
        f"rank {rc.rank} of {rc.world_size}: {collective} {what} comm_timeout_s={rc.timeout_s:g} s; "
        f"{who}. gloo: {error}"
    )


@contextmanager
def named_collective(name: str | Callable[[], str]) -> Iterator[None]:
    """Collectives issued inside that time out raise :class:`CollectiveTimeout` naming ``name``
    (a string, or a function giving it at the time of the failure), and :class:`PeerLost` where a
    peer closed the connection."""
    try:
        yield
    except (CollectiveTimeout, PeerLost):
        raise
    except RuntimeError as e:
        closed = PEER_CLOSED.search(str(e)) is not None
        if not (closed or GLOO_TIMEOUT.search(str(e))):
            raise
        kind = PeerLost if closed else CollectiveTimeout
        raise kind(describe(name() if callable(name) else name, e, closed)) from e
