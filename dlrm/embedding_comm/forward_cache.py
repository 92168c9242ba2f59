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
training forwards use the caches (evaluation sends as today); each rank's caches are part of its
checkpoint (:meth:`ForwardCache.state_dict`), so saving changes nothing and a resumed run matches
an uninterrupted one bit for bit.

Each block is classified, merged and stored in a few whole-tensor operations on the chunk's own
device (CPU or an accelerator). The host reads only the sizes the payload's layout depends on, all
blocks at once: per chunk, encode reads the blocks' unique-id counts and then their held, hit and
moved counts with the delta bounds' magnitudes; decode the counts, then the held counts with the
flags, then the moved counts (the codec's own reads aside).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dlrm.embedding_comm.bounds import Bounds
from dlrm.embedding_comm.codec import CompressedCommError, DirectionCodec
from dlrm.embedding_comm.stage import Incoming, Outgoing, Stage
from dlrm_compression.dedup import plan_by_ids
from dlrm_compression.row_cache import RowCache, compact, positions

EPS = float(torch.finfo(torch.float32).eps)


class ForwardCache:
    """Every cache of one rank: (role, peer global rank, feature, block) -> rows.

    ``deltas=False`` sends moved rows whole (flag 0), a scheme the probe measures beside the cache.
    """

    def __init__(self, capacity_rows: int = 0, deltas: bool = True) -> None:
        if capacity_rows < 0:
            raise ValueError(
                f"compression.forward.cache.capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}"
            )
        self.capacity_rows = capacity_rows
        self.deltas = deltas
        self.caches: dict[tuple[str, int, str, int], RowCache] = {}

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    def state_dict(self) -> dict[str, Any]:
        """This rank's caches, as [role, peer, feature, block, cache state] (for its checkpoint)."""
        return {"capacity_rows": self.capacity_rows, "caches": [[*k, c.state_dict()] for k, c in self.caches.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Caches land on the saved rows' device; the first chunk moves them to its own."""
        self.caches = {}
        for role, peer, feature, k, saved in state.get("caches", []):
            cache = RowCache(int(saved["dim"]), self.capacity_rows, saved["rows"].dtype, saved["rows"].device)
            cache.load_state_dict(saved)
            self.caches[(str(role), int(peer), str(feature), int(k))] = cache

    def _cache(
        self, role: str, peer: int, feature: str, k: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> RowCache:
        cache = self.caches.get((role, peer, feature, k))
        if cache is None:
            cache = self.caches[(role, peer, feature, k)] = RowCache(dim, self.capacity_rows, dtype, device)
        elif cache.device != device:  # restored from a checkpoint onto another device
            cache.to_(device)
        return cache

    def encode(
        self,
        dc: DirectionCodec,
        chunk: torch.Tensor,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        bounds: Bounds,
        dst: int,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """(payload for global rank ``dst``, the chunk as ``dst`` will decode it, row counts:
        ``unique_rows``, ``held_rows``, ``hit_rows``, ``moved_rows`` sent as differences, each
        also per feature as ``<name>/<feature>``). ``bounds``: per block, floats or a tensor."""
        if chunk.dtype != torch.float32:  # _delta_bound's rounding margin is fp32's
            raise TypeError(
                f"compression.forward.cache needs fp32 pooled embeddings, got a {chunk.dtype} chunk "
                "(turn the cache off for this run)"
            )
        firsts, inverse, idn = _unpack(ids)
        x = chunk.detach()
        looked, sums, largest, c = [], [], [], 0
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            rows = firsts[k]
            uid = idn[:, k].index_select(0, rows)
            cache = self._cache("send", dst, f, k, w, chunk.dtype, x.device)
            slots, held = cache.find(uid)
            cached = cache.peek(slots)  # rows not held are overwritten (_finish), never read
            exact = x[:, c : c + w].index_select(0, rows)
            # NaN compares false: a row with a NaN (exact or held) is never a hit
            hit = held & ((exact - cached).abs() <= bounds[k]).all(dim=1)
            moved = held & ~hit
            looked.append(Block(cache, uid, slots, held, moved, cached, exact))
            sums += [held.sum(), hit.sum()]
            largest.append(_largest(exact, cached, moved))
            c += w
        # the one host read of the blocks' classification: counts, and the bounds they need
        if looked:
            bounds_t = torch.as_tensor(bounds, dtype=torch.float64, device=x.device)
            read = torch.cat([torch.stack(sums).double(), torch.stack(largest).double(), bounds_t]).tolist()
        nb = len(looked)
        flags, bits, sends, sent_ids, coded_bounds, steps = [], [], [], [], [], []
        counts = dict.fromkeys(("unique_rows", "held_rows", "hit_rows", "moved_rows"), 0)
        for k, (f, b) in enumerate(zip(features, looked, strict=True)):
            n_held, n_hit, m, bound = int(read[2 * k]), int(read[2 * k + 1]), read[2 * nb + k], read[3 * nb + k]
            n_moved = n_held - n_hit
            room = _delta_bound(m, n_moved * b.exact.shape[1], bound)
            delta = self.deltas and room > 0 and n_moved > 0
            step = b.step(n_held, n_moved, delta)
            flags.append(int(delta))
            bits.append(compact(b.moved, b.held, n_held))
            em = b.exact.index_select(0, step.moved_at)
            sends.append(
                torch.cat(
                    [
                        b.exact.index_select(0, step.fresh_at),
                        em - b.cached.index_select(0, step.moved_at) if delta else em,
                    ]
                )
            )
            sent_ids.append(torch.cat([b.uid.index_select(0, step.fresh_at), b.uid.index_select(0, step.moved_at)]))
            coded_bounds.append(room if delta else bound)
            steps.append(step)
            block = {"unique_rows": b.uid.numel(), "held_rows": n_held, "hit_rows": n_hit}
            block["moved_rows"] = n_moved if delta else 0
            for name, n in block.items():
                counts[name] += n
                counts[f"{name}/{f}"] = counts.get(f"{name}/{f}", 0) + n
        inner = _code(dc, sends, sent_ids, widths, coded_bounds, x)
        out = torch.empty_like(x)
        _finish(steps, _decode(dc, inner, sent_ids, widths), inverse, widths, out)
        head = torch.tensor(flags, dtype=torch.uint8).to(x.device, non_blocking=True)
        packed = _packbits(torch.cat(bits)) if bits else head[:0]
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
        if out is None:
            out = torch.empty(ids.shape[0], sum(widths), dtype=torch.float32, device=payload.device)
        firsts, inverse, idn = _unpack(ids)
        nb = len(widths)
        looked = []
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            uid = idn[:, k].index_select(0, firsts[k])
            cache = self._cache("recv", src, f, k, w, out.dtype, out.device)
            slots, held = cache.find(uid)
            looked.append(Block(cache, uid, slots, held, held, cache.peek(slots), out[:0]))
        # host reads: the held counts with the flags (the bitmap's length), then the moved counts
        first = [torch.stack([b.held.sum() for b in looked]), payload[:nb].long()] if looked else []
        read = torch.cat(first).tolist() if looked else []
        held_counts, flags = read[:nb], read[nb:]
        n_held = sum(held_counts)
        n_bytes = (n_held + 7) // 8
        bits = _unpackbits(payload[nb : nb + n_bytes], n_held)
        inner = payload[nb + n_bytes :].clone()  # aligned (format.view_as fails on an empty misaligned section)
        at = 0
        for k, (b, h) in enumerate(zip(looked, held_counts, strict=True)):
            held_at = positions(b.held, h)
            looked[k] = b._replace(moved=torch.zeros_like(b.held).index_copy_(0, held_at, bits[at : at + h]))
            at += h
        moved_counts = torch.stack([b.moved.sum() for b in looked]).tolist() if looked else []
        sent_ids, steps = [], []
        for b, h, n_moved, flag in zip(looked, held_counts, moved_counts, flags, strict=True):
            step = b.step(h, n_moved, bool(flag))
            sent_ids.append(torch.cat([b.uid.index_select(0, step.fresh_at), b.uid.index_select(0, step.moved_at)]))
            steps.append(step)
        _finish(steps, _decode(dc, inner, sent_ids, widths), inverse, widths, out)
        return out


class CacheStage(Stage):
    """The row cache in the transport: training forwards by id, both sides deciding alike (they
    hold the same ids and training flag); statistics under ``forward/cache/``."""

    def __init__(self, cache: ForwardCache) -> None:
        self.cache = cache

    @staticmethod
    def _applies(direction: str, ids: torch.Tensor | None, dc: DirectionCodec) -> bool:
        return direction == "forward" and ids is not None and dc.dedup

    def encode(self, c: Outgoing) -> bool:
        if not (self._applies(c.direction, c.ids, c.dc) and c.bounds is not None):
            return False
        assert c.ids is not None
        c.payload, c.held, counts = self.cache.encode(
            c.dc, c.chunk, c.ids, c.blocks.features, c.blocks.widths, c.bounds, c.dst
        )
        for name, n in counts.items():
            if "/" not in name:  # totals (the per-feature counts serve the probe)
                c.stats.add(f"{c.direction}/cache/{name}", n)
        c.stats.maximum(f"{c.direction}/cache_bytes", self.cache.nbytes)
        return True

    def decode(self, r: Incoming) -> torch.Tensor | None:
        if not self._applies(r.direction, r.ids, r.dc):
            return None
        assert r.ids is not None
        try:
            part = self.cache.decode(r.dc, r.payload, r.ids, r.blocks.features, r.blocks.widths, r.src, out=r.window)
        except Exception as e:  # name the transfer, keep the cause chained
            raise CompressedCommError(
                f"rank {r.dst} ({r.where}): cannot decode the row-cached forward payload "
                f"({r.payload.numel()} bytes) from rank {r.src} carrying features {r.blocks.features} at "
                f"iteration {r.iteration}: {type(e).__name__}: {e}"
            ) from e
        r.stats.maximum("forward/cache_bytes", self.cache.nbytes)
        return part


class Step(NamedTuple):
    """One block's unique rows, as both sides rebuild them: where the fresh and the moved rows
    are among the block's unique ids, and whether moved rows travel as differences."""

    cache: RowCache
    uid: torch.Tensor
    slots: torch.Tensor
    n_held: int
    fresh_at: torch.Tensor
    moved_at: torch.Tensor
    unique: torch.Tensor  # the held rows gathered for this call (zeros where not held), then the result
    delta: bool


class Block(NamedTuple):
    """One block of a chunk as looked up in its cache (``exact``: its exact rows, sender only)."""

    cache: RowCache
    uid: torch.Tensor
    slots: torch.Tensor
    held: torch.Tensor
    moved: torch.Tensor
    cached: torch.Tensor
    exact: torch.Tensor

    def step(self, n_held: int, n_moved: int, delta: bool) -> Step:
        fresh_at = positions(~self.held, self.uid.numel() - n_held)
        return Step(
            self.cache, self.uid, self.slots, n_held, fresh_at, positions(self.moved, n_moved), self.cached, delta
        )


def _unpack(ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """Each block's first rows of its unique ids (ascending ids: the dedup plan's canonical order;
    the host reads the blocks' counts), the plan's inverse [n_blocks, rows] (None: identity), the ids."""
    plan = plan_by_ids(ids)
    firsts = list(plan.first.split(plan.counts.tolist()))
    return firsts, plan.inverse, ids


def _largest(exact: torch.Tensor, held: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of the moved rows' exact and held values (0-d; NaN kept)."""
    if exact.numel() == 0:
        return exact.new_zeros(())
    both = torch.maximum(exact.abs(), held.abs())
    return torch.where(moved.unsqueeze(1), both, 0).amax()


def _delta_bound(largest: float, n_values: int, bound: float) -> float:
    """The bound for the differences ``exact - held`` of moved rows (``n_values`` values whose
    largest magnitude is ``largest``): ``bound`` less what fp32 rounding of ``exact - held`` and of
    ``held + decoded`` can add (at most ~2.5 eps x the largest magnitude; 4 taken). Negative (send
    whole) where any value is non-finite: a NaN or inf difference cannot restore the exact value."""
    if n_values == 0:
        return bound
    room = bound - 4 * EPS * largest
    return room if math.isfinite(room) else -1.0


def _finish(
    steps: Sequence[Step],
    values: Sequence[torch.Tensor],
    inverse: torch.Tensor | None,
    widths: Sequence[int],
    out: torch.Tensor,
) -> None:
    """Per block: the unique rows as decoded (held for hits, decoded for fresh, held +
    difference for moved), stored the same way on both sides (which makes every id of the batch
    the most recent), then spread over the chunk's rows into ``out``."""
    c = 0
    for k, s in enumerate(steps):
        n_fresh, n_moved = s.fresh_at.numel(), s.moved_at.numel()
        unique = s.unique
        if n_fresh:
            unique.index_copy_(0, s.fresh_at, values[k][:n_fresh])
        if n_moved:
            moved_rows = values[k][n_fresh : n_fresh + n_moved]
            unique.index_copy_(
                0, s.moved_at, unique.index_select(0, s.moved_at) + moved_rows if s.delta else moved_rows
            )
        s.cache.store(s.uid, unique, s.slots, n_held=s.n_held)
        w = widths[k]
        out[:, c : c + w] = unique.index_select(0, inverse[k]) if inverse is not None else unique
        c += w


_BITS = (7, 6, 5, 4, 3, 2, 1, 0)  # np.packbits' order: the first bit is the most significant


def _packbits(bits: torch.Tensor) -> torch.Tensor:
    """``np.packbits`` of a bool tensor, on its device."""
    pad = -bits.numel() % 8
    b = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8).long()
    return (b << torch.tensor(_BITS, device=bits.device)).sum(1).to(torch.uint8)


def _unpackbits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """``np.unpackbits(packed, count=count)`` as bool, on its device."""
    shifts = torch.tensor(_BITS, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).bool().reshape(-1)[:count]


def _padded_ids(sent_ids: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[n, n_blocks] ids: shorter blocks repeat their first id, an empty block has id -1."""
    n = max([1, *(i.numel() for i in sent_ids)])
    out = torch.full((n, len(sent_ids)), -1, dtype=torch.int64, device=device)
    for k, i in enumerate(sent_ids):
        out[: i.numel(), k] = i
        if i.numel():
            out[i.numel() :, k] = i[:1]
    return out


def _code(
    dc: DirectionCodec,
    sends: Sequence[torch.Tensor],
    sent_ids: Sequence[torch.Tensor],
    widths: Sequence[int],
    bounds: Sequence[float],
    like: torch.Tensor,
) -> torch.Tensor:
    """One lossy payload of each block's rows ``sends[k]`` under ids ``sent_ids[k]``. Shorter
    blocks repeat their first row under its id (dedup sends it once); an empty block carries one
    zero row under id -1."""
    ids = _padded_ids(sent_ids, like.device)
    cols = like.new_zeros(ids.shape[0], sum(widths))
    c = 0
    for s, w in zip(sends, widths, strict=True):
        cols[: s.shape[0], c : c + w] = s
        if s.shape[0]:
            cols[s.shape[0] :, c : c + w] = s[:1]
        c += w
    return dc.encode(cols, widths, list(bounds), ids)


def _decode(
    dc: DirectionCodec, inner: torch.Tensor, sent_ids: Sequence[torch.Tensor], widths: Sequence[int]
) -> list[torch.Tensor]:
    """Each block's decoded rows of :func:`_code`'s payload (both sides rebuild the same ids)."""
    rows = dc.codec.decode(inner, _padded_ids(sent_ids, inner.device))
    starts = list(itertools.accumulate(widths, initial=0))
    return [rows[:, a:b] for a, b in itertools.pairwise(starts)]
