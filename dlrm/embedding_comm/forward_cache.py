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

A chunk's blocks are one structure (:class:`compression.row_cache.RowCaches`, per role and peer:
every block's held ids in one index, their rows in one table) and are looked up, classified,
laid out, merged and stored together, each block at its capacity (the chunk's rows, ``[blocks,
rows]``): a fixed number of whole-tensor operations on the chunk's own device whatever its
number of blocks. On the CPU (:meth:`ForwardCache.encode` / :meth:`~ForwardCache.decode`) the
host reads the sizes the payload's layout depends on, all blocks at once: encode reads the
blocks' counts with their coded bounds; decode the held counts with the flags, then the moved
counts (the codec's own reads aside). On a device (:func:`on_device`: where the codec builds its
payloads there) nothing waits per chunk: the payload is a format payload (sections: the lossy
payload, the flags, the bits; the same rows, bit for bit) with its length on the device, the
sender takes what its peer decodes from the quantiser, and what the host needs (the counts for
the stores) comes with the collective's reads: the sender's with the size exchange
(:class:`~dlrm.embedding_comm.stage.Settle`), the receiver's with the payloads' heads
(:meth:`CacheStage.prepare_decode`). Whether a chunk's ids hold at all may come with the size
exchange too (``Outgoing.single``): the device then picks this payload or the codec's of the
chunk by value, and only the first touches the mirror.
"""

from __future__ import annotations

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
from dlrm_compression.dedup import id_plan
from dlrm_compression.format import HostHead
from dlrm_compression.lossy import LossyCodec
from dlrm_compression.row_cache import RowCaches, _columns

EPS = float(torch.finfo(torch.float32).eps)
PAYLOAD_ID = 11  # the format's codec id of the device payload (the codecs' ids run from 1 to 10)
COUNTS = ("unique_rows", "held_rows", "hit_rows", "moved_rows")


class ForwardCache:
    """Every cache of one rank: per role (``send``: mirrors, ``recv``: what it holds), peer global
    rank and the chunk's blocks (features), one :class:`RowCaches`. ``caches`` shows them per
    (role, peer, feature, block) as before.

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
        self.groups: dict[tuple[str, int, tuple[str, ...]], RowCaches] = {}
        self._saved: dict[tuple[str, int, str, int], Mapping[str, Any]] = {}  # restored, not yet met

    @property
    def caches(self) -> dict[tuple[str, int, str, int], Block | SavedBlock]:
        """Every block's cache by (role, peer, feature, block)."""
        out = {(role, peer, f, k): Block(g, k) for (role, peer, fs), g in self.groups.items() for k, f in enumerate(fs)}
        return out | {key: SavedBlock(state) for key, state in self._saved.items()}

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups.values()) + sum(SavedBlock(s).nbytes for s in self._saved.values())

    def state_dict(self) -> dict[str, Any]:
        """This rank's caches, as [role, peer, feature, block, cache state] (for its checkpoint)."""
        return {"capacity_rows": self.capacity_rows, "caches": [[*k, c.state_dict()] for k, c in self.caches.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The saved caches are taken up by the first chunk of their role, peer and blocks, on
        its device."""
        self.groups = {}
        self._saved = {(str(r), int(p), str(f), int(k)): s for r, p, f, k, s in state.get("caches", [])}

    def _group(
        self,
        role: str,
        peer: int,
        features: Sequence[str],
        widths: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> RowCaches:
        key = (role, peer, tuple(features))
        group = self.groups.get(key)
        if group is None:
            group = RowCaches(widths, self.capacity_rows, dtype, device, backend_for(device, self.backend))
            saved = [self._saved.pop((role, peer, f, k), None) for k, f in enumerate(features)]
            if any(s is not None for s in saved):
                group.load_blocks(saved)
            self.groups[key] = group
        elif group.device != device:  # restored from a checkpoint onto another device
            group.to_(device)
        return group

    def _look(
        self,
        role: str,
        peer: int,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Look:
        """Every block's unique ids at capacity (ascending, then padding) looked up in its cache."""
        keys = ids.to(device)
        counts, first, inverse, _ = id_plan(keys)
        uid = keys.t().gather(1, first)
        valid = _column(first.shape[1], device) < counts[:, None]
        group = self._group(role, peer, features, widths, dtype, device)
        rows, held, keys = group.find(uid, valid)
        return Look(group, Columns(widths), uid, valid, counts, first, inverse, rows, held, keys)

    def _classify(self, look: Look, x: torch.Tensor, bounds_t: torch.Tensor) -> Classified:
        """The sender's view of a chunk ``x``: each unique row exact and held, which held rows
        are hits (within the block's bound of the held value) and which moved, and each block's
        bound for its payload (its differences' where they travel as such)."""
        exact = look.cols.blocks_of(x, look.first)
        cached = look.group.peek(look.rows)  # rows not held are replaced, never read
        diff = exact - cached
        # NaN compares false: a row with a NaN (exact or held) is never a hit; the bound compared
        # in the rows' fp32, as a 0-d bound would be
        hit = look.held & (diff.abs() <= bounds_t.float()[:, None, None]).all(2)
        moved = look.held ^ hit
        n_held, n_hit = look.held.sum(1), hit.sum(1)
        if x.shape[0]:
            both = torch.maximum(exact.abs(), cached.abs()).masked_fill_(~moved[..., None], 0)
            largest = both.amax((1, 2)).double()  # (NaN kept)
        else:
            largest = bounds_t.new_zeros(bounds_t.shape)
        room = bounds_t - 4 * EPS * largest  # _delta_bound's, on the device
        if self.deltas:  # some moved rows, and room left (finite: NaN and inf compare false)
            delta = (n_held > n_hit) & (room > 0) & (room < math.inf)
        else:
            delta = torch.zeros_like(n_hit, dtype=torch.bool)
        coded = torch.where(delta, room, bounds_t)
        return Classified(exact, cached, diff, hit, moved, n_held, n_hit, delta, coded)

    def _sent(self, look: Look, c: Classified) -> tuple[Laid, torch.Tensor, torch.Tensor]:
        """The layout of every block's fresh then moved rows, and the payload's rows at capacity
        ([rows, columns], moved rows as differences where their block sends them so) with their
        ids [rows, blocks] (:func:`_code`'s padding)."""
        laid = laid_out(look, c.moved, c.hit, c.n_hit)
        rows = torch.where((c.moved & c.delta[:, None])[..., None], c.diff, c.exact)
        return laid, look.cols.chunk_of(laid.sent(rows, 0.0)), laid.sent(look.uid, -1).t()

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
        x, nb = chunk.detach(), len(widths)
        if not nb:
            return dc.encode(x, [], [], ids), x.clone(), dict.fromkeys(COUNTS, 0)
        bounds_t = _on(bounds, x.device)
        look = self._look("send", dst, ids, features, widths, x.dtype, x.device)
        c = self._classify(look, x, bounds_t)
        laid, cols, sent = self._sent(look, c)
        # the one host read of the blocks' classification: counts, and the bounds they are coded at
        read = torch.cat([look.counts, c.n_held, c.n_hit, laid.n_sent, c.delta.long()])
        host = torch.cat([read.double(), c.coded]).tolist()
        u, h, hits, n_sent, deltas = (host[i * nb : (i + 1) * nb] for i in range(5))
        n = int(max([1, *n_sent]))
        inner = _code(dc, _rows(cols, n), _rows(sent, n, -1), widths, host[5 * nb :])
        head = torch.tensor([int(d) for d in deltas], dtype=torch.uint8).to(x.device, non_blocking=True)
        bits = _held_bits(look.held, c.moved)[0][: (sum(_ints(h)) + 7) // 8]
        payload = torch.cat([head, bits, inner])
        decoded = _decode(dc, inner, _rows(sent, n, -1), widths)
        unique = _merged(look, laid, look.cols.blocks(_rows(decoded, x.shape[0])), c.cached, c.delta)
        out = look.cols.spread(unique, look.inverse)
        look.group.store(look.keys, unique, look.rows, look.held, look.valid, _ints(u), _ints(h))
        return payload, out, _counts(features, u, h, hits, deltas)

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
        nb = len(widths)
        if out is None:
            out = torch.empty(ids.shape[0], sum(widths), dtype=torch.float32, device=payload.device)
        if not nb:
            return out.copy_(dc.codec.decode(payload, ids))
        look = self._look("recv", src, ids, features, widths, out.dtype, out.device)
        # host reads: the held counts with the flags (the bitmap's length), then the sent counts
        read = torch.cat([look.counts, look.held.sum(1), payload[:nb].long()]).tolist()
        u, h, flags = read[:nb], read[nb : 2 * nb], read[2 * nb :]
        n_bytes = (sum(h) + 7) // 8
        moved = _moved(look.held, _unpackbits(payload[nb : nb + n_bytes], sum(h)))
        laid = laid_out(look, moved, look.held ^ moved)
        n = max([1, *laid.n_sent.tolist()])
        inner = payload[nb + n_bytes :].clone()  # aligned (format.view_as fails on an empty misaligned section)
        sent = laid.sent(look.uid, -1).t()
        decoded = _decode(dc, inner, _rows(sent, n, -1), widths)
        delta = torch.tensor(flags, dtype=torch.bool).to(out.device, non_blocking=True)
        unique = _merged(look, laid, look.cols.blocks(_rows(decoded, ids.shape[0])), look.group.peek(look.rows), delta)
        look.cols.spread(unique, look.inverse, out)
        look.group.store(look.keys, unique, look.rows, look.held, look.valid, u, h)
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
        x, nb = chunk.detach(), len(widths)
        bounds_t = _on(bounds, x.device)
        look = self._look("send", dst, ids, features, widths, x.dtype, x.device)
        c = self._classify(look, x, bounds_t)
        laid, cols, sent = self._sent(look, c)
        coded = c.coded
        if single is not None:  # the codec encodes the chunk itself where the ids do not hold
            cols, coded = torch.where(single, cols, x), torch.where(single, coded, bounds_t)
        inner = dc.encode_deferred(cols, widths, coded, sent, single=single)
        assert isinstance(dc.codec, LossyCodec)  # on_device() says so
        decoded = dc.codec.decoded(cols, coded, widths, checked=True)  # (the bounds encode_deferred checks)
        unique = _merged(look, laid, look.cols.blocks(decoded), c.cached, c.delta)
        out = look.cols.spread(unique, look.inverse)
        payload = _pack(x, widths, coded, inner, c.delta, _held_bits(look.held, c.moved))
        counts = torch.cat([look.counts, c.n_held, c.n_hit, c.delta.long()])
        if single is not None:
            payload, out = fmt.pick(single, payload, inner), torch.where(single, out, decoded)
            counts = torch.cat([counts, single.long().reshape(1)])

        def store(host: list[int]) -> dict[str, int] | None:
            if single is not None and not host[4 * nb]:
                return None  # the codec's payload went: no cache touched
            u, h, hits, deltas = (host[i * nb : (i + 1) * nb] for i in range(4))
            look.group.store(look.keys, unique, look.rows, look.held, look.valid, u, h)
            return _counts(features, u, h, hits, deltas)

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
        look = self._look("recv", src, ids, features, widths, torch.float32, payload.device)
        flags = nb + -nb % 8  # the flags' bytes, aligned: the held bits follow them
        tail = fmt.section_bytes(payload, nb, _SECTIONS, 1, flags + (nb * rows + 7) // 8)
        moved = _moved(look.held, _unpackbits(tail[flags:], nb * rows))
        laid = laid_out(look, moved, look.held ^ moved)
        sent = laid.sent(look.uid, -1).t()
        assert isinstance(dc.codec, LossyCodec)  # on_device() says so
        codec, codec_state = dc.codec.prepare_decode(payload, sent) or (None, None)
        assert codec is not None  # sent ids (one row at least) on the device backend
        values = torch.cat([codec, look.counts, look.held.sum(1)])
        size = fmt.head_bytes(nb, _SECTIONS) + dc.codec.head_size(nb)
        return size, values, (look, laid, sent, codec_state)

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
        look, laid, sent, codec_state = head.state
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
        delta = sections[1].view(torch.bool)  # (0 or 1: the sender's flags, under the payload's check)
        unique = _merged(look, laid, look.cols.blocks(decoded), look.group.peek(look.rows), delta)
        out = look.cols.spread(unique, look.inverse, out)
        look.group.store(
            look.keys,
            unique,
            look.rows,
            look.held,
            look.valid,
            head.extra[nb + 1 : 2 * nb + 1],
            head.extra[2 * nb + 1 :],
        )
        return out


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


class Block:
    """One block's cache in its chunk's :class:`RowCaches` (the per-block view the tests and the
    checkpoint see)."""

    def __init__(self, group: RowCaches, k: int) -> None:
        self.group, self.k = group, k

    def ids(self) -> list[int]:
        """Held ids, least recent first."""
        return self.group.ids(self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.group.rows(self.k, ids)

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(held bool [n], rows: the held rows, zeros where not held)."""
        return self.group.lookup(self.k, ids)

    def __len__(self) -> int:
        return self.group.lengths()[self.k]

    def state_dict(self) -> dict[str, Any]:
        return self.group.block_state(self.k)


class SavedBlock:
    """A restored block's cache state, not yet taken up by a chunk."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    def _caches(self) -> RowCaches:
        caches = RowCaches([int(self.state["dim"])], int(self.state["capacity"]), self.state["rows"].dtype)
        caches.load_blocks([self.state])
        return caches

    def ids(self) -> list[int]:
        return self._caches().ids(0)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._caches().rows(0, ids)

    @property
    def nbytes(self) -> int:
        return self._caches().nbytes

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)


class Columns:
    """A chunk's column blocks (``widths``) as ``[blocks, rows, width]`` (narrower blocks padded
    with zeros to the widest), and back: views where every block has the same width."""

    def __init__(self, widths: Sequence[int]) -> None:
        self.widths = [int(w) for w in widths]
        self.n, self.width = len(self.widths), max(self.widths, default=0)
        self.equal = len(set(self.widths)) <= 1
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _map(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(each padded column's source column, the spare past the chunk's for padding; each
        chunk column's padded column)."""
        if device not in self._maps:
            total, c = sum(self.widths), 0
            src: list[int] = []
            back: list[int] = []
            for k, w in enumerate(self.widths):
                src += [*range(c, c + w), *[total] * (self.width - w)]
                back += range(k * self.width, k * self.width + w)
                c += w
            self._maps[device] = (torch.tensor(src).to(device), torch.tensor(back).to(device))
        return self._maps[device]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, columns] as [rows, blocks, width]."""
        if self.equal:
            return x.view(x.shape[0], self.n, self.width)
        src, _ = self._map(x.device)
        return torch.nn.functional.pad(x, (0, 1)).index_select(1, src).view(x.shape[0], self.n, self.width)

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, columns] as [blocks, rows, width] (a view where the widths are equal)."""
        return self.padded(x).transpose(0, 1)

    def blocks_of(self, x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """[blocks, q, width]: block k's row ``first[k, u]`` of ``x`` at u."""
        return self.padded(x)[first, _column(self.n, x.device).t()]

    def chunk_of(self, b: torch.Tensor) -> torch.Tensor:
        """[blocks, rows, width] as [rows, columns]."""
        x = b.transpose(0, 1).contiguous().view(b.shape[1], self.n * self.width)
        return x if self.equal else x.index_select(1, self._map(b.device)[1])

    def spread(self, unique: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each block's unique rows ``unique`` [blocks, q, width] over the chunk's rows (row r of
        block k: ``unique[k, inverse[k, r]]``), [rows, columns] (into ``out`` if given)."""
        rows = unique[_column(self.n, unique.device), inverse.t()]  # [rows, blocks, width]
        if not self.equal:
            got = rows.reshape(rows.shape[0], self.n * self.width).index_select(1, self._map(unique.device)[1])
            return got if out is None else out.copy_(got)
        if out is None:
            return rows.contiguous().view(rows.shape[0], self.n * self.width)
        out.view(rows.shape).copy_(rows)
        return out


class Look(NamedTuple):
    """Every block of a chunk at capacity (its unique ids ascending, then padding), looked up in
    its cache: [blocks, rows] each."""

    group: RowCaches
    cols: Columns
    uid: torch.Tensor
    valid: torch.Tensor  # the blocks' unique ids (not padding)
    counts: torch.Tensor  # how many per block (int64 [blocks])
    first: torch.Tensor  # a row of the chunk holding each
    inverse: torch.Tensor  # each chunk row's unique id, per block
    rows: torch.Tensor  # the cache's row holding each (0: not held)
    held: torch.Tensor
    keys: torch.Tensor  # their keys in the cache's index


class Classified(NamedTuple):
    """The sender's classification of a chunk's unique rows ([blocks, rows(, width)]), and per
    block its counts, whether moved rows travel as differences, and its payload's bound."""

    exact: torch.Tensor
    cached: torch.Tensor
    diff: torch.Tensor
    hit: torch.Tensor
    moved: torch.Tensor
    n_held: torch.Tensor
    n_hit: torch.Tensor
    delta: torch.Tensor
    coded: torch.Tensor


class Laid(NamedTuple):
    """Where every block's fresh rows, then its moved ones, go in the payload (both sides
    rebuild it from the held ids and the moved bits)."""

    fresh: torch.Tensor
    moved: torch.Tensor
    place: torch.Tensor  # each unique id's row in the payload (past its block's sent rows: another)
    order: torch.Tensor  # the unique id of each payload row (past the block's sent rows: its first's)
    n_sent: torch.Tensor
    empty: torch.Tensor  # blocks that send no row

    def sent(self, values: torch.Tensor, empty: float) -> torch.Tensor:
        """Per unique id ``values`` ([blocks, rows(, width)]) in payload order (:func:`_code`'s
        padding; ``empty`` for an empty block)."""
        index = self.order if values.dim() == 2 else self.order[..., None].expand(-1, -1, values.shape[2])
        return values.gather(1, index).masked_fill_(self.empty.view(-1, *(1,) * (values.dim() - 1)), empty)


def laid_out(look: Look, moved: torch.Tensor, hit: torch.Tensor, n_hit: torch.Tensor | None = None) -> Laid:
    """Every block's payload rows: its fresh rows, then its ``moved`` ones, each in ascending id
    order (a stable sort of every block's rows by kind: fresh, moved or padding, hits)."""
    fresh = look.valid ^ look.held
    kind = (~fresh).to(torch.uint8) + hit  # fresh 0, moved (and the padding after them) 1, hits 2
    order = torch.sort(kind, dim=1, stable=True).indices
    column = _column(order.shape[1], order.device)
    place = torch.empty_like(order).scatter_(1, order, column.expand_as(order))
    n_sent = look.counts - (hit.sum(1) if n_hit is None else n_hit)
    order = torch.where(column < n_sent[:, None], order, order[:, :1])  # shorter blocks repeat their first row
    return Laid(fresh, moved, place, order, n_sent, n_sent == 0)


def _merged(look: Look, laid: Laid, decoded: torch.Tensor, cached: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Every block's unique rows as both sides hold them, at capacity: held for hits, decoded
    for fresh, held + decoded difference for moved (whole where not ``delta``); ``decoded``:
    the payload's rows, [blocks, rows, width]."""
    got = decoded.gather(1, laid.place[..., None].expand(-1, -1, decoded.shape[2]))
    moved = torch.where(delta[:, None, None], cached + got, got)
    return torch.where(laid.fresh[..., None], got, torch.where(laid.moved[..., None], moved, cached))


def _moved(held: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Each held id's bit (1: moved), the blocks' held ids one after another in ``bits``."""
    at = held.reshape(-1).cumsum(0)  # a held id's rank (1-based): its bit after a leading 0
    return torch.nn.functional.pad(bits, (1, 0)).index_select(0, at).view_as(held) & held


def _held_bits(held: torch.Tensor, moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's bits of its held ids (1: moved), one block after another, packed at
    capacity, and their byte count (int64 0-d): the host path's bits, with no host wait."""
    n = held.numel()
    at = held.reshape(-1).cumsum(0)  # a held id's bit at its rank (1-based); the rest add nothing
    bits = torch.zeros(n + 8, dtype=torch.uint8, device=held.device)
    bits.scatter_add_(0, at, moved.reshape(-1).view(torch.uint8))
    return _packbits(bits[1 : 1 + n + -n % 8]), (at[-1] + 7) // 8 if n else at.new_zeros(())


def _counts(
    features: Sequence[str], u: Sequence[int], h: Sequence[int], hits: Sequence[int], deltas: Sequence[int]
) -> dict[str, int]:
    """:meth:`ForwardCache.encode`'s row counts from the blocks' counts read on the host."""
    out = dict.fromkeys(COUNTS, 0)
    for k, f in enumerate(features):
        block = {"unique_rows": int(u[k]), "held_rows": int(h[k]), "hit_rows": int(hits[k])}
        block["moved_rows"] = int(h[k] - hits[k]) if deltas[k] else 0
        for name, n in block.items():
            out[name] += n
            out[f"{name}/{f}"] = out.get(f"{name}/{f}", 0) + n
    return out


def _ints(values: Sequence[float]) -> list[int]:
    return [int(v) for v in values]


def _rows(x: torch.Tensor, n: int, fill: float = 0.0) -> torch.Tensor:
    """``x``'s first ``n`` rows, padded with ``fill`` rows where it has fewer."""
    if x.shape[0] >= n:
        return x[:n]
    return torch.cat([x, x.new_full((n - x.shape[0], *x.shape[1:]), fill)])


def _column(n: int, device: torch.device) -> torch.Tensor:
    """[1, n]: 0..n-1 (int64), made once per size and device."""
    return _columns(n, device)


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
    flags = delta.view(torch.uint8)
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


_BITS = (7, 6, 5, 4, 3, 2, 1, 0)  # np.packbits' order: the first bit is the most significant
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.tensor(_BITS, dtype=torch.uint8).to(device)
    return _SHIFTS[device]


_MASKS: dict[torch.device, torch.Tensor] = {}


def _masks(device: torch.device) -> torch.Tensor:
    if device not in _MASKS:
        _MASKS[device] = torch.tensor([1 << b for b in _BITS], dtype=torch.uint8).to(device)
    return _MASKS[device]


def _packbits(bits: torch.Tensor) -> torch.Tensor:
    """``np.packbits`` of 0/1 uint8 (or bool) values, a multiple of 8 of them, on their device."""
    b = bits.view(torch.uint8).view(-1, 8)
    return (b << _shifts(b.device)).sum(1, dtype=torch.uint8)


def _unpackbits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """``np.unpackbits(packed, count=count)`` as bool, on its device."""
    return ((packed.unsqueeze(1) & _masks(packed.device)) != 0).reshape(-1)[:count]


def _code(
    dc: DirectionCodec, cols: torch.Tensor, ids: torch.Tensor, widths: Sequence[int], bounds: Sequence[float]
) -> torch.Tensor:
    """One lossy payload of the blocks' payload rows ``cols`` [n, columns] under ``ids`` [n,
    blocks]: shorter blocks repeat their first row under its id (dedup sends it once); an empty
    block carries one zero row under id -1."""
    return dc.encode(cols, list(widths), list(bounds), ids)


def _decode(dc: DirectionCodec, inner: torch.Tensor, ids: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """The payload rows of :func:`_code`'s payload (both sides rebuild the same ids), [n, columns]."""
    return dc.codec.decode(inner, ids)
