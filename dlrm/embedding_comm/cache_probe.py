"""Opt-in probe (``compression.stats.cache_probe``): what a receiver-side row cache would save.

For the forward all-to-all of single-valued features (a pooled row is one table row, sent once per
unique id), the sender keeps, per destination and table, a mirror of the rows the destination
would hold: the decoded value of the last send of each id (the payload the destination really
decodes, so errors cannot accumulate), under LRU eviction (:class:`compression.row_cache.RowCache`).
A unique row of a batch is a *hit* when its id is held and its exact current value is within the
codec's bound for that block of the held value: the destination could keep what it holds. Hits
stay in the mirror unchanged; every other row is stored as decoded now.

Bytes: the chunk's misses are encoded as today (same codec, same bounds, same ids), plus one
bitmap bit per held unique row; compared with the payload actually sent. Two schemes are measured
side by side, each with its own mirrors: ``cache`` sends a held row that moved past the bound as
today; ``cache_delta`` sends its difference from the held value instead (same bound: small
differences quantise to small integers, which the entropy coder packs tighter), the destination
holding held + decoded difference. Nothing changes on the wire: this only measures.

Statistics per scheme (``forward/<scheme>_probe/...``, see :mod:`dlrm.embedding_comm.stats`): ``unique_rows``,
``held_rows``, ``hit_rows`` (also per feature), ``payload_bytes`` (what was sent for the probed
chunks), ``cached_bytes`` (what the scheme would send), ``max_error_over_bound`` (what the
destination would hold against the exact rows) and ``mirror_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from compression.dedup import plan_by_ids
from compression.row_cache import RowCache
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.stats import CommStats

SCHEMES = ("cache", "cache_delta")


def prefix(scheme: str) -> str:
    """Statistics prefix of a scheme (``forward/cache_probe``, ``forward/cache_delta_probe``): the
    built row cache owns ``forward/cache/...``."""
    return f"forward/{scheme}_probe"


# per table block of a chunk: mirror, unique ids, slots, held rows (updated, then stored), exact rows, fresh, moved
_Block = tuple[RowCache, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class CacheProbe:
    """The sender's mirrors of every destination's would-be cache, per scheme and table block."""

    def __init__(self, capacity_rows: int = 0) -> None:
        self.capacity_rows = capacity_rows
        self.mirrors: dict[tuple[str, int, str, int], RowCache] = {}  # (scheme, destination, feature, block)

    def state_dict(self) -> dict[str, Any]:
        """The mirrors, as [scheme, destination, feature, block, cache state] (this rank's checkpoint)."""
        return {"mirrors": [[*k, c.state_dict()] for k, c in self.mirrors.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.mirrors = {}
        for scheme, dst, feature, k, saved in state.get("mirrors", []):
            mirror = RowCache(int(saved["dim"]), self.capacity_rows, saved["rows"].dtype)
            mirror.load_state_dict(saved)
            self.mirrors[(str(scheme), int(dst), str(feature), int(k))] = mirror

    def nbytes(self, scheme: str) -> int:
        return sum(c.nbytes for k, c in self.mirrors.items() if k[0] == scheme)

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
        decoded = dc.codec.decode(payload, ids)  # what the destination decodes today
        plan = plan_by_ids(ids)
        firsts = plan.first.split(plan.counts.tolist())  # per block: first rows of its ids, ascending
        starts = [sum(widths[:k]) for k in range(len(widths))]
        for scheme in SCHEMES:
            delta = scheme == "cache_delta"
            sends: list[torch.Tensor] = []  # per block: the values to code (rows, or differences)
            sent_ids: list[torch.Tensor] = []
            after: list[_Block] = []
            held_total = 0
            for k, (f, w) in enumerate(zip(features, widths, strict=True)):
                rows, c = firsts[k], starts[k]
                uid = ids[rows, k]
                mirror = self.mirrors.setdefault((scheme, dst, f, k), RowCache(w, self.capacity_rows, chunk.dtype))
                slots, held = mirror.find(uid)
                cached = mirror.gather(slots)  # a copy: the rows the destination will hold after this chunk
                exact = chunk[rows, c : c + w]
                err = (exact - cached).abs().amax(dim=1) if w else exact.new_zeros(rows.numel())
                hit = held & (err <= bounds[k])  # NaN errors (non-finite rows) are misses
                moved = held & ~hit if delta else torch.zeros_like(hit)
                fresh = ~hit & ~moved
                # what is coded: fresh rows as they are, moved rows as differences (after them)
                sends.append(torch.cat([exact[fresh], exact[moved] - cached[moved]]))
                sent_ids.append(torch.cat([uid[fresh], uid[moved]]))
                after.append((mirror, uid, slots, cached, exact, fresh, moved))
                n_held, n_hit = int(held.sum()), int(hit.sum())
                held_total += n_held
                for name, v in (("unique_rows", rows.numel()), ("held_rows", n_held), ("hit_rows", n_hit)):
                    stats.add(f"{prefix(scheme)}/{name}/{f}", v)
                    stats.add(f"{prefix(scheme)}/{name}", v)
            coded, values = _code(dc, sends, sent_ids, widths, bounds)
            worst = 0.0
            for k, (mirror, uid, slots, held_now, exact, fresh, moved) in enumerate(after):
                n_fresh, n_moved = int(fresh.sum()), int(moved.sum())  # hits keep what is held
                if delta:  # the destination adds the decoded difference to what it holds
                    new = values[k][n_fresh : n_fresh + n_moved] + held_now[moved]
                    held_now[moved] = new
                    worst = max(worst, _over_bound(new, exact[moved], bounds[k]))
                sent = decoded[firsts[k][fresh], starts[k] : starts[k] + widths[k]]
                worst = max(worst, _over_bound(sent, exact[fresh], bounds[k]))
                held_now[fresh] = sent
                mirror.store(uid, held_now, slots)  # every id of the batch becomes the most recent
            stats.add(f"{prefix(scheme)}/payload_bytes", payload.numel())
            stats.add(f"{prefix(scheme)}/cached_bytes", coded + math.ceil(held_total / 8))  # + bitmap of held
            stats.maximum(f"{prefix(scheme)}/max_error_over_bound", worst)
            stats.maximum(f"{prefix(scheme)}/mirror_bytes", self.nbytes(scheme))


def _over_bound(held: torch.Tensor, exact: torch.Tensor, bound: float) -> float:
    if held.numel() == 0:
        return 0.0
    e = float((held - exact).abs().max())
    return e / bound if bound > 0 else (0.0 if e == 0 else math.inf)


def _code(
    dc: DirectionCodec,
    sends: Sequence[torch.Tensor],
    sent_ids: Sequence[torch.Tensor],
    widths: Sequence[int],
    bounds: Sequence[float],
) -> tuple[int, list[torch.Tensor]]:
    """Bytes of one payload carrying each block's rows ``sends[k]`` (ids ``sent_ids[k]``), coded as
    today, and the decoded rows per block. Shorter blocks are padded by repeating one of their
    rows under its id (dedup sends it once); a block with none still carries one zero row (an
    overestimate of a few bytes)."""
    n = max(1, max(s.shape[0] for s in sends))
    cols, col_ids = [], []
    for s, i, w in zip(sends, sent_ids, widths, strict=True):
        if s.shape[0] == 0:
            s, i = s.new_zeros(1, w), torch.full((1,), -1, dtype=torch.int64)
        cols.append(torch.cat([s, s[:1].expand(n - s.shape[0], w)]))
        col_ids.append(torch.cat([i, i[:1].expand(n - i.numel())]))
    sub_ids = torch.stack(col_ids, dim=1)
    coded = dc.encode(torch.cat(cols, dim=1), widths, bounds, sub_ids)
    out = dc.codec.decode(coded, sub_ids)
    starts = [sum(widths[:k]) for k in range(len(widths))]
    return int(coded.numel()), [out[:, c : c + w] for c, w in zip(starts, widths, strict=True)]
