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
device. On the CPU (:meth:`ForwardCache.encode` / :meth:`~ForwardCache.decode`) the host reads the
sizes the payload's layout depends on, all blocks at once: per chunk, encode reads the blocks'
unique-id counts and then their held, hit and moved counts with the delta bounds' magnitudes;
decode the counts, then the held counts with the flags, then the moved counts (the codec's own
reads aside). On a device (:func:`on_device`: where the codec builds its payloads there) nothing
waits per chunk: every block is laid out at its capacity (the chunk's rows), the payload is a
format payload (sections: the lossy payload, the flags, the bits; the same rows, bit for bit)
with its length on the device, the sender takes what its peer decodes from the quantiser, and
what the host needs (the counts for the stores) comes with the collective's reads: the sender's
with the size exchange (:class:`~dlrm.embedding_comm.stage.Settle`), the receiver's with the
payloads' heads (:meth:`CacheStage.prepare_decode`). Whether a chunk's ids hold at all may come
with the size exchange too (``Outgoing.single``): the device then picks this payload or the
codec's of the chunk by value, and only the first touches the mirror.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dlrm.embedding_comm.bounds import Bounds
from dlrm.embedding_comm.codec import CompressedCommError, DirectionCodec
from dlrm.embedding_comm.stage import Incoming, Outgoing, Settle, Stage
from dlrm_compression import format as fmt
from dlrm_compression.backend import backend_for
from dlrm_compression.base import held_ids
from dlrm_compression.dedup import plan_by_ids, plan_capacity
from dlrm_compression.format import HostHead
from dlrm_compression.lossy import LossyCodec
from dlrm_compression.row_cache import RowCache, compact, positions

EPS = float(torch.finfo(torch.float32).eps)
PAYLOAD_ID = 11  # the format's codec id of the device payload (the codecs' ids run from 1 to 10)


class ForwardCache:
    """Every cache of one rank: (role, peer global rank, feature, block) -> rows.

    ``deltas=False`` sends moved rows whole (flag 0), a scheme the probe measures beside the cache.
    """

    def __init__(self, capacity_rows: int = 0, deltas: bool = True, backend: str = "auto") -> None:
        if capacity_rows < 0:
            raise ValueError(
                f"compression.forward.cache.capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}"
            )
        self.capacity_rows = capacity_rows
        self.deltas = deltas
        self.backend = backend  # where the caches' compactions run (compression.backend)
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
            device = saved["rows"].device
            cache = RowCache(
                int(saved["dim"]), self.capacity_rows, saved["rows"].dtype, device, backend_for(device, self.backend)
            )
            cache.load_state_dict(saved)
            self.caches[(str(role), int(peer), str(feature), int(k))] = cache

    def _cache(
        self, role: str, peer: int, feature: str, k: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> RowCache:
        cache = self.caches.get((role, peer, feature, k))
        if cache is None:
            cache = RowCache(dim, self.capacity_rows, dtype, device, backend_for(device, self.backend))
            self.caches[(role, peer, feature, k)] = cache
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
        _check_fp32(chunk)
        firsts, inverse, idn = _unpack(ids, backend_for(ids.device, self.backend).numpy_sorts)
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
            bits.append(compact(b.moved, b.held, n_held, b.cache.host))
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
        firsts, inverse, idn = _unpack(ids, backend_for(ids.device, self.backend).numpy_sorts)
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
            held_at = positions(b.held, h, b.cache.host)
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

    def encode_on_device(
        self,
        dc: DirectionCodec,
        chunk: torch.Tensor,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        bounds: Bounds,
        dst: int,
        single: torch.Tensor | None = None,
    ) -> tuple[fmt.Deferred, torch.Tensor, torch.Tensor, Callable[[list[int]], dict[str, int] | None]]:
        """:meth:`encode` with no host wait (:func:`on_device`): (the device payload with its
        length on the device, the chunk as ``dst`` will decode it, the blocks' counts as int64
        device values, and what stores the rows in the mirror once the host has those values,
        returning :meth:`encode`'s row counts). Every block is laid out at its capacity, the
        chunk's rows. ``single``: a 0-d bool on the device saying whether ``ids`` hold (not read
        yet); where they do not, the payload is the codec's of the chunk (by value, as sent
        without the cache), chosen on the device, and the mirror is left as it was (None)."""
        _check_fp32(chunk)
        x, nb, rows = chunk.detach(), len(widths), chunk.shape[0]
        bounds_t = _on(bounds, x.device)
        looked, inverse = self._look("send", dst, ids, features, widths, x.dtype, x.device)
        exact, cached, hit, c = [], [], [], 0
        for k, (b, w) in enumerate(zip(looked, widths, strict=True)):
            exact.append(x[:, c : c + w].index_select(0, b.first))
            cached.append(b.cache.peek(b.slots))  # rows not held are replaced, never read
            # NaN compares false: a row with a NaN (exact or held) is never a hit
            hit.append(b.held & ((exact[k] - cached[k]).abs() <= bounds_t[k]).all(dim=1))
            c += w
        moved = [b.held & ~h for b, h in zip(looked, hit, strict=True)]
        n_held = torch.stack([b.held.sum() for b in looked])
        n_moved = torch.stack([m.sum() for m in moved])
        largest = torch.stack([_largest(e, h, m) for e, h, m in zip(exact, cached, moved, strict=True)]).double()
        room = bounds_t - 4 * EPS * largest  # _delta_bound's, on the device
        delta = (n_moved > 0) & room.isfinite() & (room > 0) & self.deltas
        coded = torch.where(delta, room, bounds_t)
        sends, sent_ids = [], []
        for k, b in enumerate(looked):
            b = looked[k] = b.laid_out(moved[k])
            diff = torch.where((moved[k] & delta[k]).unsqueeze(1), exact[k] - cached[k], exact[k])
            sends.append(b.sent(diff, 0.0))
            sent_ids.append(b.sent(b.uid, -1))
        cols, sent = torch.cat(sends, 1), torch.stack(sent_ids, 1)
        if single is not None:  # the codec encodes the chunk itself where the ids do not hold
            cols, coded = torch.where(single, cols, x), torch.where(single, coded, bounds_t)
        inner = dc.encode_deferred(cols, widths, coded, sent, single=single)
        assert isinstance(dc.codec, LossyCodec)  # on_device() says so
        decoded = dc.codec.decoded(cols, coded, widths)
        unique = _merged(looked, decoded, cached, delta, widths)
        out = torch.empty_like(x)
        _spread(unique, inverse, widths, out)
        payload = _pack(x, widths, coded, inner, delta, _held_bits(looked, moved, rows))
        counts = torch.cat([torch.stack([b.n_unique for b in looked]), n_held, n_held - n_moved, delta.long()])
        if single is not None:
            payload, out = fmt.pick(single, payload, inner), torch.where(single, out, decoded)
            counts = torch.cat([counts, single.long().reshape(1)])

        def store(host: list[int]) -> dict[str, int] | None:
            if single is not None and not host[4 * nb]:
                return None  # the codec's payload went: no cache touched
            u, h, hits, deltas = (host[i * nb : (i + 1) * nb] for i in range(4))
            _store(looked, unique, u, h)
            out = dict.fromkeys(("unique_rows", "held_rows", "hit_rows", "moved_rows"), 0)
            for k, f in enumerate(features):
                block = {"unique_rows": u[k], "held_rows": h[k], "hit_rows": hits[k]}
                block["moved_rows"] = h[k] - hits[k] if deltas[k] else 0
                for name, n in block.items():
                    out[name] += n
                    out[f"{name}/{f}"] = out.get(f"{name}/{f}", 0) + n
            return out

        return payload, out, counts, store

    def prepare_on_device(
        self,
        dc: DirectionCodec,
        payload: torch.Tensor,
        ids: torch.Tensor,
        widths: Sequence[int],
        features: Sequence[str],
        src: int,
    ) -> tuple[int, torch.Tensor, Any]:
        """What :meth:`decode_on_device` needs the host to read for the payload from global rank
        ``src`` (its head, the rows each block holds), found without a host wait: (bytes of the
        payload's head, int64 device values, state)."""
        nb, rows = len(widths), ids.shape[0]
        looked, inverse = self._look("recv", src, ids, features, widths, torch.float32, payload.device)
        flags = nb + -nb % 8  # the flags' bytes, aligned: the held bits follow them
        tail = fmt.section_bytes(payload, nb, _SECTIONS, 1, flags + (nb * rows + 7) // 8)
        bits = _unpackbits(tail[flags:], nb * rows)
        held = torch.stack([b.held.sum() for b in looked])
        before = held.cumsum(0) - held
        for k, b in enumerate(looked):  # each held id's bit: the blocks' held ids follow one another
            at = (before[k] + b.held.cumsum(0) - 1).clamp_(0, nb * rows - 1)
            looked[k] = b.laid_out(b.held & bits.index_select(0, at))
        sent = torch.stack([b.sent(b.uid, -1) for b in looked], 1)
        assert isinstance(dc.codec, LossyCodec)  # on_device() says so
        codec, codec_state = dc.codec.prepare_decode(payload, sent) or (None, None)
        assert codec is not None  # sent ids (one row at least) on the device backend
        values = torch.cat([codec, torch.stack([b.n_unique for b in looked]), held])
        size = fmt.head_bytes(nb, _SECTIONS) + dc.codec.head_size(nb)
        return size, values, (looked, inverse, sent, codec_state)

    def decode_on_device(
        self,
        dc: DirectionCodec,
        payload: torch.Tensor,
        head: HostHead,
        widths: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`decode` of the device payload, its head and :meth:`prepare_on_device`'s values
        read: no host wait."""
        looked, inverse, sent, codec_state = head.state
        nb, rows = len(widths), sent.shape[0]
        header, sections = fmt.unpack(payload, head)
        if (header.codec_id, header.rows, header.widths, len(sections)) != (PAYLOAD_ID, rows, list(widths), _SECTIONS):
            raise fmt.PayloadError(
                f"not a row-cache payload of {rows} rows and blocks {list(widths)}: codec {header.codec_id}, "
                f"{header.rows} rows, blocks {header.widths}, {len(sections)} sections"
            )
        inner_head = HostHead(head.data[header.offsets[0] :], head.good, head.extra[: nb + 1], codec_state)
        assert isinstance(dc.codec, LossyCodec)  # on_device() says so
        decoded = dc.codec.decode(sections[0], sent, head=inner_head)
        delta = sections[1].bool()
        cached = [b.cache.peek(b.slots) for b in looked]
        unique = _merged(looked, decoded, cached, delta, widths)
        if out is None:
            out = torch.empty(rows, sum(widths), dtype=torch.float32, device=payload.device)
        _spread(unique, inverse, widths, out)
        _store(looked, unique, head.extra[nb + 1 : 2 * nb + 1], head.extra[2 * nb + 1 :])
        return out

    def _look(
        self,
        role: str,
        peer: int,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[list[Laid], torch.Tensor]:
        """Each block's unique ids at capacity (in ascending order, then padding) looked up in its
        cache, and the plan's inverse [n_blocks, rows]."""
        counts, first, inverse = plan_capacity(ids.to(device))
        live = torch.arange(ids.shape[0], device=device)
        out = []
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            uid = ids[:, k].to(device).index_select(0, first[k])
            cache = self._cache(role, peer, f, k, w, dtype, device)
            slots, held = cache.find(uid)
            valid = live < counts[k]
            out.append(Laid(cache, uid, slots, held & valid, valid, counts[k], first[k]))
        return out, inverse


def on_device(dc: DirectionCodec, device: torch.device, n_blocks: int) -> bool:
    """Whether the cache takes its device path here: where the codec builds its own payloads on
    the device (the Adler-32 check, the lossy codec), as both sides decide alike; elsewhere (the
    CPU) the host reads the sizes, as the codec does there."""
    return isinstance(dc.codec, LossyCodec) and not dc.codec.backend_for(device).reads_sizes and n_blocks > 0


class CacheStage(Stage):
    """The row cache in the transport: training forwards by id, both sides deciding alike (they
    hold the same ids and training flag); statistics under ``forward/cache/``. It sees no payload
    but its own: on a device they are deferred and prepared like the codec's, and on the CPU,
    where neither is, it reads for itself as the codec does there."""

    def __init__(self, cache: ForwardCache) -> None:
        self.cache = cache

    @staticmethod
    def _applies(direction: str, ids: torch.Tensor | None, dc: DirectionCodec) -> bool:
        return direction == "forward" and ids is not None and dc.dedup

    def encode(self, c: Outgoing) -> bool:
        if not (self._applies(c.direction, c.ids, c.dc) and c.bounds is not None):
            return False
        assert c.ids is not None
        features, widths = c.blocks.features, c.blocks.widths
        if not on_device(c.dc, c.chunk.device, len(widths)):
            ids = held_ids(c.ids, c.single)  # the host path reads per chunk anyway
            if ids is None:
                return False  # the codec's, by value
            c.payload, c.held, counts = self.cache.encode(c.dc, c.chunk, ids, features, widths, c.bounds, c.dst)
            self._count(c, counts)
            return True
        # where the ids are not read yet (c.single), the device picks the cache's payload or the codec's
        late, c.held, values, store = self.cache.encode_on_device(
            c.dc, c.chunk, c.ids, features, widths, c.bounds, c.dst, c.single
        )
        c.settle = Settle(values, lambda host: self._count(c, store(host)))
        if c.deferrable:
            c.payload = late
        else:  # wanted now (a stage measures the payloads as sent): its length and the counts read at once
            host = torch.cat([late.length.reshape(1), values]).tolist()
            c.payload, c.settle = late.take(host[0]), None
            self._count(c, store(host[1:]))
        return True

    def _count(self, c: Outgoing, counts: dict[str, int] | None) -> None:
        if counts is None:  # the ids did not hold: the codec's payload went
            return
        for name, n in counts.items():
            if "/" not in name:  # totals (the per-feature counts serve the probe)
                c.stats.add(f"{c.direction}/cache/{name}", n)
        c.stats.maximum(f"{c.direction}/cache_bytes", self.cache.nbytes)

    def decodes(self, r: Incoming) -> bool:
        return self._applies(r.direction, r.ids, r.dc)

    def prepare_decode(self, r: Incoming) -> tuple[int, torch.Tensor, Any] | None:
        if not (self._applies(r.direction, r.ids, r.dc) and on_device(r.dc, r.payload.device, len(r.blocks.widths))):
            return None
        assert r.ids is not None
        return self.cache.prepare_on_device(r.dc, r.payload, r.ids, r.blocks.widths, r.blocks.features, r.src)

    def decode(self, r: Incoming) -> torch.Tensor | None:
        if not self._applies(r.direction, r.ids, r.dc):
            return None
        assert r.ids is not None
        try:
            if r.head is not None:  # prepared (prepare_decode) and read with the collective's heads
                part = self.cache.decode_on_device(r.dc, r.payload, r.head, r.blocks.widths, out=r.window)
            else:
                part = self.cache.decode(
                    r.dc, r.payload, r.ids, r.blocks.features, r.blocks.widths, r.src, out=r.window
                )
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
        host = self.cache.host
        fresh_at = positions(~self.held, self.uid.numel() - n_held, host)
        moved_at = positions(self.moved, n_moved, host)
        return Step(self.cache, self.uid, self.slots, n_held, fresh_at, moved_at, self.cached, delta)


class Laid(NamedTuple):
    """One block of a chunk at capacity (its unique ids first, then padding), looked up in its
    cache; once :meth:`laid_out`, where its fresh then moved rows go in the payload."""

    cache: RowCache
    uid: torch.Tensor
    slots: torch.Tensor
    held: torch.Tensor
    valid: torch.Tensor  # the block's unique ids (not padding)
    n_unique: torch.Tensor  # how many (int64 0-d)
    first: torch.Tensor  # a row of the chunk holding each
    fresh: torch.Tensor | None = None
    moved: torch.Tensor | None = None
    place: torch.Tensor | None = None  # each unique id's row in the payload (fresh, moved; others past it)
    order: torch.Tensor | None = None  # the unique id of each payload row (padding: the first's)
    n_sent: torch.Tensor | None = None

    def laid_out(self, moved: torch.Tensor) -> Laid:
        """The block's fresh rows, then its ``moved`` ones, as :func:`_code` sends them."""
        rows = self.uid.numel()
        fresh = self.valid & ~self.held
        n_fresh = fresh.sum()
        place = torch.where(fresh, fresh.cumsum(0) - 1, torch.where(moved, n_fresh + moved.cumsum(0) - 1, rows))
        at = torch.arange(rows, device=place.device)
        order = at.new_zeros(rows + 1).index_copy_(0, place, at)[:rows]
        n_sent = n_fresh + moved.sum()
        order = torch.where(at < n_sent, order, order[:1])  # shorter blocks repeat their first row
        return self._replace(fresh=fresh, moved=moved, place=place, order=order, n_sent=n_sent)

    def sent(self, values: torch.Tensor, empty: float) -> torch.Tensor:
        """Per unique id ``values`` in payload order (:func:`_code`'s padding; ``empty`` for an
        empty block)."""
        assert self.order is not None and self.n_sent is not None
        rows = values.index_select(0, self.order)
        return torch.where((self.n_sent > 0).reshape((1,) * rows.dim()), rows, empty)


def _merged(
    looked: Sequence[Laid],
    decoded: torch.Tensor,
    cached: Sequence[torch.Tensor],
    delta: torch.Tensor,
    widths: Sequence[int],
) -> list[torch.Tensor]:
    """Per block, its unique rows as both sides hold them (:func:`_finish`'s, at capacity): held
    for hits, decoded for fresh, held + decoded difference for moved (whole where not ``delta``)."""
    out, c = [], 0
    for k, (b, w) in enumerate(zip(looked, widths, strict=True)):
        assert b.place is not None and b.fresh is not None and b.moved is not None
        got = decoded[:, c : c + w].index_select(0, b.place.clamp(max=b.uid.numel() - 1))
        moved = torch.where(delta[k], cached[k] + got, got)
        out.append(torch.where(b.fresh.unsqueeze(1), got, torch.where(b.moved.unsqueeze(1), moved, cached[k])))
        c += w
    return out


def _spread(unique: Sequence[torch.Tensor], inverse: torch.Tensor, widths: Sequence[int], out: torch.Tensor) -> None:
    """Each block's unique rows over the chunk's rows, into ``out``."""
    c = 0
    for k, (u, w) in enumerate(zip(unique, widths, strict=True)):
        out[:, c : c + w] = u.index_select(0, inverse[k])
        c += w


def _store(looked: Sequence[Laid], unique: Sequence[torch.Tensor], counts: Sequence[int], held: Sequence[int]) -> None:
    """Every block's unique rows into its cache, their counts now on the host (no wait)."""
    for b, u, n, h in zip(looked, unique, counts, held, strict=True):
        b.cache.store(b.uid[:n], u[:n], b.slots[:n], n_held=h)


def _held_bits(looked: Sequence[Laid], moved: Sequence[torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's bits of its held ids (1: moved), one block after another, packed at
    capacity, and their byte count (int64 0-d): the host path's bits, with no host wait."""
    n = len(looked) * rows
    bits = torch.zeros(n + 1, dtype=torch.bool, device=moved[0].device)
    ahead = torch.zeros((), dtype=torch.int64, device=bits.device)
    for b, m in zip(looked, moved, strict=True):
        at = torch.where(b.held, ahead + b.held.cumsum(0) - 1, n)
        bits.scatter_(0, at, m)
        ahead = ahead + b.held.sum()
    return _packbits(bits[:n]), (ahead + 7) // 8


def _pack(
    x: torch.Tensor,
    widths: Sequence[int],
    coded: torch.Tensor,
    inner: torch.Tensor | fmt.Deferred,
    delta: torch.Tensor,
    bits: tuple[torch.Tensor, torch.Tensor],
) -> fmt.Deferred:
    """The device payload: a format payload (its own check) of the sent rows' lossy payload
    first, where the host reads its head with the collective's, then the flags, then the bits."""
    header = fmt.Header(PAYLOAD_ID, x.dtype, x.shape[0], x.shape[1], list(widths), coded)
    rows: list[tuple[torch.Tensor, fmt.Length]] = (
        [(inner.buffer, inner.length)] if isinstance(inner, fmt.Deferred) else [(inner, inner.numel())]
    )
    flags = delta.to(torch.uint8)
    return fmt.pack_deferred(header, [rows, [(flags, flags.numel())], [bits]], x.device)


_SECTIONS = 3  # of the device payload


def _on(bounds: Bounds, device: torch.device) -> torch.Tensor:
    """The blocks' bounds as a float64 tensor on ``device`` (host numbers go up without waiting)."""
    if isinstance(bounds, torch.Tensor):
        return bounds.to(device, torch.float64)
    return torch.tensor(list(bounds), dtype=torch.float64).to(device, non_blocking=True)


def _check_fp32(chunk: torch.Tensor) -> None:
    if chunk.dtype != torch.float32:  # _delta_bound's rounding margin is fp32's
        raise TypeError(
            f"compression.forward.cache needs fp32 pooled embeddings, got a {chunk.dtype} chunk "
            "(turn the cache off for this run)"
        )


def _unpack(ids: torch.Tensor, numpy: bool) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """Each block's first rows of its unique ids (ascending ids: the dedup plan's canonical order;
    the host reads the blocks' counts), the plan's inverse [n_blocks, rows] (None: identity), the
    ids (``numpy``: the host backend's sorts)."""
    plan = plan_by_ids(ids, numpy=numpy)
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
