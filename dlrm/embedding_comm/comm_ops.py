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
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function
from torchrec.distributed.comm_ops import Request, get_gradient_division

from dlrm.embedding_comm.bounds import Bounds, host_bounds
from dlrm.embedding_comm.codec import CompressedCommError, DirectionCodec, abs_error
from dlrm.embedding_comm.ids import PendingIds
from dlrm.embedding_comm.stage import Blocks, Incoming, Outgoing, Stage
from dlrm.embedding_comm.stats import CommStats
from dlrm.process.instrument import embedding_collective, on_the_wire, payload_hooked
from dlrm.process.timeout import named_collective
from dlrm_compression.format import Deferred, HostHead, read_heads, settle
from dlrm_compression.lossy import LossyCodec


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


def _sample(
    dc: DirectionCodec,
    chunk: torch.Tensor,
    payload: torch.Tensor,
    blocks: Blocks,
    bounds: Bounds | None,
    ids: torch.Tensor | None,
    stats: CommStats,
    d: str,
    thresholds: list[float] | None = None,
    decoded: torch.Tensor | None = None,
) -> None:
    """Sender-side sampling: decode our own payload (or take ``decoded``: what an encoding stage
    says the destination holds) for errors, encode each block alone for sizes."""
    bounds = host_bounds(bounds)  # sampling reads them on the host (once per sample, not per chunk)
    if decoded is None:
        decoded = dc.codec.decode(payload, ids if dc.dedup else None)
    col_err = abs_error(decoded.float(), chunk.float()).amax(dim=0) if chunk.shape[0] else None
    elt, c = chunk.element_size(), 0
    for k, (f, w) in enumerate(zip(blocks.features, blocks.widths, strict=True)):
        if w and col_err is not None:
            e = float(col_err[c : c + w].max())
            stats.maximum(f"{d}/max_abs_error/{f}", e)
            stats.maximum(f"{d}/max_abs_error", e)
            if bounds is not None:
                b = bounds[k]
                stats.maximum(f"{d}/max_error_over_bound", e / b if b > 0 else (0.0 if e == 0 else torch.inf))
            solo = dc.encode(
                chunk[:, c : c + w],
                [w],
                None if bounds is None else [bounds[k]],
                None if ids is None else ids[:, k : k + 1],
                None if thresholds is None else [thresholds[k]],
                [f],
            )
            stats.add(f"{d}/sampled_raw_bytes/{f}", chunk.shape[0] * w * elt)
            stats.add(f"{d}/sampled_wire_bytes/{f}", solo.numel())
        c += w


def _count_raw(stats: CommStats, d: str, chunk: torch.Tensor, blocks: Blocks) -> None:
    """The raw (fp32) bytes of a chunk sent to one peer, per table and in total."""
    elt = chunk.element_size()
    for f, w in zip(blocks.features, blocks.widths, strict=True):
        stats.add(f"{d}/raw_bytes/{f}", chunk.shape[0] * w * elt)
    stats.add(f"{d}/raw_bytes", chunk.numel() * elt)


def _count_distinct(
    stats: CommStats, d: str, chunk: torch.Tensor, blocks: Blocks, ids: torch.Tensor | None, dedup: bool
) -> None:
    """Sampled: the rows each block gives the codec (its distinct ids, or distinct rows by value,
    when the codec dedups; else all its rows) and their fp32 bytes against the chunk's, per mode
    (``ids``: chunks with single ids; ``rows``: the rest, e.g. row-wise partial sums), so that
    dlrm/telemetry/wire.py knows the codec's ratio on what it is given. dlrm/placement/traffic.py predicts the rows."""
    mode, given, c = ("ids" if ids is not None else "rows"), 0, 0
    for k, (f, w) in enumerate(zip(blocks.features, blocks.widths, strict=True)):
        if not dedup:
            rows = chunk.shape[0]
        elif ids is not None:
            rows = int(torch.unique(ids[:, k]).numel())
        else:
            rows = int(torch.unique(chunk[:, c : c + w], dim=0).shape[0])
        stats.add(f"{d}/sampled_chunks/{f}", 1)
        stats.add(f"{d}/sampled_rows/{f}", rows)
        given += rows * w * chunk.element_size()
        c += w
    stats.add(f"{d}/sampled_given_bytes/{mode}", given)
    stats.add(f"{d}/sampled_chunk_bytes/{mode}", chunk.numel() * chunk.element_size())


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


def _send(pg: dist.ProcessGroup, info: CompressedA2AInfo, d: str, chunks: list[torch.Tensor]) -> _Transfer:
    """Encode a chunk per peer (through the call's stages), exchange sizes, launch the async byte
    all-to-all."""
    layout, dc, stats, stages = info.layout, info.codecs[d], info.stats, info.stages
    me, ws = pg.rank(), pg.size()
    device = chunks[me].device
    # Payloads may keep their lengths on the device until the size exchange reads them all at
    # once, unless a stage looks at them (it would read each).
    defer = not any(_overrides(s, "measure") for s in stages)
    # Which chunks have ids can wait for that read too where the codec picks ids or rows on the
    # device and no stage looks at the ids before (an encoding stage does).
    raw = not any(s.needs_codec(d) for s in stages) and dc.passthrough(layout.features())
    pending = info.pending_ids
    later = (
        pending is not None
        and not raw
        and defer
        and not info.sample
        and dc.picks_ids_on_device(device)
        and not any(_overrides(s, "encode") for s in stages)
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
    for i in range(1, ws):
        peer = (me + i) % ws
        chunk, ids, single = chunks[peer], ids_per_peer[peer], send_flags[peer]
        if chunk.numel() == 0:
            continue  # both sides know the shape: nothing to send
        blocks = layout.send_blocks(d, peer)
        _count_raw(stats, d, chunk, blocks)
        if ids is None and id(chunk) in memo and reuse:
            payloads[peer] = memo[id(chunk)]
        else:
            key = id(blocks)
            if key not in policy:
                policy[key] = [v * info.bound_scale[d] for v in dc.policy(blocks.features, info.iteration)]
            # Relative bounds come from the rows as produced, before duplicate-id gradients are
            # summed: the summed rows of frequent ids would set a range under which the gradients
            # of rare ids vanish (at a batch of 2,048, 35-85% of rows decoded as zero).
            bounds = dc.bounds(chunk, blocks.widths, policy[key])
            # (ids that may not hold are the codec's alone: the stages see none)
            c = Outgoing(
                d, peer, info.global_ranks[peer], chunk, ids if single is None else None, blocks, bounds, dc, stats
            )
            for s in stages:
                s.before_encode(c)
            thresholds = dc.thresholds(
                c.chunk, blocks.features, blocks.widths, info.iteration, info.training, info.collective
            )
            late: torch.Tensor | Deferred | None
            if not any(s.encode(c) for s in stages):
                if defer and not sample:  # (a sampled chunk's payload is measured now)
                    late = dc.encode_deferred(c.chunk, blocks.widths, bounds, ids, thresholds, blocks.features, single)
                else:
                    late = c.payload = dc.encode(c.chunk, blocks.widths, bounds, ids, thresholds, blocks.features)
            else:
                late = c.payload
            assert late is not None
            for s in stages:
                ts = time.perf_counter()
                if s.measure(c):
                    sample_s += time.perf_counter() - ts
            if sample:
                ts = time.perf_counter()
                assert c.payload is not None  # a sampled chunk is encoded whole
                _sample(dc, c.chunk, c.payload, blocks, bounds, ids, stats, d, thresholds, c.held)
                _count_distinct(stats, d, c.chunk, blocks, ids, dc.dedup)
                sample = False
                sample_s += time.perf_counter() - ts
            if ids is None:  # no ids, settled or pending
                memo[id(chunks[peer])] = late
            payloads[peer] = late
    if payload_hooked():  # a test's hook sees (and may cut) each payload: their bytes first
        ready = settle(payloads)
        payloads = [
            None
            if p is None
            else on_the_wire(
                p, src=info.global_ranks[me], dst=info.global_ranks[q], direction=d, iteration=info.iteration
            )
            for q, p in enumerate(ready)
        ]
    t1 = time.perf_counter()
    sizes = torch.tensor([p.numel() if isinstance(p, torch.Tensor) else 0 for p in payloads], dtype=torch.int64)
    sizes = sizes.to(device, non_blocking=True)
    for q, p in enumerate(payloads):
        if isinstance(p, Deferred):
            sizes[q] = p.length
    recv_t = torch.empty(ws, dtype=torch.int64, device=device)
    with embedding_collective(d), named_collective(f"the size exchange of {_a2a_name(info, d)}"):
        dist.all_to_all_single(recv_t, sizes, group=pg)
    flags = pending.single.to(device, torch.int64) if later and pending is not None else sizes[:0]
    both = torch.cat([sizes, recv_t, flags]).tolist()  # the collective's one host synchronisation
    send_sizes, recv_sizes = both[:ws], both[ws : 2 * ws]
    if later:  # the receive side and the backward need the ids as they are
        info.settle_ids([bool(v) for v in both[2 * ws :]])
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
    stats.add(f"{d}/wire_bytes", sum(send_sizes) + 8 * (ws - 1))
    stats.add(f"{d}/codec_ms", 1e3 * (t1 - t0 - sample_s))
    if sample_s:
        stats.add(f"{d}/sample_ms", 1e3 * sample_s)
    stats.add(f"{d}/comm_ms", 1e3 * (t2 - t1))
    stats.add(f"{d}/calls", 1)
    return _Transfer(work, recv_buf, recv_sizes, chunks[me])


def _overrides(stage: Stage, hook: str) -> bool:
    """Whether ``stage`` implements ``hook`` (a stage that measures or decodes sees payloads)."""
    return getattr(type(stage), hook) is not getattr(Stage, hook)


def _read_heads(info: CompressedA2AInfo, d: str, tr: _Transfer) -> dict[int, HostHead]:
    """Every received payload's head and what its decoder needs on the host, in one host
    synchronisation for the collective (none where the codec reads for itself, on the CPU)."""
    if tr.raw or any(_overrides(s, "decode") for s in info.stages):
        return {}
    dc, layout, ids_per_peer = info.codecs[d], info.layout, info.recv_ids(d)
    todo: list[tuple[int, torch.Tensor, Any]] = []
    offsets = [0, *itertools.accumulate(tr.recv_sizes)]
    for peer, n in enumerate(tr.recv_sizes):
        if n <= 0 or math.prod(layout.recv_shape(d, peer)) == 0:
            continue
        payload = tr.recv_buf[offsets[peer] : offsets[peer] + n]
        prepared = dc.prepare_decode(payload, ids_per_peer[peer])
        if prepared is not None:
            todo.append((peer, payload, prepared))
    sizes = [LossyCodec.head_size(len(layout.recv_blocks(d, t[0]).widths)) for t in todo]
    heads = read_heads([t[1] for t in todo], [t[2][0] for t in todo], sizes) if todo else []
    for (_, _, prepared), head in zip(todo, heads, strict=True):
        head.state = prepared[1]
    return {t[0]: head for t, head in zip(todo, heads, strict=True)}


def _decode(info: CompressedA2AInfo, r: Incoming, head: HostHead | None = None) -> torch.Tensor:
    """The first stage that decodes the payload, else the direction's codec."""
    for s in info.stages:
        part = s.decode(r)
        if part is not None:
            return part
    return r.dc.decode(
        r.payload,
        r.shape,
        r.ids,
        src=r.src,
        dst=r.dst,
        features=r.blocks.features,
        tables=sorted({info.feature_tables.get(f, f) for f in r.blocks.features}),
        iteration=r.iteration,
        where=r.where,
        out=r.window,
        head=head,
    )


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
    heads = _read_heads(info, d, tr)
    parts, offset = [], 0
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
            d, peer, src, dst, payload, shape, ids_per_peer[peer], blocks, window, dc, stats, info.iteration, info.where
        )
        decoded = _decode(info, r, heads.get(peer))
        for s in info.stages:
            s.after_decode(r, decoded)
        parts.append(decoded)
    stats.add(f"{d}/comm_ms", 1e3 * (t1 - t0))
    stats.add(f"{d}/codec_ms", 1e3 * (time.perf_counter() - t1))
    if out is not None:
        return out
    assert isinstance(layout, ReduceScatterLayout)  # the one layout whose output() can be None
    return layout.merge(d, parts)


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
