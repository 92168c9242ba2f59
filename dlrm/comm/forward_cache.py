"""``compression.forward.cache``: a receiver-side cache of forward rows, mirrored by the sender.

For single-valued features (a pooled row is one table row, known to both sides by its id), each
rank keeps per peer and table block a :class:`compression.row_cache.RowCache`: as sender a mirror
of what the peer holds, as receiver what it holds from the peer. Both are driven by the same
sequence of unique ids, so they stay identical without extra messages. Per chunk and block, over
its unique ids in ascending order:

* *fresh* (id not held): sent as today;
* *hit* (held, exact value within the block's bound of the held value): nothing but a 0 bit;
* *moved* (held, past the bound): a 1 bit and its difference from the held value, coded with the
  bound less the fp32 rounding of the two sums (:func:`_delta_bound`), so that held + decoded
  difference stays within the bound; a block with no room left (a bound within rounding of its
  values, non-finite values) sends its moved rows whole (flag 0).

Payload: one flag byte per block (1: moved rows travel as differences), the bits of every held
id (packed), then one lossy payload of each block's fresh rows then moved rows, with ids
``fresh ++ moved`` (padded, see :func:`_code`). Only
training forwards use the caches (evaluation sends as today); a checkpoint clears them on every
rank (:meth:`ForwardCache.clear`), so a resumed run matches an uninterrupted one bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from compression.dedup import plan_by_ids
from compression.row_cache import RowCache
from dlrm.comm.codec import DirectionCodec

EPS = float(torch.finfo(torch.float32).eps)


class ForwardCache:
    """Every cache of one rank: (role, peer global rank, feature, block) -> rows."""

    def __init__(self, capacity_rows: int = 0) -> None:
        if capacity_rows < 0:
            raise ValueError(
                f"compression.forward.cache.capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}"
            )
        self.capacity_rows = capacity_rows
        self.caches: dict[tuple[str, int, str, int], RowCache] = {}

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    def clear(self) -> None:
        """Forget every row (at a checkpoint, on every rank at once: both sides start over)."""
        self.caches.clear()

    def _cache(self, role: str, peer: int, feature: str, k: int, dim: int, dtype: torch.dtype) -> RowCache:
        return self.caches.setdefault((role, peer, feature, k), RowCache(dim, self.capacity_rows, dtype))

    def encode(
        self,
        dc: DirectionCodec,
        chunk: torch.Tensor,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        bounds: Sequence[float],
        dst: int,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """(payload for global rank ``dst``, the chunk as ``dst`` will decode it, row counts:
        ``unique_rows``, ``held_rows``, ``hit_rows``, ``moved_rows`` sent as differences)."""
        plan = plan_by_ids(ids)
        firsts = plan.first.split(plan.counts.tolist())
        flags, bits, sends, sent_ids, coded_bounds, steps = [], [], [], [], [], []
        counts = dict.fromkeys(("unique_rows", "held_rows", "hit_rows", "moved_rows"), 0)
        c = 0
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            rows = firsts[k]
            uid = ids[rows, k]
            cache = self._cache("send", dst, f, k, w, chunk.dtype)
            slots, held = cache.find(uid)
            cached = cache.gather(slots)
            exact = chunk[rows, c : c + w]
            # NaN compares false: a row with a NaN (exact or held) is never a hit
            hit = held & ((exact - cached).abs() <= bounds[k]).all(dim=1)
            moved = held & ~hit
            room = _delta_bound(exact[moved], cached[moved], bounds[k])
            delta = room > 0 and bool(moved.any())
            fresh = ~held
            flags.append(int(delta))
            bits.append(moved[held])
            sends.append(torch.cat([exact[fresh], exact[moved] - cached[moved] if delta else exact[moved]]))
            sent_ids.append(torch.cat([uid[fresh], uid[moved]]))
            coded_bounds.append(room if delta else bounds[k])
            steps.append((cache, uid, slots, fresh, moved, cached, delta))
            n_held, n_hit = int(held.sum()), int(hit.sum())
            counts["unique_rows"] += uid.numel()
            counts["held_rows"] += n_held
            counts["hit_rows"] += n_hit
            counts["moved_rows"] += n_held - n_hit if delta else 0
            c += w
        inner = _code(dc, sends, sent_ids, widths, coded_bounds)
        values = _decode(dc, inner, sent_ids, widths)
        out = chunk.new_empty(chunk.shape)
        c = 0
        for k, (cache, uid, slots, fresh, moved, cached, delta) in enumerate(steps):
            unique = _apply(cache, uid, slots, fresh, moved, cached, delta, values[k])
            out[:, c : c + widths[k]] = unique[plan.inverse[k]] if plan.inverse is not None else unique
            c += widths[k]
        head = torch.tensor(flags, dtype=torch.uint8)
        packed = torch.from_numpy(np.packbits(torch.cat(bits).numpy().astype(np.uint8))) if bits else head[:0]
        return torch.cat([head, packed, inner]), out, counts

    def decode(
        self,
        dc: DirectionCodec,
        payload: torch.Tensor,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        src: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chunk global rank ``src`` sent (into ``out`` if given), updating our caches alike."""
        plan = plan_by_ids(ids)
        firsts = plan.first.split(plan.counts.tolist())
        nb = len(widths)
        flags = payload[:nb].tolist()
        looked = []
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            uid = ids[firsts[k], k]
            cache = self._cache("recv", src, f, k, w, torch.float32 if out is None else out.dtype)
            slots, held = cache.find(uid)
            looked.append((cache, uid, slots, held))
        n_held = sum(int(h.sum()) for *_, h in looked)
        n_bytes = (n_held + 7) // 8
        bits = torch.from_numpy(np.unpackbits(payload[nb : nb + n_bytes].numpy())[:n_held].astype(bool))
        inner = payload[nb + n_bytes :].clone()  # aligned (format.view_as fails on an empty misaligned section)
        sent_ids, steps, at = [], [], 0
        for (cache, uid, slots, held), flag in zip(looked, flags, strict=True):
            h = int(held.sum())
            moved = torch.zeros_like(held)
            moved[held] = bits[at : at + h]
            at += h
            fresh = ~held
            sent_ids.append(torch.cat([uid[fresh], uid[moved]]))
            steps.append((cache, uid, slots, fresh, moved, cache.gather(slots), bool(flag)))
        values = _decode(dc, inner, sent_ids, widths)
        rows = ids.shape[0]
        if out is None:
            out = torch.empty(rows, sum(widths), dtype=torch.float32)
        c = 0
        for k, (cache, uid, slots, fresh, moved, cached, delta) in enumerate(steps):
            unique = _apply(cache, uid, slots, fresh, moved, cached, delta, values[k])
            out[:, c : c + widths[k]] = unique[plan.inverse[k]] if plan.inverse is not None else unique
            c += widths[k]
        return out


def _delta_bound(exact: torch.Tensor, held: torch.Tensor, bound: float) -> float:
    """The bound for the differences ``exact - held`` of moved rows: ``bound`` less what fp32
    rounding of ``exact - held`` and of ``held + decoded`` can add (at most ~2.5 eps x the largest
    magnitude; 4 taken). Negative (send whole) where any value is non-finite: a NaN or inf
    difference cannot restore the exact value."""
    if exact.numel() == 0:
        return bound
    m = float(torch.maximum(exact.abs().amax(), held.abs().amax()))  # NaN-propagating, unlike max()
    room = bound - 4 * EPS * m
    return room if math.isfinite(room) else -1.0


def _apply(
    cache: RowCache,
    uid: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    moved: torch.Tensor,
    cached: torch.Tensor,
    delta: bool,
    values: torch.Tensor,
) -> torch.Tensor:
    """The unique rows as decoded (held for hits, decoded for fresh, held + difference for
    moved), stored the same way on both sides (which makes every id of the batch the most
    recent). ``cached`` (the held rows, gathered for this call) becomes the result."""
    n_fresh, n_moved = int(fresh.sum()), int(moved.sum())
    unique = cached
    unique[fresh] = values[:n_fresh]
    moved_rows = values[n_fresh : n_fresh + n_moved]
    unique[moved] = unique[moved] + moved_rows if delta else moved_rows
    cache.store(uid, unique, slots)
    return unique


def _padded_ids(sent_ids: Sequence[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    n = max([1, *(i.numel() for i in sent_ids)])
    out = []
    for i in sent_ids:
        i = i if i.numel() else torch.full((1,), -1, dtype=torch.int64)
        out.append(torch.cat([i, i[:1].expand(n - i.numel())]))
    return n, out


def _code(
    dc: DirectionCodec,
    sends: Sequence[torch.Tensor],
    sent_ids: Sequence[torch.Tensor],
    widths: Sequence[int],
    bounds: Sequence[float],
) -> torch.Tensor:
    """One lossy payload of each block's rows ``sends[k]`` under ids ``sent_ids[k]``. Shorter
    blocks repeat their first row under its id (dedup sends it once); an empty block carries one
    zero row under id -1."""
    n, ids = _padded_ids(sent_ids)
    cols = []
    for s, w in zip(sends, widths, strict=True):
        s = s if s.shape[0] else s.new_zeros(1, w)
        cols.append(torch.cat([s, s[:1].expand(n - s.shape[0], w)]))
    return dc.encode(torch.cat(cols, dim=1), widths, bounds, torch.stack(ids, dim=1))


def _decode(
    dc: DirectionCodec, inner: torch.Tensor, sent_ids: Sequence[torch.Tensor], widths: Sequence[int]
) -> list[torch.Tensor]:
    """Each block's decoded rows of :func:`_code`'s payload (both sides rebuild the same ids)."""
    _, ids = _padded_ids(sent_ids)
    rows = dc.codec.decode(inner, torch.stack(ids, dim=1))
    starts = [sum(widths[:k]) for k in range(len(widths))]
    return [rows[:, c : c + w] for c, w in zip(starts, widths, strict=True)]
