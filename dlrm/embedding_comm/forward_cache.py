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
``fresh ++ moved`` (padded, see :func:`.cache_layout.code`). Only training forwards use the
caches (evaluation sends as today); each rank's caches are part of its checkpoint
(:meth:`ForwardCache.state_dict`): a resumed run matches an uninterrupted one bit for bit.

A chunk's blocks are one structure (:class:`compression.row_cache.RowCaches`, per role and peer:
every block's held ids in one index, their rows in one table) and are looked up, classified,
laid out, merged and stored together, each block at its capacity (the chunk's rows, ``[blocks,
rows]``): a fixed number of operations on the chunk's own device whatever its number of
blocks, most of them one fused op each (:mod:`compression.row_ops`). On the CPU
(:meth:`ForwardCache.encode` / :meth:`~ForwardCache.decode`) the host reads the sizes the
payload's layout depends on, all blocks at once: encode reads the
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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dlrm.embedding_comm.bounds import Bounds
from dlrm.embedding_comm.cache_blocks import Block, SavedBlock
from dlrm.embedding_comm.cache_layout import (
    PAYLOAD_ID,
    SECTIONS,
    Columns,
    Laid,
    Look,
    first_rows,
    held_bits,
    laid_out,
    merge,
    moved_of,
    pack,
    unpackbits,
)
from dlrm.embedding_comm.cache_layout import (
    code as _code,
)
from dlrm.embedding_comm.cache_layout import (
    decode_rows as _decode,
)
from dlrm.embedding_comm.codec import CompressedCommError, DirectionCodec
from dlrm.embedding_comm.stage import Incoming, Outgoing, Settle, Stage
from dlrm_compression import format as fmt
from dlrm_compression import row_ops
from dlrm_compression.backend import backend_for
from dlrm_compression.base import held_ids
from dlrm_compression.dedup import id_plan
from dlrm_compression.format import HostHead
from dlrm_compression.lossy import LossyCodec
from dlrm_compression.row_cache import RowCaches

COUNTS = ("unique_rows", "held_rows", "hit_rows", "moved_rows")


class Classified(NamedTuple):
    """The sender's classification of a chunk's unique rows ([blocks, rows(, width)]), and per
    block its counts, whether moved rows travel as differences, and its payload's bound."""

    xp: torch.Tensor  # the chunk as [rows, blocks, width]
    moved: torch.Tensor
    n_held: torch.Tensor
    n_hit: torch.Tensor
    delta: torch.Tensor
    coded: torch.Tensor


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
        group = self._group(role, peer, features, widths, dtype, device)
        uid, valid, rows, held, keys = group.find_unique(keys, first, counts)
        return Look(group, Columns(widths), uid, valid, counts, first, inverse, rows, held, keys)

    def _classify(self, look: Look, x: torch.Tensor, bounds_t: torch.Tensor) -> Classified:
        """The sender's view of a chunk ``x``: which held rows are hits (within the block's bound
        of the held value; NaN never, the bound compared in the rows' fp32) and which moved, and
        each block's bound for its payload (its differences' where they travel as such: its bound
        less ``4 eps`` times its moved rows' largest magnitude). One op
        (:func:`compression.row_ops.row_classify`)."""
        xp = look.cols.padded(x)
        got = row_ops.row_classify(xp, look.first, look.group.table, look.rows, look.held, bounds_t, self.deltas)
        return Classified(xp, *got)

    def _sent(self, look: Look, c: Classified) -> tuple[Laid, torch.Tensor, torch.Tensor]:
        """The layout of every block's fresh then moved rows, and the payload's rows at capacity
        ([rows, columns], moved rows as differences where their block sends them so) with their
        ids [rows, blocks] (:func:`.cache_layout.code`'s padding): one op
        (:func:`compression.row_ops.row_sent`)."""
        laid = laid_out(look, c.moved)
        table = look.group.table
        rows, sent = row_ops.row_sent(
            c.xp, look.first, table, look.rows, c.moved, c.delta, laid.order, laid.empty, look.uid
        )
        return laid, look.cols.chunk(rows), sent.t()

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
        inner = _code(dc, first_rows(cols, n), first_rows(sent, n, -1), widths, host[5 * nb :])
        head = torch.tensor([int(d) for d in deltas], dtype=torch.uint8).to(x.device, non_blocking=True)
        bits = held_bits(look.held, c.moved)[0][: (sum(_ints(h)) + 7) // 8]
        payload = torch.cat([head, bits, inner])
        decoded = _decode(dc, inner, first_rows(sent, n, -1), widths)
        unique, out = merge(look, laid, first_rows(decoded, x.shape[0]), c.delta)
        look.group.store(look.keys, unique, look.rows, look.held, look.valid, _ints(u), _ints(h), laid.fresh)
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
        moved = moved_of(look.held, unpackbits(payload[nb : nb + n_bytes], sum(h)))
        laid = laid_out(look, moved)
        n = max([1, *laid.n_sent.tolist()])
        inner = payload[nb + n_bytes :].clone()  # aligned (format.view_as fails on an empty misaligned section)
        sent = laid.ids.t()
        decoded = _decode(dc, inner, first_rows(sent, n, -1), widths)
        delta = torch.tensor(flags, dtype=torch.bool).to(out.device, non_blocking=True)
        unique, _ = merge(look, laid, first_rows(decoded, ids.shape[0]), delta, out)
        look.group.store(look.keys, unique, look.rows, look.held, look.valid, u, h, laid.fresh)
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
        unique, out = merge(look, laid, decoded, c.delta)
        payload = pack(x, widths, coded, inner, c.delta, held_bits(look.held, c.moved))
        counts = torch.cat([look.counts, c.n_held, c.n_hit, c.delta])  # (int64: cat promotes the flags)
        if single is not None:
            payload, out = fmt.pick(single, payload, inner), torch.where(single, out, decoded)
            counts = torch.cat([counts, single.long().reshape(1)])

        def store(host: list[int]) -> dict[str, int] | None:
            if single is not None and not host[4 * nb]:
                return None  # the codec's payload went: no cache touched
            u, h, hits, deltas = (host[i * nb : (i + 1) * nb] for i in range(4))
            look.group.store(look.keys, unique, look.rows, look.held, look.valid, u, h, laid.fresh)
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
        nb = len(widths)
        look = self._look("recv", src, ids, features, widths, torch.float32, payload.device)
        flags = nb + -nb % 8  # the flags' bytes, aligned: the held bits follow them
        moved = row_ops.row_moved(payload, look.held, *fmt.section_one_at(nb, SECTIONS), flags)  # the bits
        laid = laid_out(look, moved)
        sent = laid.ids.t()
        assert isinstance(dc.codec, LossyCodec)  # on_device() says so
        codec, codec_state = dc.codec.prepare_decode(payload, sent) or (None, None)
        assert codec is not None  # sent ids (one row at least) on the device backend
        values = torch.cat([codec, look.counts, laid.n_held])
        size = fmt.head_bytes(nb, SECTIONS) + dc.codec.head_size(nb)
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
        if (header.codec_id, header.rows, header.widths, len(sections)) != (PAYLOAD_ID, rows, list(widths), SECTIONS):
            raise fmt.PayloadError(
                f"not a row-cache payload of {rows} rows and blocks {list(widths)}: codec {header.codec_id}, "
                f"{header.rows} rows, blocks {header.widths}, {len(sections)} sections"
            )
        inner_head = HostHead(head.data[header.offsets[0] :], head.good, head.extra[: nb + 1], codec_state)
        assert isinstance(dc.codec, LossyCodec)  # on_device() says so
        decoded = dc.codec.decode(sections[0], sent, head=inner_head)
        delta = sections[1].view(torch.bool)  # (0 or 1: the sender's flags, under the payload's check)
        unique, out = merge(look, laid, decoded, delta, out)
        look.group.store(
            look.keys,
            unique,
            look.rows,
            look.held,
            look.valid,
            head.extra[nb + 1 : 2 * nb + 1],
            head.extra[2 * nb + 1 :],
            laid.fresh,
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
