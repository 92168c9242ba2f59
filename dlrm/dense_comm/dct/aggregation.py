"""How DCT sums every rank's selection of a bucket: :class:`AllGather` or :class:`ReduceScatter`
(``dense_comm.aggregation``), one implementation each, on the gradients' device.

Each phase makes one host read: every payload's size word (:mod:`.payload`), with this rank's
statistics (residual norm, threshold) and the checks of the payloads received before it. The
payloads all-gathered last are decoded when they arrive, and their checks read at once, before
any of their values reaches the bucket: a damaged payload raises :class:`DenseCommError` (naming
the ranks, the bucket and the iteration) from the bucket's future, so DDP's backward fails before
the optimizer applies an average that lacks a rank's contribution.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlrm.dense_comm.dct.payload import Coding, Segments
from dlrm.dense_comm.dct.state import Accumulated, DCTState, DenseCommError, cannot_decode
from dlrm.performance.network import ring_allreduce_bytes
from dlrm.process.instrument import on_the_wire
from dlrm_compression.format import PayloadError
from dlrm_compression.sparse import magnitudes

Future = torch.futures.Future
Decode = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
# adds rank r's payload, divided by the world size, to a bucket-sized sum; returns its check (as Decode's)
Place = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None]
Check = tuple[torch.Tensor, str]  # a received payload's check (0-d, 1: it holds) and what to call it if it fails


class AllGather:
    """Every rank's payload to every rank (a variable-size all-gather, sizes first); every rank
    adds what all ranks sent and divides by the world size, like DDP's average."""

    name = "allgather"

    def __call__(self, state: DCTState, acc: Accumulated, thresholds: list[torch.Tensor], t0: float) -> Future:
        assert state.pg is not None
        pg, coding = state.pg, Coding.of(state.codec, acc.f.device)
        ws, me = pg.size(), pg.rank()
        f, numels = acc.f, acc.numels
        keep = coding.mask(f, numels, thresholds, acc.mags)
        halves = state.halves(f.numel(), f.device) if coding.by_count else None
        word, made = coding.first(f, keep, numels, thresholds, state.bound(f), halves)
        # exactly what every rank decodes from our payload
        sent = coding.sent(f, keep, made, state.zero(f.dtype, f.device))
        residual = state.keep_residuals(acc, sent)
        t1 = time.perf_counter()
        gathered = [torch.empty_like(word.reshape(1)) for _ in range(ws)]
        dist.all_gather(gathered, word.reshape(1), group=pg)
        words, (norm, *taus) = _read(gathered, [torch.linalg.vector_norm(residual), *thresholds])
        threshold = max(taus)  # on the host: each threshold read, not a stack and a max launched
        state.norm_sq += norm**2
        lengths = [coding.size(f.numel(), numels, w) for w in words]
        ramp = state.ramp(f.numel(), f.device) if coding.by_count else None
        payload = coding.encoded(f, keep, numels, words[me], made, ramp)

        def place(r: int, part: torch.Tensor, into: torch.Tensor) -> torch.Tensor | None:
            other, ok = coding.decode(part, f.numel(), acc.buf.dtype, numels, words[r], ramp=ramp)
            into.add_(other.div_(ws))
            return ok

        kept = coding.count(words[me], payload)
        return _exchange(state, acc, payload, lengths, sent, (t0, t1), kept, threshold, place, coding.by_count)


class ReduceScatter:
    """DCT summed by segment owners (SparCML's split all-gather; gTop-k): bytes per rank that do
    not grow with W. Each parameter is cut into W contiguous pieces, rank r owning the r-th of
    each (its segment): per parameter, not per bucket, so that DDP's bucket layout (rebuilt after
    the first iteration of every process, a resumed one too) moves nothing.

    Phase 1, a sparse reduce-scatter: each rank sends every other rank the entries of its segment
    above this rank's thresholds (a variable-size all-to-all, sizes first; this rank's residual
    keeps the rest, as with the all-gather) and adds its own segment whole (it does not travel);
    the owner sums them in rank order. Phase 2: the owner keeps the ``keep`` fraction of each
    piece of its summed segment (the k-th largest |sum| as threshold, every iteration; pieces of
    parameters under ``min_numel`` whole), what it drops staying in its owner residual (added to
    the next iteration's ``f``), and all-gathers it (as :class:`AllGather` does). Phase 1 is
    waited for in the hook: phase 2's collectives must be issued in the same order on every rank,
    which a callback on the collectives' threads cannot keep."""

    name = "reduce_scatter"

    def __call__(self, state: DCTState, acc: Accumulated, thresholds: list[torch.Tensor], t0: float) -> Future:
        assert state.pg is not None
        pg, coding = state.pg, Coding.of(state.codec, acc.f.device)
        ws, me = pg.size(), pg.rank()
        seg = state.segments(acc.numels, ws, acc.f.device)  # per rank: its positions in the bucket, piece widths
        p1 = self._scatter(state, coding, acc, thresholds, seg)
        mine, buf, blocks = seg.index[me], acc.buf, [seg.blocks(r) for r in range(ws)]
        # phase 2: the owner's own selection of each piece of the summed segment, its own error feedback
        total = p1.total
        mags = magnitudes(total) if total.dtype == torch.float32 else None  # the thresholds' and the mask's
        ts = state.owner_thresholds(total, acc.numels, seg.widths[me], mags)
        keep = coding.mask(total, blocks[me], ts, mags)
        halves = state.halves(total.numel(), total.device) if coding.by_count else None
        word, made = coding.first(total, keep, blocks[me], ts, state.bound(total), halves)
        sends = coding.sent(total, keep, made, state.zero(total.dtype, total.device))
        # with other ranks' payloads to add, summed holds no -0.0 (their dense decodes' zeros made it
        # +0.0): those are added where their entries go (place), not as dense tensors
        summed, dropped = state.keep_owner_residuals(acc, total, sends, mine, signed_zeros=ws == 1)
        gathered = [torch.empty_like(word.reshape(1)) for _ in range(ws)]
        t4 = time.perf_counter()
        dist.all_gather(gathered, word.reshape(1), group=pg)
        stats = [*(torch.linalg.vector_norm(t) for t in (p1.residual, dropped)), *thresholds]
        words, (sender_norm, owner_norm, *taus) = _read(gathered, stats, p1.checks)  # phase 2's one host read
        threshold = max(taus)
        state.norm_sq += sender_norm**2 + owner_norm**2
        lengths = [coding.size(seg.index[r].numel(), blocks[r], w) for r, w in enumerate(words)]
        ramp = state.ramp(buf.numel(), buf.device) if coding.by_count else None
        payload = coding.encoded(total, keep, blocks[me], words[me], made, ramp)
        state.stats.record(wire=p1.wire, comm_ms=1e3 * p1.exchange_s)

        def place(r: int, part: torch.Tensor, into: torch.Tensor) -> torch.Tensor | None:
            index = seg.index[r]  # rank r's segment: disjoint from every other rank's
            if coding.by_count:  # its entries added where they go (into holds no -0.0 for zeros to change)
                idx, values, ok = coding.entries(part, index.numel(), blocks[r], words[r], ramp)
                # (out of place: a float32 payload's values are a view of the payload received)
                into.index_add_(0, index.index_select(0, idx), torch.div(values.to(buf.dtype), ws))
                return ok
            other, checked = coding.decode(part, index.numel(), buf.dtype, blocks[r], words[r], at=(index, buf.numel()))
            into.add_(other.div_(ws))
            return checked

        times = (t0 + p1.exchange_s, t4)  # codec time: both phases, not the phase-1 payload exchange
        kept = p1.kept + coding.count(words[me], payload)
        return _exchange(state, acc, payload, lengths, summed, times, kept, threshold, place, coding.by_count)

    @staticmethod
    def _scatter(
        state: DCTState, coding: Coding, acc: Accumulated, thresholds: list[torch.Tensor], seg: Segments
    ) -> _Scattered:
        """Phase 1: what this rank selected of each other rank's segment to its owner, and every
        rank's selection of ours, summed in rank order with our own segment whole. The bucket
        and its mask are permuted once, rank by rank: each rank's piece is a view."""
        assert state.pg is not None
        pg, f = state.pg, acc.f
        ws, me = pg.size(), pg.rank()
        mine, blocks = seg.index[me], [seg.blocks(r) for r in range(ws)]
        keep = coding.mask(f, acc.numels, thresholds, acc.mags)
        f_by, keep_by = f[seg.perm], keep[seg.perm]
        eb = state.bound(f)
        peers = [r for r in range(ws) if r != me]  # our own segment does not travel
        firsts: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {me: (seg.zero, None)}
        for r in peers:
            ts = [t for t, w in zip(thresholds, seg.widths[r], strict=True) if w]
            halves = state.halves(seg.index[r].numel(), f.device) if coding.by_count else None
            firsts[r] = coding.first(seg.of(f_by, r), seg.of(keep_by, r), blocks[r], ts, eb, halves)
        if not coding.by_count:  # decoded from the payloads, coded first
            sent = torch.empty_like(f)
            for r in peers:
                sent[seg.index[r]] = coding.sent(seg.of(f_by, r), seg.of(keep_by, r), firsts[r][1])
        else:
            sent = coding.sent(f, keep, None, state.zero(f.dtype, f.device))
        sent[mine] = seg.of(f_by, me)  # what each owner adds for us: our own segment whole
        residual = state.keep_residuals(acc, sent)
        both = torch.empty(2, ws, dtype=torch.int64, device=f.device)  # the words sent, then received
        torch.stack([firsts[r][0] for r in range(ws)], out=both[0])
        dist.all_to_all_single(both[1], both[0], group=pg)
        values, _ = _read([both.view(-1)])  # phase 1's one host read
        out_words, in_words = values[:ws], values[ws:]
        sizes = [0 if r == me else coding.size(seg.index[r].numel(), blocks[r], w) for r, w in enumerate(out_words)]
        recv_sizes = [0 if r == me else coding.size(mine.numel(), blocks[me], w) for r, w in enumerate(in_words)]
        ramp = state.ramp(f.numel(), f.device) if coding.by_count else None
        payloads = [
            torch.empty(0, dtype=torch.uint8, device=f.device)
            if r == me
            else coding.encoded(seg.of(f_by, r), seg.of(keep_by, r), blocks[r], w, firsts[r][1], ramp)
            for r, w in enumerate(out_words)
        ]
        t0 = time.perf_counter()
        received = _all_to_all(state, payloads, recv_sizes)
        exchange_s = time.perf_counter() - t0
        # summed in rank order from zeros (so no -0.0: a payload's entries are added where they go);
        # our own segment first (rank 0's; of two terms, either's) is its sum with 0.0: one op
        own_first = me == 0 or ws == 2
        if own_first:
            total = torch.add(seg.of(f_by, me), 0.0)
        else:
            total = torch.zeros(mine.numel(), dtype=f.dtype, device=f.device)
        checks: list[Check] = []

        def add(r: int, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return total, coding.add(total, part, blocks[me], in_words[r], ramp)

        for r in range(ws):
            if r == me:
                if not own_first:
                    total += seg.of(f_by, me)
                continue
            what = cannot_decode(pg, acc.index, r, recv_sizes[r], state.iteration)
            _, ok = _decoded(what, add, r, received[r])
            checks += [(ok, what)] if ok is not None else []
        wire = sum(8 + n for r, n in enumerate(sizes) if r != me)  # size words and payloads
        kept = sum(coding.count(w, firsts[r][1]) for r, w in enumerate(out_words) if r != me)
        return _Scattered(total, residual, checks, wire, kept, exchange_s)


@dataclass
class _Scattered:
    """What phase 1 of the reduce-scatter leaves to phase 2."""

    total: torch.Tensor  # this rank's segment, summed over the ranks
    residual: torch.Tensor  # this rank's (sender's) residual, bucket-sized
    checks: list[Check]  # the checks of the payloads received, still to read
    wire: int  # bytes this rank sent: size words and payloads
    kept: int  # entries this rank sent
    exchange_s: float  # the payload all-to-all's seconds (not codec time)


AGGREGATIONS = {a.name: a for a in (AllGather(), ReduceScatter())}


def _exchange(
    state: DCTState,
    acc: Accumulated,
    payload: torch.Tensor,
    lengths: list[int],
    sent: torch.Tensor,
    times: tuple[float, float],
    kept: int,
    threshold: float,
    place: Place,
    verify: bool,
) -> Future:
    """All-gather every rank's payload (padded to the longest of ``lengths``) and, when they
    arrive, average: our own ``sent`` and every other rank's payload, ``place``d. ``verify``: the
    decodes leave checks to read (:mod:`.payload`): the sum is made in ``sent`` and reaches the
    bucket only once they hold."""
    assert state.pg is not None
    pg, buf = state.pg, acc.buf
    ws, me = pg.size(), pg.rank()
    src, iteration = dist.get_global_rank(pg, me), state.iteration
    payload = on_the_wire(payload, src=src, dst=-1, direction="dense", iteration=iteration)
    pad = max(lengths) - payload.numel()  # none for the longest: no copy to launch
    padded = torch.nn.functional.pad(payload, (0, pad)) if pad else payload
    outs = [torch.empty_like(padded) for _ in range(ws)]
    fut = dist.all_gather(outs, padded, group=pg, async_op=True).get_future()
    launched = time.perf_counter()
    t0, t1 = times
    state.stats.record(
        raw=ring_allreduce_bytes(buf.numel(), ws),
        wire=(ws - 1) * (8 + max(lengths)),  # each rank's padded payload and size word to every other
        codec_ms=1e3 * (t1 - t0),
        comm_ms=1e3 * (launched - t1),
        kept=kept,
        numel=buf.numel(),
        threshold=threshold,
    )
    verify = verify and ws > 1

    def finish(done: Future[list[torch.Tensor]]) -> torch.Tensor:
        t2 = time.perf_counter()
        parts = done.value()
        into = sent if verify else buf
        torch.div(sent, ws, out=into)  # our own contribution needs no decoding
        checks: list[Check] = []
        for r in range(ws):
            if r == me:
                continue
            what = cannot_decode(pg, acc.index, r, lengths[r], iteration)
            ok = _placed(what, place, r, parts[r][: lengths[r]], into)
            checks += [(ok, what)] if ok is not None else []
        if verify:
            raise_damaged(checks, _stacked([ok for ok, _ in checks]).tolist())  # before the bucket has a value
            buf.copy_(into)
        t3 = time.perf_counter()
        state.stats.record(comm_ms=1e3 * (t2 - launched), codec_ms=1e3 * (t3 - t2))
        return buf

    return fut.then(finish)


def _all_to_all(state: DCTState, payloads: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
    """Send ``payloads[r]`` to rank r and receive every rank's for us (``recv_sizes`` bytes each):
    a variable-size all-to-all, waited for."""
    assert state.pg is not None
    pg = state.pg
    me = pg.rank()
    src = dist.get_global_rank(pg, me)
    payloads = [
        p
        if r == me
        else on_the_wire(p, src=src, dst=dist.get_global_rank(pg, r), direction="dense", iteration=state.iteration)
        for r, p in enumerate(payloads)
    ]
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=payloads[0].device)
    sending = [p for p in payloads if p.numel()]
    send = sending[0] if len(sending) == 1 else torch.cat(payloads)  # one payload alone: no copy to launch
    dist.all_to_all_single(out, send, recv_sizes, [p.numel() for p in payloads], group=pg)
    return list(out.split(recv_sizes))


def _decoded(what: str, decode: Decode, r: int, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``r``'s ``part``, decoded; any codec failure raised as :class:`DenseCommError` naming
    the transfer (``what``)."""
    try:
        return decode(r, part)
    except Exception as e:  # keep the cause chained
        raise DenseCommError(f"{what}: {type(e).__name__}: {e}") from e


def _placed(what: str, place: Place, r: int, part: torch.Tensor, into: torch.Tensor) -> torch.Tensor | None:
    """:func:`_decoded` of a payload ``place``d in ``into``: its check."""
    return _decoded(what, lambda r, part: (into, place(r, part, into)), r, part)[1]


def _read(
    ints: Sequence[torch.Tensor], floats: Sequence[torch.Tensor] = (), checks: Sequence[Check] = ()
) -> tuple[list[int], list[float]]:
    """A phase's one host read: the int64 ``ints`` (flat, in order), the 0-d float32 ``floats``
    (exact as float64, carried as their bits) and the ``checks`` of received payloads, of which a
    failed one raises."""
    parts = list(ints)
    if floats:
        exact = torch.empty(len(floats), dtype=torch.float64, device=floats[0].device)
        parts.append(torch.stack(list(floats), out=exact).view(torch.int64))  # float64 in the stack's one op
    if checks:
        parts.append(_stacked([ok for ok, _ in checks]).long())
    values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    n = len(values) - len(floats) - len(checks)
    raise_damaged(checks, values[n + len(floats) :])
    bits = values[n : n + len(floats)]
    return values[:n], list(struct.unpack(f"<{len(bits)}d", struct.pack(f"<{len(bits)}q", *bits)))


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d tensors as one 1-d tensor (one alone as a view: no copy to launch)."""
    return tensors[0].reshape(1) if len(tensors) == 1 else torch.stack(tensors)


def raise_damaged(checks: Sequence[Check], holds: Sequence[object]) -> None:
    """Raise :class:`DenseCommError` for the first payload whose check failed."""
    for (_, what), ok in zip(checks, holds, strict=True):
        if not ok:
            e = PayloadError("checksum mismatch: the payload is corrupted")
            raise DenseCommError(f"{what}: {type(e).__name__}: {e}")
