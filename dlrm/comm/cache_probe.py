"""Opt-in probe (``compression.stats.cache_probe``): what a receiver-side row cache would save.

For the forward all-to-all of single-valued features (a pooled row is one table row, sent once per
unique id), the sender keeps, per destination and table, a mirror of the rows the destination
would hold: the decoded value of the last send of each id (the payload the destination really
decodes, so errors cannot accumulate), under LRU eviction (:class:`compression.row_cache.RowCache`).
A unique row of a batch is a *hit* when its id is held and its exact current value is within the
codec's bound for that block of the held value: the destination could keep what it holds. Hits
stay in the mirror unchanged; every other row is stored as decoded now.

Bytes: the chunk's misses are encoded as today (same codec, same bounds, same ids), plus one
bitmap bit per held unique row; compared with the payload actually sent. Nothing changes on the
wire: this only measures. Statistics (``forward/cache/...``, see :mod:`dlrm.comm.stats`):
``unique_rows``, ``held_rows``, ``hit_rows`` (also per feature), ``payload_bytes`` (what was
sent for the probed chunks) and ``cached_bytes`` (what the cache would send).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from compression.dedup import plan_by_ids
from compression.row_cache import RowCache
from dlrm.comm.codec import DirectionCodec
from dlrm.comm.stats import CommStats


class CacheProbe:
    """The sender's mirrors of every destination's would-be cache, one per table block."""

    def __init__(self, capacity_rows: int = 0) -> None:
        self.capacity_rows = capacity_rows
        self.mirrors: dict[tuple[int, str, int], RowCache] = {}  # (destination, feature, block)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.mirrors.values())

    def observe(
        self,
        dc: DirectionCodec,
        chunk: torch.Tensor,
        ids: torch.Tensor,
        payload: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        bounds: Sequence[float],
        dst: int,
        stats: CommStats,
    ) -> None:
        """Account one forward chunk sent to global rank ``dst`` (ids ``[rows, n_blocks]``)."""
        decoded = dc.codec.decode(payload, ids)  # what the destination holds from now on
        plan = plan_by_ids(ids)
        firsts = plan.first.split(plan.counts.tolist())
        misses: list[torch.Tensor] = []  # per block: chunk rows (first occurrences) to send
        held_total, c = 0, 0
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            rows = firsts[k]
            uid = ids[rows, k]
            mirror = self.mirrors.setdefault((dst, f, k), RowCache(w, self.capacity_rows, chunk.dtype))
            held, cached = mirror.lookup(uid)
            exact = chunk[rows, c : c + w]
            err = (exact - cached).abs().amax(dim=1) if w else exact.new_zeros(rows.numel())
            hit = held & (err <= bounds[k])  # NaN errors (non-finite rows) are misses
            miss = ~hit
            mirror.put(uid[miss], decoded[rows[miss], c : c + w])
            mirror.touch(uid)  # ascending ids: the canonical order of the dedup plan
            misses.append(rows[miss])
            n_held, n_hit = int(held.sum()), int(hit.sum())
            held_total += n_held
            for name, v in (("unique_rows", rows.numel()), ("held_rows", n_held), ("hit_rows", n_hit)):
                stats.add(f"forward/cache/{name}/{f}", v)
                stats.add(f"forward/cache/{name}", v)
            c += w
        stats.add("forward/cache/payload_bytes", payload.numel())
        stats.add("forward/cache/cached_bytes", _misses_bytes(dc, chunk, ids, widths, bounds, misses))
        stats.add("forward/cache/cached_bytes", math.ceil(held_total / 8))  # the bitmap of held rows
        stats.maximum("forward/cache/mirror_bytes", self.nbytes)


def _misses_bytes(
    dc: DirectionCodec,
    chunk: torch.Tensor,
    ids: torch.Tensor,
    widths: Sequence[int],
    bounds: Sequence[float],
    misses: Sequence[torch.Tensor],
) -> int:
    """Size of the payload carrying only each block's missed rows, coded as today. Blocks with
    fewer misses are padded by repeating one of their rows (dedup sends it once); a block with
    none still carries one row (an overestimate of a few bytes)."""
    n = max(1, max(m.numel() for m in misses))
    picks = []
    for m in misses:
        m = m if m.numel() else torch.zeros(1, dtype=torch.int64)
        picks.append(torch.cat([m, m[:1].expand(n - m.numel())]))
    cols, sub_ids, c = [], [], 0
    for k, w in enumerate(widths):
        cols.append(chunk[picks[k], c : c + w])
        sub_ids.append(ids[picks[k], k])
        c += w
    payload = dc.encode(torch.cat(cols, dim=1), widths, bounds, torch.stack(sub_ids, dim=1))
    return int(payload.numel())
