"""The sending side of a compressed all-to-all: plan -> encode -> exchange.

* :func:`plan`: who gets which chunk and how (TorchRec's own exchange where every table chose
  ``none``, :func:`send_raw`; payload lengths left on the device unless a stage reads payloads;
  the forward's ids read now or with the sizes; a chunk sent to several peers encoded once);
* :func:`encode`: each chunk under its bounds through the call's stages and the direction's
  codec; a payload no smaller than its rows travels stored (docs/compression.md, "Stored
  chunks");
* :func:`exchange`: the sizes (a blocking ``all_to_all_single`` of ``world_size`` int64 words
  and the side's one host read, :func:`settle`), then the byte ``all_to_all_single`` with
  variable splits, launched asynchronously; a sampled chunk is measured while the bytes travel
  (:mod:`dlrm.embedding_comm.sampling`).

The receiving side is :mod:`dlrm.embedding_comm.receive`; the autograd functions that call both,
:mod:`dlrm.embedding_comm.comm_ops`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from dlrm.embedding_comm.codec import CompressedCommError
from dlrm.embedding_comm.ids import sum_duplicates
from dlrm.embedding_comm.layout import CompressedA2AInfo
from dlrm.embedding_comm.sampling import sample, sample_exact
from dlrm.embedding_comm.stage import Blocks, Outgoing, Settle
from dlrm.embedding_comm.stats import CommStats
from dlrm.process.instrument import embedding_collective
from dlrm.process.timeout import named_collective
from dlrm_compression.format import Deferred


@dataclass
class Transfer:
    """An exchange in flight: the async work, the receive buffer and sizes, our own chunk."""

    work: dist.Work | None
    recv_buf: torch.Tensor
    recv_sizes: list[int]
    self_part: torch.Tensor
    raw: bool = False  # the rows as they are (see send_raw), sizes in elements


@dataclass
class SendPlan:
    """One side of a collective as decided before anything is encoded."""

    direction: str
    me: int  # this rank in the collective's group
    chunks: list[torch.Tensor]  # per peer (``chunks[me]``: our own, never sent)
    raw: bool = False  # every table at ``none`` (compression=auto): TorchRec's own exchange (send_raw)
    defer: bool = True  # payload lengths may stay on the device until the size exchange
    ids_later: bool = False  # which chunks hold ids is read with the sizes (the device chose)
    outgoing: list[Outgoing] = field(default_factory=list)  # the chunks to encode, in send order
    same: dict[int, int] = field(default_factory=dict)  # peer -> the peer whose payload it gets too


@dataclass
class Encoded:
    """A side's payloads, per peer, before the size exchange."""

    payloads: list[torch.Tensor | Deferred | None]
    coded: dict[int, Outgoing] = field(default_factory=dict)  # the codec's payloads (they may travel stored)
    limits: dict[int, int] = field(default_factory=dict)  # peer -> stored size, where the length is the device's
    settles: list[Settle] = field(default_factory=list)  # what encoding stages read with the sizes
    sampled: Outgoing | None = None  # the chunk this call measures (sample)
    codec_s: float = 0.0
    measure_s: float = 0.0  # the stages' measurements (sampling's, not the codec's)


def plan(info: CompressedA2AInfo, d: str, chunks: list[torch.Tensor], me: int) -> SendPlan:
    """Who gets which chunk, and how: TorchRec's exchange where every table of the collective chose
    ``none``; lengths left on the device unless a stage reads the payloads; the forward's ids read
    now, or with the sizes where the codec picks ids or rows on the device and no stage reads them
    first; an :class:`Outgoing` per peer sent something, a chunk without ids that several peers
    get (row-wise gradients) encoded once unless a stage makes it differ per peer."""
    dc, stages, layout = info.codecs[d], info.stages, info.layout
    sends = SendPlan(d, me, chunks)
    sends.raw = not any(s.needs_codec(d) for s in stages) and dc.passthrough(layout.features())
    sends.defer = not any(s.sees_payloads(d) for s in stages)
    pending = info.pending_ids
    sends.ids_later = (
        pending is not None
        and not sends.raw
        and sends.defer
        and dc.picks_ids_on_device(chunks[me].device)
        and not any(s.reads_ids(d) for s in stages)
    )
    if pending is not None and not sends.ids_later:
        info.settle_ids(pending.single.tolist())  # the forward's read of which chunks have ids
    if sends.raw:
        return sends
    ids, flags = info.send_ids(d), cast(list[torch.Tensor | None], [None] * len(chunks))
    if sends.ids_later:  # (ids that may not hold go with their device flag: only stages that take it see them)
        assert pending is not None
        ids, flags = pending.candidates[0], pending.flags()[0]
    reuse = not any(s.per_peer(d) for s in stages)
    first: dict[int, int] = {}  # a chunk without ids -> the first peer that gets it
    ws = len(chunks)
    for peer in ((me + i) % ws for i in range(1, ws)):
        chunk = chunks[peer]
        if chunk.numel() == 0:
            continue  # both sides know the shape: nothing to send
        if ids[peer] is None and reuse and id(chunk) in first:
            sends.same[peer] = first[id(chunk)]
            continue
        if ids[peer] is None:
            first[id(chunk)] = peer
        blocks, dst = layout.send_blocks(d, peer), info.global_ranks[peer]
        c = Outgoing(
            d, peer, dst, chunk, ids[peer], blocks, None, dc, info.stats, deferrable=sends.defer, single=flags[peer]
        )
        sends.outgoing.append(c)
    return sends


def encode(info: CompressedA2AInfo, sends: SendPlan) -> Encoded:
    """Each planned chunk under the policy's bounds, through the call's stages, then the codec
    unless a stage encoded it; a payload whose size the host knows and that is no smaller than
    its rows' stored form stored at once, one whose length is still on the device limited to it
    (:func:`exchange` reads which). The first chunk is the sampled one where the call samples."""
    d, dc = sends.direction, info.codecs[sends.direction]
    t0 = time.perf_counter()
    enc = Encoded([None] * len(sends.chunks))
    policy: dict[int, list[float]] = {}
    for c in sends.outgoing:
        if id(c.blocks) not in policy:
            policy[id(c.blocks)] = [v * info.bound_scale[d] for v in dc.policy(c.blocks.features, info.iteration)]
        # Relative bounds come from the rows as produced, before duplicate-id gradients are
        # summed: the summed rows of frequent ids would set a range under which the gradients
        # of rare ids vanish (at a batch of 2,048, 35-85% of rows decoded as zero).
        c.bounds = dc.bounds(c.chunk, c.blocks.widths, policy[id(c.blocks)])
        for s in info.stages:
            s.before_encode(c)
        enc.payloads[c.peer] = _encode_chunk(info, c, enc)
        for s in info.stages:
            ts = time.perf_counter()
            if s.measure(c):
                enc.measure_s += time.perf_counter() - ts
        if info.sample and enc.sampled is None:
            enc.sampled = c  # (measured once its bytes are known: exchange)
    for peer, first in sends.same.items():
        enc.payloads[peer] = enc.payloads[first]
        if first in enc.coded:
            enc.coded[peer] = enc.coded[first]
    _store_larger(enc.payloads, enc.coded)
    enc.limits = {q: _stored_size(c) for q, c in enc.coded.items() if isinstance(enc.payloads[q], Deferred)}
    enc.codec_s = time.perf_counter() - t0 - enc.measure_s
    return enc


def _encode_chunk(info: CompressedA2AInfo, c: Outgoing, enc: Encoded) -> torch.Tensor | Deferred:
    """One chunk's payload: a stage's where one encodes it (what it leaves to read goes with the
    sizes), its stored form where that is known up front to be no larger, else the codec's, its
    length left on the device where the plan allows."""
    widths, features = c.blocks.widths, c.blocks.features
    thresholds = c.dc.thresholds(c.chunk, features, widths, info.iteration, info.training, info.collective)
    if any(s.encode(c) for s in info.stages):
        if c.settle is not None:
            enc.settles.append(c.settle)
        assert c.payload is not None
        return c.payload
    if c.dc.stored_first((c.chunk.shape[0], c.chunk.shape[1]), c.chunk.dtype, widths):
        c.payload = _store(c)  # (e.g. compression=none: every table's header outweighs the one of the rows)
        return c.payload
    enc.coded[c.peer] = c
    if c.deferrable:  # (a sampled chunk is measured after the size read, like the others)
        return c.dc.encode_deferred(c.chunk, widths, c.bounds, c.ids, thresholds, features, c.single, c.summed)
    c.payload = c.dc.encode(c.chunk, widths, c.bounds, c.ids, thresholds, features, c.summed)
    return c.payload


def exchange(pg: dist.ProcessGroup, info: CompressedA2AInfo, sends: SendPlan, enc: Encoded) -> Transfer:
    """Exchange the sizes (blocking) and read them with the rest (:func:`settle`), then launch
    the byte all-to-all; the sampled chunk is measured while the bytes travel."""
    d, me, ws = sends.direction, sends.me, len(sends.chunks)
    device = sends.chunks[me].device
    t1 = time.perf_counter()
    sizes = send_sizes_of(enc, device)
    recv_t = torch.empty(ws, dtype=torch.int64, device=device)
    with marked(info, d, f"the size exchange of {a2a_name(info, d)}"):
        dist.all_to_all_single(recv_t, sizes, group=pg)
    send_sizes, recv_sizes = settle(info, sends, enc, sizes, recv_t)
    sent = [
        p.take(n) if isinstance(p, Deferred) else p
        for p, n in zip(enc.payloads, send_sizes, strict=True)
        if p is not None
    ]
    send_buf = torch.cat(sent) if sent else torch.empty(0, dtype=torch.uint8, device=device)
    recv_buf = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    with marked(info, d, a2a_name(info, d)):
        work = dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=pg, async_op=True)
    t2 = time.perf_counter()
    sample_s = enc.measure_s
    if enc.sampled is not None:  # while the bytes travel
        sample_s += _timed(_sample_sent, info, sends, enc, send_sizes)
    _count_sent(info, sends, send_sizes, enc.codec_s, sample_s, t2 - t1)
    return Transfer(work, recv_buf, recv_sizes, sends.chunks[me])


def send_sizes_of(enc: Encoded, device: torch.device) -> torch.Tensor:
    """Every payload's length (int64 [world size] on ``device``: uploaded where the host knows
    it, copied in where the device does), the smaller of it and its stored form's where that
    is still the device's (the same upload, one op)."""
    ws = len(enc.payloads)
    host = [p.numel() if isinstance(p, torch.Tensor) else 0 for p in enc.payloads]
    limits = [enc.limits.get(q, _NO_LIMIT) for q in range(ws)] if enc.limits else []
    sizes = torch.tensor(host + limits, dtype=torch.int64).to(device, non_blocking=True)
    for q, p in enumerate(enc.payloads):
        if isinstance(p, Deferred):
            sizes[q] = p.length
    return torch.minimum(sizes[:ws], sizes[ws:]) if limits else sizes


def settle(
    info: CompressedA2AInfo, sends: SendPlan, enc: Encoded, sizes: torch.Tensor, recv_t: torch.Tensor
) -> tuple[list[int], list[int]]:
    """The side's one host synchronisation: the sizes both ways, which chunks hold ids (where the
    device chose) and what encoding stages left to read; then each payload whose size came back
    as its stored form's is stored (one payload sent to several peers, once). Returns the send
    and receive sizes; a negative one (a peer's bug) raises before anything is launched."""
    ws, pending = len(enc.payloads), info.pending_ids
    flags = pending.single.to(sizes.device, torch.int64) if sends.ids_later and pending is not None else sizes[:0]
    both = torch.cat([sizes, recv_t, flags, *(s.values for s in enc.settles)]).tolist()
    send_sizes, recv_sizes, at = both[:ws], both[ws : 2 * ws], 2 * ws + flags.numel()
    if sends.ids_later:  # the receive side, the backward and sampling need the ids as they are
        info.settle_ids([bool(v) for v in both[2 * ws : at]])
    for read in enc.settles:
        read.then(both[at : at + read.values.numel()])
        at += read.values.numel()
    stored: dict[int, torch.Tensor] = {}  # a payload sent to several peers is stored once
    for q, limit in enc.limits.items():
        if send_sizes[q] == limit:
            late = enc.payloads[q]
            if id(late) not in stored:
                stored[id(late)] = _store(enc.coded[q])
            enc.payloads[q] = stored[id(late)]
    bad = [(info.global_ranks[p], n) for p, n in enumerate(recv_sizes) if n < 0]
    if bad:
        raise CompressedCommError(
            f"rank {info.global_ranks[sends.me]} ({info.where}): size exchange of the {sends.direction} "
            f"all-to-all at iteration {info.iteration} returned negative sizes (rank, size) {bad}"
        )
    return send_sizes, recv_sizes


def _sample_sent(info: CompressedA2AInfo, sends: SendPlan, enc: Encoded, send_sizes: list[int]) -> None:
    """Measure the sampled chunk as it was sent (its ids as read by now)."""
    c = enc.sampled
    assert c is not None
    own = enc.payloads[c.peer]
    assert own is not None
    own = own.take(send_sizes[c.peer]) if isinstance(own, Deferred) else own
    ids = c.ids if c.single is None else info.send_ids(c.direction)[c.peer]
    me = info.global_ranks[sends.me]
    sample(c, ids, own, info.naming(c.blocks.features, me, me, f"{info.where}, sampling its own payload"))


def _count_sent(
    info: CompressedA2AInfo, sends: SendPlan, send_sizes: list[int], codec_s: float, sample_s: float, comm_s: float
) -> None:
    """A side's statistics: raw and wire bytes, codec, sampling and communication times, calls."""
    d, stats, ws = sends.direction, info.stats, len(sends.chunks)
    for peer, chunk in enumerate(sends.chunks):
        if peer != sends.me and chunk.numel():
            _count_raw(stats, d, chunk, info.layout.send_blocks(d, peer))
    stats.add(f"{d}/wire_bytes", sum(send_sizes) + 8 * (ws - 1))
    stats.add(f"{d}/codec_ms", 1e3 * codec_s)
    if sample_s:
        stats.add(f"{d}/sample_ms", 1e3 * sample_s)
    stats.add(f"{d}/comm_ms", 1e3 * comm_s)
    stats.add(f"{d}/calls", 1)


def _timed(fn: Any, *args: Any) -> float:
    """Seconds ``fn(*args)`` took."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _count_raw(stats: CommStats, d: str, chunk: torch.Tensor, blocks: Blocks) -> None:
    """The raw (fp32) bytes of a chunk sent to one peer, per table and in total."""
    elt = chunk.element_size()
    for f, w in zip(blocks.features, blocks.widths, strict=True):
        stats.add(f"{d}/raw_bytes/{f}", chunk.shape[0] * w * elt)
    stats.add(f"{d}/raw_bytes", chunk.numel() * elt)


def a2a_name(info: CompressedA2AInfo, d: str) -> str:
    return f"the {d} pooled-embedding all-to-all ({info.where}, iteration {info.iteration})"


@contextmanager
def marked(info: CompressedA2AInfo, d: str, name: str) -> Iterator[None]:
    """Collectives issued inside: marked as this call's (probes, a test's wire tap) and named if they time out."""
    with embedding_collective(d, info.iteration), named_collective(name):
        yield


def send_raw(pg: dist.ProcessGroup, info: CompressedA2AInfo, d: str, chunks: list[torch.Tensor]) -> Transfer:
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
            sample_exact(stats, d, chunk, blocks)
    t1 = time.perf_counter()
    with marked(info, d, a2a_name(info, d)):
        work = dist.all_to_all_single(recv_buf, send_buf, recv_sizes, send_sizes, group=pg, async_op=True)
    t2 = time.perf_counter()
    stats.add(f"{d}/wire_bytes", sum(send_sizes) * like.element_size())
    stats.add(f"{d}/codec_ms", 1e3 * (t1 - t0))
    stats.add(f"{d}/comm_ms", 1e3 * (t2 - t1))
    stats.add(f"{d}/calls", 1)
    return Transfer(work, recv_buf, recv_sizes, like, raw=True)


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
