"""Opt-in probe (``compression.stats.cache_probe``): what a receiver-side row cache would save.

The probe runs the row cache's own code (:class:`dlrm.embedding_comm.forward_cache.ForwardCache`)
on the forward chunks the codec sends by id, as a shadow sender whose payloads never travel: what
it reports is what ``compression.forward.cache`` would do on the same chunks (the sender's mirror is
what the destination would hold; tests/compression/test_row_cache.py shows the two agree).
Two schemes side by side, each with its own shadow cache: ``cache`` sends a held row that moved
past the bound whole; ``cache_delta`` (the row cache as built) sends its difference from the held
value. Nothing changes on the wire: this only measures.

Statistics per scheme (``forward/<scheme>_probe/...``, see :mod:`dlrm.embedding_comm.stats`): the
cache's row counts ``unique_rows``, ``held_rows``, ``hit_rows``, ``moved_rows`` (also per feature),
``payload_bytes`` (what was sent for the probed chunks), ``cached_bytes`` (what the cache would
send), ``max_error_over_bound`` (what the destination would hold against the exact rows) and
``mirror_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dlrm.embedding_comm.bounds import Bounds
from dlrm.embedding_comm.codec import DirectionCodec, abs_error
from dlrm.embedding_comm.forward_cache import ForwardCache
from dlrm.embedding_comm.stage import Outgoing, Stage
from dlrm.embedding_comm.stats import CommStats

SCHEMES = ("cache", "cache_delta")


def prefix(scheme: str) -> str:
    """Statistics prefix of a scheme (``forward/cache_probe``, ``forward/cache_delta_probe``): the
    built row cache owns ``forward/cache/...``."""
    return f"forward/{scheme}_probe"


class CacheProbe(Stage):
    """A shadow row cache per scheme, fed every training forward chunk sent by id."""

    def __init__(self, capacity_rows: int = 0, backend: str = "auto") -> None:
        self.capacity_rows = capacity_rows
        self.shadows = {s: ForwardCache(capacity_rows, deltas=s == "cache_delta", backend=backend) for s in SCHEMES}

    def state_dict(self) -> dict[str, Any]:
        """Each scheme's shadow cache (this rank's checkpoint)."""
        return {scheme: shadow.state_dict() for scheme, shadow in self.shadows.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for scheme, shadow in self.shadows.items():
            shadow.load_state_dict(state.get(scheme, {}))

    def nbytes(self, scheme: str) -> int:
        return self.shadows[scheme].nbytes

    def sees_payloads(self, direction: str) -> bool:
        return direction == "forward"  # it measures the sent payloads' bytes

    def reads_ids(self, direction: str) -> bool:
        return direction == "forward"  # its shadow caches are looked up by id

    def measure(self, c: Outgoing) -> bool:
        if not (c.direction == "forward" and c.ids is not None and c.dc.dedup and c.bounds is not None):
            return False
        if not len(c.bounds):
            return False
        assert isinstance(c.payload, torch.Tensor)  # sees_payloads: made whole
        self.observe(c.dc, c.chunk, c.ids, c.payload, c.blocks.features, c.blocks.widths, c.bounds, c.dst, c.stats)
        return True

    def observe(
        self,
        dc: DirectionCodec,
        chunk: torch.Tensor,
        ids: torch.Tensor,
        payload: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        bounds: Bounds,
        dst: int,
        stats: CommStats,
    ) -> None:
        """Account one forward chunk sent to global rank ``dst`` (ids ``[rows, n_blocks]``) as
        ``payload``: what each scheme's cache would have sent instead."""
        for scheme, shadow in self.shadows.items():
            p = prefix(scheme)
            cached, held, counts = shadow.encode(dc, chunk, ids, features, widths, bounds, dst)
            for name, n in counts.items():
                stats.add(f"{p}/{name}", n)
            stats.add(f"{p}/payload_bytes", payload.numel())
            stats.add(f"{p}/cached_bytes", cached.numel())
            stats.maximum(f"{p}/max_error_over_bound", _over_bound(held, chunk, widths, bounds))
            stats.maximum(f"{p}/mirror_bytes", shadow.nbytes)


def _over_bound(held: torch.Tensor, exact: torch.Tensor, widths: Sequence[int], bounds: Bounds) -> float:
    """The worst error / bound over the blocks (non-finite values held exactly count as 0); the
    host reads each block's worst error with the bounds at once."""
    if held.shape[0] == 0:
        return 0.0
    col = abs_error(held, exact).amax(dim=0)
    parts = col.split(list(widths))
    worst_t = [p.amax().double() if p.numel() else col.new_zeros((), dtype=torch.float64) for p in parts]
    read = torch.cat([torch.stack(worst_t), torch.as_tensor(bounds, dtype=torch.float64, device=col.device)]).tolist()
    worst = 0.0
    for w, e, b in zip(widths, read[: len(widths)], read[len(widths) :], strict=True):
        if w:
            worst = max(worst, e / b if b > 0 else (0.0 if e == 0 else math.inf))
    return worst
