"""Variable-size compressed all-to-all with autograd, in TorchRec's Req/Wait pattern.

Mirrors ``torchrec.distributed.comm_ops`` (``All2All_Pooled_Req`` / ``_Wait``): ``Req.forward``
encodes one payload per peer, exchanges the payload sizes (a blocking ``all_to_all_single`` of
``world_size`` int64 words) and launches the byte ``all_to_all_single`` with variable splits,
returning TorchRec's ``Request.dummy_tensor``; ``Wait.forward`` waits and decodes. In backward
``Wait.backward`` encodes the gradient and launches its exchange, ``Req.backward`` waits, decodes
and divides by the world size as TorchRec does (``GRADIENT_DIVISION``).

A layout says how a tensor is cut into per-peer chunks and where received chunks go:
:class:`PooledA2ALayout` (table/column-wise: rows out, columns back) and
:class:`ReduceScatterLayout` (row-wise: rows out and summed, the whole gradient back to every
rank). Chunks that are concatenated are decoded straight into their window of the output (no
concatenation copy); summed ones are decoded apart and added. A rank's own chunk never travels
and is never compressed.

Features act on the chunks through the stage interface (:mod:`dlrm.embedding_comm.stage`): each
collective call carries its stages, which the transport calls in order, naming none of them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.autograd import Function
from torchrec.distributed.comm_ops import Request, get_gradient_division

from dlrm.embedding_comm.codec import CompressedCommError, DirectionCodec, abs_error, raise_unless_sound
from dlrm.embedding_comm.ids import PendingIds, sum_duplicates
from dlrm.embedding_comm.stage import Blocks, Incoming, Outgoing, Settle, Stage
from dlrm.embedding_comm.stats import CommStats
from dlrm.process.instrument import embedding_collective, on_the_wire, payload_hooked
from dlrm.process.timeout import named_collective
from dlrm_compression.dedup import distinct_rows, first_capacity
from dlrm_compression.format import Deferred, HostHead, read_heads, settle
from dlrm_compression.sparse import Threshold


class PooledA2ALayout:
    """Table/column-wise: rows go to their sample's rank; each owner gets its columns' gradient."""

    def __init__(self, rank: int, batch_size_per_rank: Sequence[int], blocks_per_rank: Sequence[Blocks]) -> None:
        self.rank, self.bs, self.blocks = rank, list(batch_size_per_rank), list(blocks_per_rank)

    def split(self, direction: str, x: torch.Tensor) -> list[torch.Tensor]:
        if direction == "forward":
            return list(x.split(self.bs, dim=0))
        return list(x.split([b.dim for b in self.blocks], dim=1))

    def features(self) -> list[str]:
        """Every feature that crosses this collective, from any rank (the same list on every rank)."""
        return [f for b in self.blocks for f in b.features]

    def send_blocks(self, direction: str, peer: int) -> Blocks:
        return self.blocks[self.rank] if direction == "forward" else self.blocks[peer]

    def recv_blocks(self, direction: str, peer: int) -> Blocks:
        return self.blocks[peer] if direction == "forward" else self.blocks[self.rank]

    def recv_shape(self, direction: str, peer: int) -> tuple[int, int]:
        if direction == "forward":
            return self.bs[self.rank], self.blocks[peer].dim
        return self.bs[peer], self.blocks[self.rank].dim

    def output(self, direction: str, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The merged output and each peer's window of it (columns forward, rows backward)."""
        shapes = [self.recv_shape(direction, p) for p in range(len(self.bs))]
        dim = 1 if direction == "forward" else 0
        size = [shapes[0][0], sum(s[1] for s in shapes)] if dim else [sum(s[0] for s in shapes), shapes[0][1]]
        out = like.new_empty(size)
        return out, list(out.split([s[dim] for s in shapes], dim=dim))


class ReduceScatterLayout:
    """Row-wise: every rank holds partial sums of every sample; rows go to their sample's rank
    and are summed there (in source-rank order); the gradient goes back whole to every rank."""

    def __init__(self, rank: int, rows_per_rank: Sequence[int], blocks: Blocks, world_size: int) -> None:
        self.rank, self.bs, self.blocks, self.ws = rank, list(rows_per_rank), blocks, world_size

    def split(self, direction: str, x: torch.Tensor) -> list[torch.Tensor]:
        if direction == "forward":
            return list(x.split(self.bs, dim=0))
        return [x] * self.ws  # the same tensor: encoded once, sent to every peer

    def features(self) -> list[str]:
        return list(self.blocks.features)

    def send_blocks(self, direction: str, peer: int) -> Blocks:
        return self.blocks

    recv_blocks = send_blocks

    def recv_shape(self, direction: str, peer: int) -> tuple[int, int]:
        return (self.bs[self.rank] if direction == "forward" else self.bs[peer]), self.blocks.dim

    def output(self, direction: str, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Backward: the whole gradient, each peer's rows a window of it; forward sums (None)."""
        if direction == "forward":
            return None
        out = like.new_empty(sum(self.bs), self.blocks.dim)
        return out, list(out.split(self.bs, dim=0))

    def merge(self, direction: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """Forward: the partial sums, added in source-rank order."""
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out


@dataclass
class CompressedA2AInfo:
    """One collective's plan for both directions (the analogue of TorchRec's All2AllPooledInfo)."""

    layout: PooledA2ALayout | ReduceScatterLayout
    codecs: dict[str, DirectionCodec]  # "forward" / "backward"
    # Ids of the rows sent to / received from each peer in forward (None: value dedup); the
    # backward sends to the forward's sources, so it uses them the other way round.
    fwd_send_ids: list[torch.Tensor | None]
    fwd_recv_ids: list[torch.Tensor | None]
    stats: CommStats
    iteration: int
    sample: bool  # measure errors and per-feature sizes on this call
    where: str  # names the sharding in error messages
    global_ranks: list[int] = field(default_factory=list)
    feature_tables: dict[str, str] = field(default_factory=dict)  # for error messages
    # Multiplies the policy's bounds per direction, so that errors that add up (row-wise partial
    # sums, the two stages of table-row-wise) stay within the policy's bound in total.
    bound_scale: dict[str, float] = field(default_factory=lambda: {"forward": 1.0, "backward": 1.0})
    training: bool = True  # a training forward (evaluation refreshes no DCT-MP threshold)
    collective: str = "a2a"  # "a2a" or "reduce_scatter" (table-row-wise runs both, each with its own thresholds)
    stages: list[Stage] = field(default_factory=list)  # the features acting on this call's chunks, in order
    # The forward's ids before the read of which chunks are single-valued ([send, recv] per peer):
    # the forward's first read settles them into fwd_send_ids / fwd_recv_ids.
    pending_ids: PendingIds | None = None

    def settle_ids(self, single: list[bool]) -> None:
        """Keep the ids of the chunks ``single`` (the pending flags, read) says have them."""
        assert self.pending_ids is not None
        self.fwd_send_ids, self.fwd_recv_ids = self.pending_ids.settle(single)
        self.pending_ids = None

    def send_ids(self, direction: str) -> list[torch.Tensor | None]:
        return self.fwd_send_ids if direction == "forward" else self.fwd_recv_ids

    def recv_ids(self, direction: str) -> list[torch.Tensor | None]:
        return self.fwd_recv_ids if direction == "forward" else self.fwd_send_ids


@dataclass
class _Transfer:
    """An exchange in flight: the async work, the receive buffer and sizes, our own chunk."""

    work: dist.Work | None
    recv_buf: torch.Tensor
    recv_sizes: list[int]
    self_part: torch.Tensor
    raw: bool = False  # the rows as they are (see _send_raw), sizes in elements


class _Sampled:
    """The chunk a sampled collective measures, kept until the size exchange has settled its
    payload (the transport encodes it like the others)."""

    def __init__(
        self,
        c: Outgoing,
        thresholds: list[Threshold] | None,
        late: torch.Tensor | Deferred,
        single: torch.Tensor | None,
        me: int,
        info: CompressedA2AInfo,
    ) -> None:
        self.c, self.thresholds, self.late, self.single, self.info = c, thresholds, late, single, info
        self.me = me  # for a failure's message

    @property
    def ids(self) -> torch.Tensor | None:
        """The ids the chunk was encoded with (read by then where the device chose them)."""
        return self.c.ids if self.single is None else self.info.send_ids(self.c.direction)[self.c.peer]


def _sample(s: _Sampled, payload: torch.Tensor, stats: CommStats) -> None:
    """Sender-side sampling of one chunk: decode our own payload (or take what an encoding stage
    says the destination holds) for each table's error, encode each table alone for its size,
    count the rows each table gives the codec; every figure read in one host synchronisation
    (on a device the decode reads its head too): a fixed few per sampled collective, whatever the
    tables."""
    c, d, dc, blocks = s.c, s.c.direction, s.c.dc, s.c.blocks
    chunk, bounds, ids, widths = c.chunk, c.bounds, s.ids, list(blocks.widths)
    if c.summed and ids is not None:  # what the codec sent: each id's rows summed (every row holds its sum)
        chunk = sum_duplicates(chunk, ids, widths)
    decoded = c.held
    if decoded is None:  # our own payload, its head read as a receiver reads it
        prepared = _codec_prepared(dc, payload, ids, blocks)
        head = _read_prepared([payload], [prepared])[0] if prepared is not None else None
        decoded = dc.decode(
            payload, (chunk.shape[0], blocks.dim), ids, head=head, src=s.me, dst=s.me, features=blocks.features,
            tables=sorted({s.info.feature_tables.get(f, f) for f in blocks.features}), iteration=s.info.iteration,
            where=f"{s.info.where}, sampling its own payload", keep_first=False,
        )  # fmt: skip
    starts = [0, *itertools.accumulate(widths)]
    live = [k for k, w in enumerate(widths) if w] if chunk.shape[0] else []
    figures = [_distinct_rows(chunk, widths, ids, dc.dedup)]
    if live:
        col_err = abs_error(decoded.float(), chunk.float()).amax(dim=0)
        errors = torch.stack([col_err[starts[k] : starts[k + 1]].max() for k in live]).double()
        figures.append(errors)
        if bounds is not None:
            b = torch.as_tensor([bounds[k] for k in live] if isinstance(bounds, list) else bounds[live])
            b = b.to(errors)
            zero_or_inf = torch.where(errors == 0, 0.0, torch.inf).to(errors)
            figures.append(torch.where(b > 0, errors / b.clamp_min(torch.finfo(torch.float64).tiny), zero_or_inf))
        solo = []
        for k in live:
            part = dc.encode_deferred(
                chunk[:, starts[k] : starts[k + 1]],
                [widths[k]],
                None if bounds is None else bounds[k : k + 1],
                None if ids is None else ids[:, k : k + 1],
                None if s.thresholds is None else [s.thresholds[k]],
                [blocks.features[k]],
            )
            solo.append(part.length if isinstance(part, Deferred) else torch.tensor(part.numel()))
        figures.append(torch.stack([n.to(errors.device) for n in solo]).double())
    read = iter(torch.cat([f.to(figures[0].device, torch.float64) for f in figures]).tolist())
    rows = [int(next(read)) for _ in widths]
    errs = [next(read) for _ in live]
    over = [next(read) for _ in live] if live and bounds is not None else []
    sizes = [int(next(read)) for _ in live]
    elt = chunk.element_size()
    for i, k in enumerate(live):
        f, w = blocks.features[k], widths[k]
        stats.maximum(f"{d}/max_abs_error/{f}", errs[i])
        stats.maximum(f"{d}/max_abs_error", errs[i])
        if over:
            stats.maximum(f"{d}/max_error_over_bound", over[i])
        stats.add(f"{d}/sampled_raw_bytes/{f}", chunk.shape[0] * w * elt)
        stats.add(f"{d}/sampled_wire_bytes/{f}", sizes[i])
    # the rows each table gives the codec and their bytes against the chunk's, per mode (``ids``:
    # chunks with single ids; ``rows``: the rest, e.g. row-wise partial sums), so that
    # dlrm/telemetry/wire.py knows the codec's ratio on what it is given (dlrm/placement/traffic.py
    # predicts the rows)
    mode = "ids" if ids is not None else "rows"
    for f, n in zip(blocks.features, rows, strict=True):
        stats.add(f"{d}/sampled_chunks/{f}", 1)
        stats.add(f"{d}/sampled_rows/{f}", n)
    stats.add(f"{d}/sampled_given_bytes/{mode}", sum(n * w for n, w in zip(rows, widths, strict=True)) * elt)
    stats.add(f"{d}/sampled_chunk_bytes/{mode}", chunk.numel() * elt)


def _timed(fn: Any, *args: Any) -> float:
    """Seconds ``fn(*args)`` took."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _distinct_rows(chunk: torch.Tensor, widths: list[int], ids: torch.Tensor | None, dedup: bool) -> torch.Tensor:
    """Per table, the rows the codec is given, on the chunk's device: its distinct ids, or its
    distinct rows by value, when the codec dedups; else all its rows."""
    if not dedup or not widths:
        return torch.full((len(widths),), chunk.shape[0], dtype=torch.int64, device=chunk.device)
    if ids is not None:
        return first_capacity(ids)[0]
    return distinct_rows(chunk, widths)


def _count_raw(stats: CommStats, d: str, chunk: torch.Tensor, blocks: Blocks) -> None:
    """The raw (fp32) bytes of a chunk sent to one peer, per table and in total."""
    elt = chunk.element_size()
    for f, w in zip(blocks.features, blocks.widths, strict=True):
        stats.add(f"{d}/raw_bytes/{f}", chunk.shape[0] * w * elt)
    stats.add(f"{d}/raw_bytes", chunk.numel() * elt)


def _a2a_name(info: CompressedA2AInfo, d: str) -> str:
    return f"the {d} pooled-embedding all-to-all ({info.where}, iteration {info.iteration})"


def _send_raw(pg: dist.ProcessGroup, info: CompressedA2AInfo, d: str, chunks: list[torch.Tensor]) -> _Transfer:
    """compression=auto with every table of the collective at ``none``: TorchRec's own exchange,
    the rows as they are (no id dedup, framing or size exchange: both sides know the shapes), so
    that choosing ``none`` costs what ``compression=none`` costs. Every rank decides alike: the
    plan and the collective's features are the same everywhere."""
    layout, stats = info.layout, info.stats
    me, ws = pg.rank(), pg.size()
    t0 = time.perf_counter()
    peers = [p for p in range(ws) if p != me]
    send_sizes = [0 if p == me else chunks[p].numel() for p in range(ws)]
    recv_sizes = [0 if p == me else math.prod(layout.recv_shape(d, p)) for p in range(ws)]
    like = chunks[me]
    send_buf = torch.cat([chunks[p].reshape(-1) for p in peers]) if peers else like.new_empty(0)
    recv_buf = like.new_empty(sum(recv_sizes))
    for p in peers:
        chunk, blocks = chunks[p], layout.send_blocks(d, p)
        _count_raw(stats, d, chunk, blocks)
        if info.sample and chunk.numel():  # exact rows: each table's sampled wire bytes are its raw bytes
            for f, w in zip(blocks.features, blocks.widths, strict=True):
                stats.add(f"{d}/sampled_raw_bytes/{f}", chunk.shape[0] * w * chunk.element_size())
                stats.add(f"{d}/sampled_wire_bytes/{f}", chunk.shape[0] * w * chunk.element_size())
                stats.maximum(f"{d}/max_abs_error/{f}", 0.0)
    t1 = time.perf_counter()
    with embedding_collective(d), named_collective(_a2a_name(info, d)):
        work = dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=pg, async_op=True)
    t2 = time.perf_counter()
    stats.add(f"{d}/wire_bytes", sum(send_sizes) * like.element_size())
    stats.add(f"{d}/codec_ms", 1e3 * (t1 - t0))
    stats.add(f"{d}/comm_ms", 1e3 * (t2 - t1))
    stats.add(f"{d}/calls", 1)
    return _Transfer(work, recv_buf, recv_sizes, like, raw=True)


_NO_LIMIT = 2**62  # no stored form (a stage's payload, or one whose size the host knows)


def _stored_size(c: Outgoing) -> int:
    rows, cols = c.chunk.shape
    return c.dc.stored_size((rows, cols), c.chunk.dtype)


def _store(c: Outgoing) -> torch.Tensor:
    """``c`` stored (:meth:`DirectionCodec.stored_size`): the rows as the codec would have sent
    them (each id's sum where it sums them), which the peer then holds exactly."""
    chunk = sum_duplicates(c.chunk, c.ids, c.blocks.widths) if c.summed and c.ids is not None else c.chunk
    c.held = chunk
    c.stats.add(f"{c.direction}/stored_chunks", 1)
    return c.dc.store(chunk)


def _store_larger(payloads: list[torch.Tensor | Deferred | None], coded: dict[int, Outgoing]) -> None:
    """Store, in place, every coded payload whose size the host knows and that is no smaller than
    its chunk's stored form (a payload sent to several peers is stored once)."""
    stored: dict[int, torch.Tensor] = {}
    for q, c in coded.items():
        p = payloads[q]
        if isinstance(p, torch.Tensor) and p.numel() >= _stored_size(c):
            if id(p) not in stored:
                stored[id(p)] = _store(c)
            payloads[q] = stored[id(p)]


def _send(pg: dist.ProcessGroup, info: CompressedA2AInfo, d: str, chunks: list[torch.Tensor]) -> _Transfer:
    """Encode a chunk per peer (through the call's stages), exchange sizes, launch the async byte
    all-to-all."""
    layout, dc, stats, stages = info.layout, info.codecs[d], info.stats, info.stages
    me, ws = pg.rank(), pg.size()
    device = chunks[me].device
    # Payloads may keep their lengths on the device until the size exchange reads them all at
    # once, unless a stage looks at them (it would read each).
    defer = not any(s.sees_payloads(d) for s in stages)
    settles: list[Settle] = []  # what encoding stages read with the sizes
    # Which chunks have ids can wait for that read too where the codec picks ids or rows on the
    # device and no stage looks at the ids before they are encoded.
    raw = not any(s.needs_codec(d) for s in stages) and dc.passthrough(layout.features())
    pending = info.pending_ids
    later = (
        pending is not None
        and not raw
        and defer
        and not payload_hooked()  # (a test's hook sees the payloads, sampled ones too, before that read)
        and dc.picks_ids_on_device(device)
        and not any(s.reads_ids(d) for s in stages)
    )
    if pending is not None and not later:
        info.settle_ids(pending.single.tolist())  # the forward's read of which chunks have ids
    if raw:
        return _send_raw(pg, info, d, chunks)
    ids_per_peer = info.send_ids(d)
    send_flags: list[torch.Tensor | None] = [None] * ws
    if later:
        assert pending is not None
        ids_per_peer, send_flags = pending.candidates[0], pending.flags()[0]
    t0 = time.perf_counter()
    payloads: list[torch.Tensor | Deferred | None] = [None] * ws
    memo: dict[int, torch.Tensor | Deferred] = {}  # the same chunk object (row-wise backward) is encoded once
    reuse = not any(s.per_peer(d) for s in stages)
    policy: dict[int, list[float]] = {}
    sample, sample_s = info.sample, 0.0
    sampled: _Sampled | None = None
    coded: dict[int, Outgoing] = {}  # the chunks the codec encoded, which may travel stored
    memo_coded: dict[int, Outgoing] = {}
    for i in range(1, ws):
        peer = (me + i) % ws
        chunk, ids, single = chunks[peer], ids_per_peer[peer], send_flags[peer]
        if chunk.numel() == 0:
            continue  # both sides know the shape: nothing to send
        blocks = layout.send_blocks(d, peer)
        _count_raw(stats, d, chunk, blocks)
        if ids is None and id(chunk) in memo and reuse:
            payloads[peer] = memo[id(chunk)]
            if id(chunk) in memo_coded:
                coded[peer] = memo_coded[id(chunk)]
        else:
            key = id(blocks)
            if key not in policy:
                policy[key] = [v * info.bound_scale[d] for v in dc.policy(blocks.features, info.iteration)]
            # Relative bounds come from the rows as produced, before duplicate-id gradients are
            # summed: the summed rows of frequent ids would set a range under which the gradients
            # of rare ids vanish (at a batch of 2,048, 35-85% of rows decoded as zero).
            bounds = dc.bounds(chunk, blocks.widths, policy[key])
            # (ids that may not hold go with their device flag: only stages that take it see them)
            c = Outgoing(d, peer, info.global_ranks[peer], chunk, ids, blocks, bounds, dc, stats, single=single)
            c.deferrable = defer  # (a sampled chunk is measured after the size read, like the others)
            for s in stages:
                s.before_encode(c)
            thresholds = dc.thresholds(
                c.chunk, blocks.features, blocks.widths, info.iteration, info.training, info.collective
            )
            late: torch.Tensor | Deferred | None
            if not any(s.encode(c) for s in stages):
                coded[peer] = c
                if defer:  # (a stage may not defer a sampled chunk; the codec's is measured below)
                    late = dc.encode_deferred(
                        c.chunk, blocks.widths, bounds, ids, thresholds, blocks.features, single, c.summed
                    )
                else:
                    late = c.payload = dc.encode(
                        c.chunk, blocks.widths, bounds, ids, thresholds, blocks.features, c.summed
                    )
            else:
                late = c.payload
                if c.settle is not None:
                    settles.append(c.settle)
            assert late is not None
            for s in stages:
                ts = time.perf_counter()
                if s.measure(c):
                    sample_s += time.perf_counter() - ts
            if sample:  # measured once its bytes are known (below)
                sampled = _Sampled(c, thresholds, late, single, info.global_ranks[me], info)
                sample = False
            if ids is None:  # no ids, settled or pending
                memo[id(chunks[peer])] = late
                if peer in coded:
                    memo_coded[id(chunks[peer])] = coded[peer]
            payloads[peer] = late
    if payload_hooked():  # a test's hook sees (and may cut) each payload: their bytes first
        payloads = settle(payloads)  # type: ignore[assignment]
    _store_larger(payloads, coded)
    if payload_hooked():
        ready = cast(list[torch.Tensor | None], payloads)
        if sampled is not None:  # as encoded, before the hook
            sample_s += _timed(_sample, sampled, ready[sampled.c.peer], stats)
            sampled = None
        payloads = [
            None
            if p is None
            else on_the_wire(
                p, src=info.global_ranks[me], dst=info.global_ranks[q], direction=d, iteration=info.iteration
            )
            for q, p in enumerate(ready)
        ]
    t1 = time.perf_counter()
    # the sizes; where a coded payload's length is still on the device, the smaller of it and its
    # stored form's (the same upload, one op), the payload chosen once the sizes are read
    limits = {q: _stored_size(coded[q]) for q, p in enumerate(payloads) if isinstance(p, Deferred) and q in coded}
    host = [p.numel() if isinstance(p, torch.Tensor) else 0 for p in payloads]
    upload = torch.tensor(host + [limits.get(q, _NO_LIMIT) for q in range(ws) if limits], dtype=torch.int64)
    sizes = upload.to(device, non_blocking=True)
    for q, p in enumerate(payloads):
        if isinstance(p, Deferred):
            sizes[q] = p.length
    if limits:
        sizes = torch.minimum(sizes[:ws], sizes[ws:])
    recv_t = torch.empty(ws, dtype=torch.int64, device=device)
    with embedding_collective(d), named_collective(f"the size exchange of {_a2a_name(info, d)}"):
        dist.all_to_all_single(recv_t, sizes, group=pg)
    flags = pending.single.to(device, torch.int64) if later and pending is not None else sizes[:0]
    # the collective's one host synchronisation: the sizes, which chunks have ids, and what
    # encoding stages left to read
    both = torch.cat([sizes, recv_t, flags, *(s.values for s in settles)]).tolist()
    send_sizes, recv_sizes = both[:ws], both[ws : 2 * ws]
    at = 2 * ws + flags.numel()
    if later:  # the receive side, the backward and sampling need the ids as they are
        info.settle_ids([bool(v) for v in both[2 * ws : at]])
    for read in settles:
        read.then(both[at : at + read.values.numel()])
        at += read.values.numel()
    stored: dict[int, torch.Tensor] = {}  # a payload sent to several peers is stored once
    for q, limit in limits.items():
        if send_sizes[q] == limit:
            late = payloads[q]
            if id(late) not in stored:
                stored[id(late)] = _store(coded[q])
            payloads[q] = stored[id(late)]
    sent = [
        p.take(n) if isinstance(p, Deferred) else p for p, n in zip(payloads, send_sizes, strict=True) if p is not None
    ]
    send_buf = torch.cat(sent) if sent else torch.empty(0, dtype=torch.uint8, device=device)
    recv_buf = torch.empty(sum(max(n, 0) for n in recv_sizes), dtype=torch.uint8, device=device)
    bad = [(info.global_ranks[p], n) for p, n in enumerate(recv_sizes) if n < 0]
    if bad:
        raise CompressedCommError(
            f"rank {info.global_ranks[me]} ({info.where}): size exchange of the {d} "
            f"all-to-all at iteration "
            f"{info.iteration} returned negative sizes (rank, size) {bad}"
        )
    with embedding_collective(d), named_collective(_a2a_name(info, d)):
        work = dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=pg, async_op=True)
    t2 = time.perf_counter()
    late_s = 0.0
    if sampled is not None:  # while the bytes travel
        own = payloads[sampled.c.peer]
        assert own is not None
        own = own.take(send_sizes[sampled.c.peer]) if isinstance(own, Deferred) else own
        late_s = _timed(_sample, sampled, own, stats)
    stats.add(f"{d}/wire_bytes", sum(send_sizes) + 8 * (ws - 1))
    stats.add(f"{d}/codec_ms", 1e3 * (t1 - t0 - sample_s))
    if sample_s or late_s:
        stats.add(f"{d}/sample_ms", 1e3 * (sample_s + late_s))
    stats.add(f"{d}/comm_ms", 1e3 * (t2 - t1))
    stats.add(f"{d}/calls", 1)
    return _Transfer(work, recv_buf, recv_sizes, chunks[me])


Prepared = tuple[int, torch.Tensor | None, Any]  # a payload's head bytes, device values read with it, state


def _read_heads(info: CompressedA2AInfo, d: str, incoming: list[Incoming]) -> None:
    """Every received payload's head and what its decoder (a stage's, else the codec's) needs on
    the host, in one host synchronisation for the collective, set as each one's ``head`` (none
    where the decoder reads for itself, e.g. on the CPU)."""
    todo: list[tuple[Incoming, Prepared]] = []
    for r in incoming:
        if r.stored:  # decoded with its check, nothing read first
            continue
        prepared: Prepared | None = next((p for s in info.stages if (p := s.prepare_decode(r)) is not None), None)
        if prepared is None and not any(s.decodes(r) for s in info.stages):
            if r.dc.checks_in_decode(r.payload.device):  # its verdict is read after the decodes
                r.checked_later = True
                continue
            prepared = _codec_prepared(r.dc, r.payload, r.ids, r.blocks)
        if prepared is not None:
            todo.append((r, prepared))
    for (r, _), head in zip(todo, _read_prepared([r.payload for r, _ in todo], [p for _, p in todo]), strict=True):
        r.head = head


def _codec_prepared(
    dc: DirectionCodec, payload: torch.Tensor, ids: torch.Tensor | None, blocks: Blocks
) -> Prepared | None:
    """What the codec's decode of ``payload`` reads on the host, to read with the collective's
    heads; None where it reads for itself."""
    codec = dc.prepare_decode(payload, ids, blocks.features)
    return None if codec is None else (dc.head_size(len(blocks.widths)), *codec)


def _read_prepared(payloads: list[torch.Tensor], prepared: list[Prepared]) -> list[HostHead]:
    """Every payload's head with its prepared device values, in one host synchronisation."""
    heads = read_heads(payloads, [p[1] for p in prepared], [p[0] for p in prepared]) if prepared else []
    for p, head in zip(prepared, heads, strict=True):
        head.state = p[2]
    return heads


def _decode(
    info: CompressedA2AInfo, r: Incoming, dtype: torch.dtype, checked: list[tuple[torch.Tensor, str]]
) -> torch.Tensor:
    """The first stage that decodes the payload, else the direction's codec (a codec that checks
    as it decodes leaves its verdict in ``checked``, read once the collective's decodes are done)."""
    for s in info.stages:
        part = s.decode(r)
        if part is not None:
            return part
    naming: dict[str, Any] = dict(
        src=r.src,
        dst=r.dst,
        features=r.blocks.features,
        tables=sorted({info.feature_tables.get(f, f) for f in r.blocks.features}),
        iteration=r.iteration,
        where=r.where,
    )
    if r.stored:
        return r.dc.decode_stored(r.payload, r.shape, dtype, r.ids, r.blocks.widths, checked, out=r.window, **naming)
    if r.checked_later:
        out, verdict = r.dc.decode_checked(r.payload, r.shape, dtype, r.blocks.widths, out=r.window, **naming)
        checked.append((verdict, r.dc._transfer(r.payload, **naming)))
        return out
    return r.dc.decode(r.payload, r.shape, r.ids, out=r.window, head=r.head, **naming)


def _receive(pg: dist.ProcessGroup, info: CompressedA2AInfo, d: str, tr: _Transfer) -> torch.Tensor:
    """Wait for the bytes and decode each peer's payload (our own chunk is used as is) into the
    merged output."""
    layout, dc, stats = info.layout, info.codecs[d], info.stats
    me, ws = pg.rank(), pg.size()
    t0 = time.perf_counter()
    if tr.work is not None:
        with embedding_collective(d), named_collective(_a2a_name(info, d)):
            tr.work.wait()
    t1 = time.perf_counter()
    target = layout.output(d, tr.self_part)
    out, windows = target if target is not None else (None, [None] * ws)
    ids_per_peer = info.recv_ids(d)
    parts: list[torch.Tensor | Incoming] = []  # the chunks as they are, or still to decode
    offset = 0
    for peer in range(ws):
        n, shape, window = tr.recv_sizes[peer], layout.recv_shape(d, peer), windows[peer]
        payload = tr.recv_buf[offset : offset + n]
        offset += n
        if peer == me:
            parts.append(tr.self_part if window is None else window.copy_(tr.self_part))
            continue
        if tr.raw:  # every table at none (_send_raw): the rows as sent
            part = payload.view(shape)
            parts.append(part if window is None else window.copy_(part))
            continue
        blocks = layout.recv_blocks(d, peer)
        if shape[0] * shape[1] == 0:  # nothing was due (a rank without tables, an empty batch)
            if n != 0:
                raise CompressedCommError(
                    f"rank {info.global_ranks[me]} ({info.where}): rank {info.global_ranks[peer]} sent {n} {d} "
                    "bytes where none were "
                    f"expected (features {blocks.features}, iteration {info.iteration})"
                )
            parts.append(tr.self_part.new_zeros(shape) if window is None else window)
            continue
        if n == 0:
            raise CompressedCommError(
                f"rank {info.global_ranks[me]} ({info.where}): rank {info.global_ranks[peer]} sent no {d} payload "
                "for features "
                f"{blocks.features} at iteration {info.iteration} (expected shape {shape})"
            )
        src, dst = info.global_ranks[peer], info.global_ranks[me]
        r = Incoming(
            d,
            peer,
            src,
            dst,
            payload,
            shape,
            ids_per_peer[peer],
            blocks,
            window,
            dc,
            stats,
            info.iteration,
            info.where,
        )
        # a chunk sent stored has its stored form's size, which no coded payload has
        r.stored = n == dc.stored_size(shape, tr.self_part.dtype) and not any(s.decodes(r) for s in info.stages)
        parts.append(r)
    if not tr.raw:
        _read_heads(info, d, [p for p in parts if isinstance(p, Incoming)])
    checked: list[tuple[torch.Tensor, str]] = []  # verdicts of payloads checked as they were decoded
    for i, p in enumerate(parts):
        if isinstance(p, Incoming):
            parts[i] = decoded = _decode(info, p, tr.self_part.dtype, checked)
            for s in info.stages:
                s.after_decode(p, decoded)
    raise_unless_sound(checked)  # (one host read, before any decoded value leaves)
    stats.add(f"{d}/comm_ms", 1e3 * (t1 - t0))
    stats.add(f"{d}/codec_ms", 1e3 * (time.perf_counter() - t1))
    if out is not None:
        return out
    assert isinstance(layout, ReduceScatterLayout)  # the one layout whose output() can be None
    return layout.merge(d, cast(list[torch.Tensor], parts))  # every part decoded by now


class CompressedAll2All_Req(Function):
    """Forward: encode + launch; backward: wait + decode the gradient (cf. All2All_Pooled_Req)."""

    @staticmethod
    def forward(
        ctx, pg: dist.ProcessGroup, myreq: Request, info: CompressedA2AInfo, input: torch.Tensor
    ) -> torch.Tensor:
        transfer = _send(pg, info, "forward", info.layout.split("forward", input))
        myreq.req = transfer.work
        myreq.tensor = transfer
        myreq.a2ai = info
        myreq.wait_function = CompressedAll2All_Wait
        ctx.myreq = myreq
        ctx.pg = pg
        return myreq.dummy_tensor

    @staticmethod
    def backward(ctx, *unused: torch.Tensor) -> tuple[None, None, None, torch.Tensor]:
        myreq, pg = ctx.myreq, ctx.pg
        grad_input = _receive(pg, myreq.a2ai, "backward", myreq.tensor)
        if get_gradient_division():  # as TorchRec: equivalent to running on a single rank
            grad_input.div_(pg.size())
        myreq.req = None
        myreq.tensor = None
        myreq.dummy_tensor = None
        return (None, None, None, grad_input)


class CompressedAll2All_Wait(Function):
    """Forward: wait + decode + merge; backward: encode the gradient + launch (cf. All2All_Pooled_Wait)."""

    @staticmethod
    def forward(ctx, pg: dist.ProcessGroup, myreq: Request, *dummy_tensor: torch.Tensor) -> torch.Tensor:
        info, transfer = myreq.a2ai, myreq.tensor
        myreq.req = None
        myreq.tensor = None
        ctx.myreq = myreq
        ctx.pg = pg
        ctx.info = info
        return _receive(pg, info, "forward", transfer)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        myreq, pg, info = ctx.myreq, ctx.pg, ctx.info
        transfer = _send(pg, info, "backward", info.layout.split("backward", grad_output.contiguous()))
        myreq.req = transfer.work
        myreq.tensor = transfer
        return (None, None, myreq.dummy_tensor)


def compressed_all_to_all(pg: dist.ProcessGroup, info: CompressedA2AInfo, input: torch.Tensor) -> Request:
    """Start one compressed collective; ``.wait()`` on the result gives the merged output."""
    myreq = Request(pg, device=input.device)
    CompressedAll2All_Req.apply(pg, myreq, info, input)
    return myreq
