"""The dense (data-parallel) gradient all-reduce through a DDP communication hook.

:class:`DenseComm` is one `dense_comm` choice with its per-rank state and statistics;
:class:`CompressedDataParallelWrapper` is TorchRec's data-parallel wrapper seam of
``DistributedModelParallel``, which registers the hook on the DDP module it builds. The training
loop does not change.

DCT-DP, per DDP bucket (Gupta et al., KDD'21): ``f = g + residual``; every ``refresh_every``
iterations the threshold of each parameter in it becomes the k-th largest of its ``|f|`` (k = keep
x numel; parameters under ``min_numel`` travel whole, as do buckets under it); every iteration the
entries with ``|f| >= threshold`` travel (:class:`compression.sparse.ThresholdCodec`: positions as
delta-coded indices or a bitmap, whichever is smaller; values exact, fp16/bf16 or lossy) in a
variable-size all-gather (sizes first), every rank adds what all ranks sent and divides by the
world size like DDP's average; ``residual = f - what was sent, as decoded``. Non-finite entries
always travel, exactly (as in the all-to-alls): they leave no residual and do not set the lossy
values' bound. Residuals and thresholds are kept per parameter (so a rebuilt bucket layout, e.g.
after DDP's first iteration or a resume, keeps them) and checkpointed per rank. A payload that
fails to decode raises on the receiving ranks; the sender stops at its next collective's timeout
(the process group's).

``dense_comm.aggregation=reduce_scatter`` sums the payloads by segment owners instead
(:meth:`DenseComm._dct_reduce_scatter`): each rank receives ~2 (W-1)/W payloads, not W-1; the
owners' own error feedback is the ``owner_residuals``, checkpointed beside the residuals. On an
accelerator it makes one host synchronisation per phase (:meth:`DenseComm._dct_reduce_scatter_device`).

On the device backend (:meth:`ThresholdCodec.coded_on_host` false; cast values) a bucket makes
one host synchronisation, the read of the size all-gather: each rank gathers one word, its count
and delta width (from which every rank computes every payload's size), and the same read brings
this rank's statistics (residual norm, threshold) and the checks of the payloads received before.
Thresholds stay 0-d tensors, positions are coded and every payload decoded on the device
(:meth:`~compression.sparse.ThresholdCodec.encode_known`), and our own contribution is computed
from ``f``, not decoded. A damaged payload found by such a check raises at the next read (the
next bucket's, or :meth:`DenseComm.check`: at checkpoints and the end of the run), naming where it
was received; its contribution is left out meanwhile. On the CPU the positions are zstd-coded
on the host, smaller and faster there.

Statistics (``dense/*`` keys of :mod:`dlrm.embedding_comm.stats`): ``raw_bytes`` is what stock DDP's ring
all-reduce of fp32 gradients sends per rank (2 (W-1)/W x 4 bytes per element), ``wire_bytes``
what the chosen hook sends (a ring all-reduce of the cast or low-rank factors; for DCT the
all-gather of the padded payloads, (W-1) x the largest, plus the size words; with the
reduce-scatter, its all-to-all's payloads and size words too); ``codec_ms`` the
host time of encoding and decoding, ``comm_ms`` the time from launch to arrival (it overlaps the
rest of the backward). DCT adds ``kept``/``numel`` (-> ``keep``), the largest ``threshold`` and
``residual_norm`` (the L2 norm of this rank's residuals after the iteration, largest over ranks).
The statistics are written under a lock from the collectives' callbacks and read at log time,
after DDP has waited for every bucket's future (so a read never races a write).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.types import ShardingEnv

import dlrm_compression as compression
from dlrm.dense_comm.config import DenseCommSpec
from dlrm.embedding_comm.stats import CommStats
from dlrm.performance.network import cheaper_aggregation, ring_allreduce_bytes, sparse_aggregation_bytes
from dlrm.process.instrument import on_the_wire
from dlrm.trainer.state import CheckpointError, PerRank, numpy_rng_state, numpy_rng_tuple
from dlrm_compression.format import PayloadError
from dlrm_compression.sparse import ThresholdCodec, delta_width, kth_largest_abs, refresh_due
from dlrm_compression.sparse import kth_largest_abs_tensor as kth_largest

Future = torch.futures.Future


class DenseCommError(RuntimeError):
    """A dense-gradient payload could not be decoded; the message names the ranks and the bucket."""


# PowerSGD's state; its hyperparameters (rank, start, ...) come from the config, not a checkpoint.
_POWERSGD_STATE = (
    "rng",
    "error_dict",
    "p_memory_dict",
    "q_memory_dict",
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
)


class DenseComm(PerRank):
    """One `dense_comm` choice: its hook, per-rank state (DCT residuals and thresholds, PowerSGD
    matrices), and statistics. Built before the model is wrapped; :meth:`install` hooks it in."""

    def __init__(self, spec: DenseCommSpec) -> None:
        self.spec = spec
        self.stats = CommStats()
        self.iteration = 0  # DDP backward passes seen (DCT's refresh schedule; checkpointed)
        self._process_iterations = 0  # backward passes of this process (not restored on resume)
        self.thresholds: dict[str, torch.Tensor] = {}  # parameter name -> threshold (0-d, on the gradients' device)
        self.refreshes: list[tuple[int, str]] = []  # (iteration, parameter name) of every refresh
        self.residuals: dict[str, torch.Tensor] = {}  # parameter name -> flat residual
        # reduce-scatter aggregation: parameter name -> what this rank, as the owner of a segment,
        # dropped from its sum (flat, zeros outside the segment)
        self.owner_residuals: dict[str, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        self._norm_sq = 0.0  # squared residual norm of the buckets seen this iteration
        self._unread: list[tuple[torch.Tensor, str]] = []  # device path: (check holds, where) of received payloads
        self._codec = ThresholdCodec(values=spec.values).with_backend(spec.backend)
        self._sizer = ThresholdCodec(values="none" if spec.values == "lossy" else spec.values).with_backend(
            spec.backend
        )  # header sizes
        self._lock = threading.Lock()  # future callbacks run on the collectives' threads
        self.pg: dist.ProcessGroup | None = None
        self.powersgd: PowerSGDState | None = None
        # dense_comm=auto: the option in use (the others' name is their own), and while
        # calibrating, every option measured on the real buckets as (option, raw, wire, enc s, dec s)
        self.mode = spec.fallback if spec.name == "auto" else spec.name
        self.calibrating = False
        self.samples: list[tuple[str, float, float, float, float]] = []

    # -- installation ---------------------------------------------------------------------------

    def prepare(self, module: torch.nn.Module, pg: dist.ProcessGroup) -> None:
        """Learn the parameter names of the DDP module and build PowerSGD's state (no hook yet)."""
        self.pg = pg
        self._names = {id(p): n for n, p in module.named_parameters()}
        if self.spec.name == "powersgd":
            self.powersgd = PowerSGDState(
                process_group=pg,
                matrix_approximation_rank=self.spec.rank,
                start_powerSGD_iter=self.spec.start_iter,
                min_compression_rate=self.spec.min_compression_rate,
                use_error_feedback=True,
                warm_start=self.spec.warm_start,
                random_seed=0,
            )

    def install(self, ddp: DistributedDataParallel, pg: dist.ProcessGroup) -> None:
        """Register the hook on ``ddp`` (nothing for ``none``: stock DDP)."""
        self.prepare(ddp.module, pg)
        if self.spec.hooked:
            ddp.register_comm_hook(self, dense_comm_hook)

    # -- the hooks ------------------------------------------------------------------------------

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        assert self.pg is not None, "DenseComm.install() was not called"
        buf = bucket.buffer()
        ws = self.pg.size()
        raw = ring_allreduce_bytes(buf.numel(), ws)
        if self.calibrating:
            self.samples.extend(self._calibrate(buf, ws))
        kind = self.mode
        t0 = time.perf_counter()
        if kind == "dct" and buf.numel() >= self.spec.min_numel:
            device = self.spec.values != "lossy" and not self._codec.coded_on_host(buf.device)
            if self.aggregation([p.numel() for p in bucket.parameters()], ws) == "reduce_scatter":
                fut = self._dct_reduce_scatter_device(bucket, t0) if device else self._dct_reduce_scatter(bucket, t0)
            else:
                fut = self._dct_device(bucket, t0) if device else self._dct(bucket, t0)
        else:
            if kind == "powersgd":
                fut, sent = self._powersgd(bucket)
                wire = ring_allreduce_bytes(sent, ws)
            elif kind in ("fp16", "bf16"):  # torch's hooks; called, not registered: bf16 runs on gloo
                hook = default_hooks.fp16_compress_hook if kind == "fp16" else default_hooks.bf16_compress_hook
                fut = hook(self.pg, bucket)
                wire = ring_allreduce_bytes(buf.numel(), ws, 2.0)
            else:  # a DCT bucket under min_numel: stock average
                fut = default_hooks.allreduce_hook(self.pg, bucket)
                wire = raw
            launched = time.perf_counter()
            self._record(raw=raw, wire=wire, codec_ms=1e3 * (launched - t0))
            fut = fut.then(self._arrived(launched))
        if bucket.is_last():
            if kind == "dct":
                self._record(residual_norm=self._norm_sq**0.5)
                self._norm_sq = 0.0
            self.iteration += 1
            self._process_iterations += 1
        return fut

    def _powersgd(self, bucket: dist.GradBucket) -> tuple[Future[torch.Tensor], int]:
        """torch's PowerSGD hook, and the elements it sends.

        The first backward of every process is a plain all-reduce, as torch's hook does before
        ``start_iter``: PowerSGD keys its state by bucket index, and DDP's first iteration uses
        one bucket of everything before rebuilding the layout that a resumed state belongs to.
        """
        ps = self.powersgd
        assert ps is not None and self.pg is not None
        if self._process_iterations == 0:
            ps.maybe_increase_iter(bucket)
            return default_hooks.allreduce_hook(self.pg, bucket), bucket.buffer().numel()
        before = (ps.total_numel_before_compression, ps.total_numel_after_compression)
        fut = powerSGD_hook(ps, bucket)
        after = (ps.total_numel_before_compression, ps.total_numel_after_compression)
        return fut, after[1] - before[1] if after[0] > before[0] else bucket.buffer().numel()  # vanilla before start

    def _arrived(self, launched: float) -> Callable[[Future[torch.Tensor]], torch.Tensor]:
        def done(f: Future[torch.Tensor]) -> torch.Tensor:
            self._record(comm_ms=1e3 * (time.perf_counter() - launched))
            value = f.value()
            return value[0] if isinstance(value, list) else value

        return done

    def _dct(self, bucket: dist.GradBucket, t0: float) -> Future[torch.Tensor]:
        """DCT on the host path: thresholds read as floats, the payload coded by the codec (zstd
        positions), one blocking size all-gather, each received payload checked as it is decoded."""
        assert self.pg is not None
        pg, spec = self.pg, self.spec
        buf, layout, numels, f = self._accumulated(bucket)
        thresholds = [
            float(self._threshold(name, piece)) for (name, _), piece in zip(layout, f.split(numels), strict=True)
        ]
        # the bound scales with the largest finite |f|: non-finite entries travel exactly, unbounded
        eb = spec.values_eb * float(f.abs().nan_to_num(0.0, 0.0).max()) if spec.values == "lossy" else None
        payload = self._codec.encode(f.view(1, -1), eb, blocks=numels, thresholds=thresholds)
        sent = self._codec.decode(payload).view(-1)  # exactly what every rank adds for us
        residual = self._keep_residuals(f, sent, layout, numels)
        self._norm_sq += float(torch.linalg.vector_norm(residual)) ** 2
        kept = self._codec.count(payload)
        t1 = time.perf_counter()
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=buf.device)
        sizes = [torch.empty_like(size) for _ in range(pg.size())]
        dist.all_gather(sizes, size, group=pg)
        lengths = [int(s) for s in sizes]

        def decode(r: int, part: torch.Tensor, what: str) -> torch.Tensor:
            return compression.decode(part).view(-1)

        return self._exchange(bucket, payload, lengths, sent, (t0, t1), kept, max(thresholds), decode)

    def _dct_device(self, bucket: dist.GradBucket, t0: float) -> Future[torch.Tensor]:
        """:meth:`_dct` with one host synchronisation: the read of the size all-gather, which also
        brings back this rank's residual norm and threshold and the checks of earlier payloads."""
        assert self.pg is not None
        pg, codec = self.pg, self._codec
        ws, me = pg.size(), pg.rank()
        buf, layout, numels, f, thresholds, keep = self._kept(bucket)
        sent = codec.sent(f, keep)  # exactly what every rank decodes from our payload
        residual = self._keep_residuals(f, sent, layout, numels)
        t1 = time.perf_counter()
        word = (keep.sum() * 64 + delta_width(keep) - 1).reshape(1)  # count and delta width (1..64)
        words = [torch.empty_like(word) for _ in range(ws)]
        dist.all_gather(words, word, group=pg)
        with self._lock:
            unread, self._unread = self._unread, []
        mine = [torch.linalg.vector_norm(residual), torch.stack(thresholds).max()]  # float32, exact as float64
        checks = [ok.reshape(1).long() for ok, _ in unread]
        read = torch.cat([*words, torch.stack(mine).double().view(torch.int64), *checks])
        values = read.tolist()  # the one host synchronisation of the bucket
        self._raise_damaged(unread, values[ws + 2 :])
        norm, threshold = struct.unpack("<2d", struct.pack("<2q", *values[ws : ws + 2]))
        self._norm_sq += norm**2
        counts, widths = [v >> 6 for v in values[:ws]], [(v & 63) + 1 for v in values[:ws]]
        lengths = [codec.payload_size(buf.numel(), numels, counts[r], widths[r]) for r in range(ws)]
        payload = codec.encode_known(f.view(1, -1), keep, counts[me], widths[me], numels)

        def decode(r: int, part: torch.Tensor, what: str) -> torch.Tensor:
            other, ok = codec.decode_known(part, (1, buf.numel()), buf.dtype, numels, counts[r], widths[r])
            with self._lock:
                self._unread.append((ok, what))  # read with the next bucket's sizes, or by check()
            return other.view(-1).masked_fill_(~ok, 0.0)  # a damaged payload adds nothing

        return self._exchange(bucket, payload, lengths, sent, (t0, t1), counts[me], threshold, decode)

    def aggregation(self, numels: list[int], ws: int) -> str:
        """How a DCT bucket of parameters of ``numels`` entries is summed over ``ws`` ranks:
        ``dense_comm.aggregation``, or with ``auto`` the one that sends fewer bytes per rank
        (:func:`~compression.cost_model.cheaper_aggregation`) for ``keep`` x entries, each a value
        and about a byte of position, in payloads with this bucket's header. A bucket without a
        parameter of ``ws`` entries or more, whose pieces would leave a rank's segment empty, is
        all-gathered."""
        choice = self.spec.aggregation
        if choice == "auto":
            item = 2 if self.spec.values in ("fp16", "bf16") else 4
            header = self._sizer.payload_size(sum(numels), numels, 0, 1)  # no entry: headers only
            choice = cheaper_aggregation((item + 1) * self.spec.keep * sum(numels), ws, header)
        return choice if max(numels) >= ws else "allgather"

    def _dct_reduce_scatter(self, bucket: dist.GradBucket, t0: float) -> Future[torch.Tensor]:
        """DCT summed by segment owners (SparCML's split all-gather; gTop-k): bytes per rank that
        do not grow with W. Each parameter is cut into W contiguous pieces, rank r owning the
        r-th of each (its segment): per parameter, not per bucket, so that DDP's bucket layout
        (rebuilt after the first iteration of every process, a resumed one too) moves nothing.

        Phase 1, a sparse reduce-scatter: each rank sends every other rank the entries of its
        segment above this rank's thresholds (a variable-size all-to-all, sizes first; this rank's
        residual keeps the rest, as with the all-gather) and adds its own segment whole (it does not
        travel); the owner sums them in rank order. Phase 2: the owner keeps the ``keep`` fraction of
        each piece of its summed segment (the k-th largest |sum| as threshold, every iteration;
        pieces of parameters under ``min_numel`` whole), what it drops staying in its owner residual
        (added to the next iteration's ``f``), and all-gathers it (:meth:`_exchange`). Phase 1 is
        waited for in the hook: phase 2's collectives must be issued in the same order on every
        rank, which a callback on the collectives' threads cannot keep. Host coding (positions
        through the codec's own path)."""
        assert self.pg is not None
        pg, spec, codec = self.pg, self.spec, self._codec
        ws, me = pg.size(), pg.rank()
        buf, layout, numels, f = self._accumulated(bucket)
        thresholds = [
            float(self._threshold(name, piece)) for (name, _), piece in zip(layout, f.split(numels), strict=True)
        ]
        eb = spec.values_eb * float(f.abs().nan_to_num(0.0, 0.0).max()) if spec.values == "lossy" else None
        owned = _segments(numels, ws, buf.device)  # per rank: its positions in the bucket, and piece widths
        segments = [f[index] for index, _ in owned]
        payloads = []
        for r, (seg, (_, widths)) in enumerate(zip(segments, owned, strict=True)):
            ts = [t for t, w in zip(thresholds, widths, strict=True) if w]
            empty = torch.zeros(0, dtype=torch.uint8, device=buf.device)  # our own segment does not travel
            blocks = [w for w in widths if w]
            payloads.append(empty if r == me else codec.encode(seg.view(1, -1), eb, blocks=blocks, thresholds=ts))
        # what each owner adds for us: our own segment whole, the others as decoded
        sent = torch.empty_like(f)
        for r, (index, _) in enumerate(owned):
            sent[index] = segments[r] if r == me else codec.decode(payloads[r]).view(-1)
        residual = self._keep_residuals(f, sent, layout, numels)
        kept = sum(codec.count(p) for r, p in enumerate(payloads) if r != me)
        t1 = time.perf_counter()
        received = self._all_to_all(payloads)
        t2 = time.perf_counter()
        mine, widths = owned[me]
        total = torch.zeros(mine.numel(), dtype=buf.dtype, device=buf.device)
        for r in range(ws):
            total += segments[me] if r == me else self._decoded(bucket, r, received[r], mine.numel())
        # phase 2: the owner's own selection of each piece of the summed segment, its own error feedback
        blocks = [w for w in widths if w]
        eb_own = spec.values_eb * float(total.abs().nan_to_num(0.0, 0.0).max()) if spec.values == "lossy" else None
        payload = codec.encode(
            total.view(1, -1), eb_own, blocks=blocks, thresholds=self._owner_thresholds(total, numels, widths)
        )
        summed, dropped = self._keep_owner_residuals(total, codec.decode(payload).view(-1), mine, layout, numels)
        self._norm_sq += float(torch.linalg.vector_norm(residual)) ** 2 + float(torch.linalg.vector_norm(dropped)) ** 2
        t3 = time.perf_counter()
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=buf.device)
        sizes = [torch.empty_like(size) for _ in range(ws)]
        dist.all_gather(sizes, size, group=pg)
        lengths = [int(s) for s in sizes]
        self._record(
            wire=sum(8 + p.numel() for r, p in enumerate(payloads) if r != me),  # phase 1: size word and payload
            comm_ms=1e3 * (t2 - t1),
        )

        def decode(r: int, part: torch.Tensor, what: str) -> torch.Tensor:
            other = torch.zeros_like(buf)
            other[owned[r][0]] = _segment_of(compression.decode(part), owned[r][0].numel())
            return other

        times = (t0 + (t2 - t1), t3)  # codec time: both phases, not the phase-1 exchange between
        return self._exchange(
            bucket, payload, lengths, summed, times, kept + codec.count(payload), max(thresholds), decode
        )

    def _dct_reduce_scatter_device(self, bucket: dist.GradBucket, t0: float) -> Future[torch.Tensor]:
        """:meth:`_dct_reduce_scatter` with one host synchronisation per phase: phase 1 reads the
        all-to-all of one word per destination (count and delta width of each segment's entries,
        from which both sides compute every payload's size), phase 2 the all-gather of the owner's
        word, with this rank's statistics and the checks of the payloads received before."""
        assert self.pg is not None
        pg, codec = self.pg, self._codec
        ws, me = pg.size(), pg.rank()
        buf, layout, numels, f, thresholds, keep = self._kept(bucket)
        owned = _segments(numels, ws, buf.device)
        segments = [f[index] for index, _ in owned]
        sent = codec.sent(f, keep)  # exactly what each owner decodes from our payload
        sent[owned[me][0]] = segments[me]  # our own segment counts whole
        residual = self._keep_residuals(f, sent, layout, numels)
        masks = [keep[index] for index, _ in owned]
        words = torch.stack([m.sum() * 64 + delta_width(m) - 1 for m in masks])  # count and width (1..64)
        recv = torch.empty_like(words)
        dist.all_to_all_single(recv, words, group=pg)
        values = torch.cat([words, recv]).tolist()  # phase 1's one host synchronisation
        out_words, in_words = values[:ws], values[ws:]
        blocks = [[w for w in widths if w] for _, widths in owned]
        send_sizes = [
            codec.payload_size(m.numel(), blocks[r], v >> 6, (v & 63) + 1)
            for r, (m, v) in enumerate(zip(masks, out_words, strict=True))
        ]
        mine = owned[me][0]
        recv_sizes = [codec.payload_size(mine.numel(), blocks[me], v >> 6, (v & 63) + 1) for v in in_words]
        empty = torch.zeros(0, dtype=torch.uint8, device=buf.device)
        payloads = [
            empty if r == me else codec.encode_known(segments[r].view(1, -1), masks[r], v >> 6, (v & 63) + 1, blocks[r])
            for r, v in enumerate(out_words)
        ]
        send_sizes[me] = recv_sizes[me] = 0
        t2 = time.perf_counter()
        received = self._all_to_all(payloads, recv_sizes)
        t3 = time.perf_counter()
        total = torch.zeros(mine.numel(), dtype=buf.dtype, device=buf.device)
        for r, v in enumerate(in_words):
            if r == me:
                total += segments[me]
                continue
            what = _cannot_decode(pg, bucket.index(), r, recv_sizes[r], self.iteration)
            other, ok = codec.decode_known(received[r], (1, mine.numel()), buf.dtype, blocks[me], v >> 6, (v & 63) + 1)
            with self._lock:
                self._unread.append((ok, what))
            total += other.view(-1).masked_fill_(~ok, 0.0)  # a damaged payload adds nothing
        # phase 2, as on the host
        keep2 = codec.mask(total.view(1, -1), blocks[me], self._owner_thresholds(total, numels, owned[me][1])).view(-1)
        summed, dropped = self._keep_owner_residuals(total, codec.sent(total, keep2), mine, layout, numels)
        word = (keep2.sum() * 64 + delta_width(keep2) - 1).reshape(1)
        gathered = [torch.empty_like(word) for _ in range(ws)]
        t4 = time.perf_counter()
        dist.all_gather(gathered, word, group=pg)
        with self._lock:
            unread, self._unread = self._unread, []
        norm = torch.stack([torch.linalg.vector_norm(residual), torch.linalg.vector_norm(dropped)])
        stats = torch.cat([norm, torch.stack(thresholds).max().reshape(1)]).double().view(torch.int64)
        checks = [ok.reshape(1).long() for ok, _ in unread]
        values = torch.cat([*gathered, stats, *checks]).tolist()  # phase 2's one host synchronisation
        self._raise_damaged(unread, values[ws + 3 :])
        sender_norm, owner_norm, threshold = struct.unpack("<3d", struct.pack("<3q", *values[ws : ws + 3]))
        self._norm_sq += sender_norm**2 + owner_norm**2
        counts, widths = [v >> 6 for v in values[:ws]], [(v & 63) + 1 for v in values[:ws]]
        lengths = [codec.payload_size(owned[r][0].numel(), blocks[r], counts[r], widths[r]) for r in range(ws)]
        payload = codec.encode_known(total.view(1, -1), keep2, counts[me], widths[me], blocks[me])
        self._record(wire=sum(8 + n for r, n in enumerate(send_sizes) if r != me), comm_ms=1e3 * (t3 - t2))
        kept = sum(v >> 6 for r, v in enumerate(out_words) if r != me) + counts[me]

        def decode(r: int, part: torch.Tensor, what: str) -> torch.Tensor:
            index = owned[r][0]
            seg, ok = codec.decode_known(part, (1, index.numel()), buf.dtype, blocks[r], counts[r], widths[r])
            with self._lock:
                self._unread.append((ok, what))  # read with the next bucket's sizes, or by check()
            other = torch.zeros_like(buf)
            other[index] = seg.view(-1).masked_fill_(~ok, 0.0)
            return other

        times = (t0 + (t3 - t2), t4)  # codec time: both phases, not the phase-1 payload exchange
        return self._exchange(bucket, payload, lengths, summed, times, kept, threshold, decode)

    def _owner_thresholds(self, total: torch.Tensor, numels: list[int], widths: list[int]) -> list[torch.Tensor]:
        """The reduce-scatter owner's threshold of each piece of its summed segment ``total`` (one
        per non-empty piece of ``widths``): its k-th largest ``|sum|`` for ``keep``, every
        iteration, or 0 (all of it) for a parameter under ``min_numel``."""
        pieces = [(n, w) for n, w in zip(numels, widths, strict=True) if w]
        zero = torch.zeros((), dtype=torch.float32, device=total.device)
        return [
            kth_largest(piece, self.spec.keep) if n >= self.spec.min_numel else zero
            for (n, _), piece in zip(pieces, total.split([w for _, w in pieces]), strict=True)
        ]

    def _keep_owner_residuals(
        self,
        total: torch.Tensor,
        kept: torch.Tensor,
        mine: torch.Tensor,
        layout: list[tuple[str, int]],
        numels: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the owner of the bucket positions ``mine`` sends of their sum ``total`` (``kept``,
        as decoded) and drops, each placed in a bucket-sized tensor; what it drops becomes each
        parameter's owner residual."""
        summed = torch.zeros(sum(numels), dtype=total.dtype, device=total.device)
        summed[mine] = kept
        dropped = torch.zeros_like(summed)
        dropped[mine] = (total - kept).masked_fill_(~total.isfinite(), 0.0)  # sent exactly: no residual
        for (name, _), piece in zip(layout, dropped.split(numels), strict=True):
            self.owner_residuals[name] = piece
        return summed, dropped

    def _all_to_all(self, payloads: list[torch.Tensor], recv_sizes: list[int] | None = None) -> list[torch.Tensor]:
        """Send ``payloads[r]`` to rank r and receive every rank's for us: a variable-size
        all-to-all, waited for; the sizes first (one read) unless ``recv_sizes`` are known."""
        assert self.pg is not None
        pg = self.pg
        me = pg.rank()
        src = dist.get_global_rank(pg, me)
        payloads = [
            p
            if r == me
            else on_the_wire(p, src=src, dst=dist.get_global_rank(pg, r), direction="dense", iteration=self.iteration)
            for r, p in enumerate(payloads)
        ]
        send_sizes = [p.numel() for p in payloads]
        if recv_sizes is None:
            sizes = torch.tensor(send_sizes, dtype=torch.int64, device=payloads[0].device)
            recv = torch.empty_like(sizes)
            dist.all_to_all_single(recv, sizes, group=pg)
            recv_sizes = recv.tolist()
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=payloads[0].device)
        dist.all_to_all_single(out, torch.cat(payloads), recv_sizes, send_sizes, group=pg)
        return list(out.split(recv_sizes))

    def _decoded(self, bucket: dist.GradBucket, r: int, part: torch.Tensor, numel: int) -> torch.Tensor:
        """Rank r's phase-1 payload for our segment of ``numel`` entries, decoded; a damaged one
        raises :class:`DenseCommError` naming the transfer."""
        assert self.pg is not None
        what = _cannot_decode(self.pg, bucket.index(), r, part.numel(), self.iteration)
        try:
            return _segment_of(compression.decode(part), numel)
        except Exception as e:  # any codec failure: name the transfer, keep the cause chained
            raise DenseCommError(f"{what}: {type(e).__name__}: {e}") from e

    def _kept(
        self, bucket: dist.GradBucket
    ) -> tuple[torch.Tensor, list[tuple[str, int]], list[int], torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """:meth:`_accumulated`, each parameter's threshold (0-d tensors, on the device) and where
        the accumulated gradients reach it (bool), without a host wait."""
        buf, layout, numels, f = self._accumulated(bucket)
        thresholds = [self._threshold(name, piece) for (name, _), piece in zip(layout, f.split(numels), strict=True)]
        return buf, layout, numels, f, thresholds, self._codec.mask(f.view(1, -1), numels, thresholds).view(-1)

    def _accumulated(
        self, bucket: dist.GradBucket
    ) -> tuple[torch.Tensor, list[tuple[str, int]], list[int], torch.Tensor]:
        """The bucket's buffer, its parameters (name, numel), their numels, and the gradients
        plus each parameter's residual and owner residual (what this rank, owning pieces of it in
        the reduce-scatter, dropped from their sums: consumed here, its own pieces counting whole)."""
        buf = bucket.buffer()
        layout = [(self._names.get(id(p), f"param{i}"), p.numel()) for i, p in enumerate(bucket.parameters())]
        numels = [n for _, n in layout]
        held = torch.cat([self._residual(self.residuals.get(name), numel, buf) for name, numel in layout])
        owned = [self.owner_residuals.pop(name, None) for name, _ in layout]  # consumed: f carries them now
        if any(o is not None for o in owned):
            held += torch.cat([self._residual(o, numel, buf) for o, numel in zip(owned, numels, strict=True)])
        return buf, layout, numels, buf + held

    def _keep_residuals(
        self, f: torch.Tensor, sent: torch.Tensor, layout: list[tuple[str, int]], numels: list[int]
    ) -> torch.Tensor:
        """What was not sent becomes each parameter's residual; returns it whole."""
        residual = (f - sent).masked_fill_(~f.isfinite(), 0.0)  # sent exactly; inf - inf is no residual
        for (name, _), piece in zip(layout, residual.split(numels), strict=True):
            self.residuals[name] = piece
        return residual

    def _exchange(
        self,
        bucket: dist.GradBucket,
        payload: torch.Tensor,
        lengths: list[int],
        sent: torch.Tensor,
        times: tuple[float, float],
        kept: int,
        threshold: float,
        decode: Callable[[int, torch.Tensor, str], torch.Tensor],
    ) -> Future[torch.Tensor]:
        """All-gather every rank's payload (padded to the longest of ``lengths``) and, when they
        arrive, average: our own ``sent`` and every other rank's ``decode``d payload."""
        assert self.pg is not None
        pg, buf = self.pg, bucket.buffer()
        ws, me = pg.size(), pg.rank()
        global_rank = [dist.get_global_rank(pg, r) for r in range(ws)]
        payload = on_the_wire(payload, src=global_rank[me], dst=-1, direction="dense", iteration=self.iteration)
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=buf.device)
        padded[: payload.numel()] = payload
        outs = [torch.empty_like(padded) for _ in range(ws)]
        fut = dist.all_gather(outs, padded, group=pg, async_op=True).get_future()
        launched = time.perf_counter()
        t0, t1 = times
        self._record(
            raw=ring_allreduce_bytes(buf.numel(), ws),
            wire=(ws - 1) * (8 + max(lengths)),  # each rank's padded payload and size word to every other
            codec_ms=1e3 * (t1 - t0),
            comm_ms=1e3 * (launched - t1),
            kept=kept,
            numel=buf.numel(),
            threshold=threshold,
        )
        index, iteration = bucket.index(), self.iteration

        def finish(done: Future[list[torch.Tensor]]) -> torch.Tensor:
            t2 = time.perf_counter()
            parts = done.value()
            torch.div(sent, ws, out=buf)  # our own contribution needs no decoding
            for r in range(ws):
                if r == me:
                    continue
                what = _cannot_decode(pg, index, r, lengths[r], iteration)
                try:
                    other = decode(r, parts[r][: lengths[r]], what)
                except Exception as e:  # any codec failure: name the transfer, keep the cause chained
                    raise DenseCommError(f"{what}: {type(e).__name__}: {e}") from e
                if other.numel() != buf.numel():
                    raise DenseCommError(f"{what}: {other.numel()} gradients, expected {buf.numel()}")
                buf.add_(other.div_(ws))
            t3 = time.perf_counter()
            self._record(comm_ms=1e3 * (t2 - launched), codec_ms=1e3 * (t3 - t2))
            return buf

        return fut.then(finish)

    def check(self) -> None:
        """Read the checks of the payloads received on the device path and not read yet (one host
        synchronisation); raise :class:`DenseCommError` for the first damaged one."""
        with self._lock:
            unread, self._unread = self._unread, []
        if unread:
            self._raise_damaged(unread, torch.stack([ok for ok, _ in unread]).tolist())

    @staticmethod
    def _raise_damaged(unread: list[tuple[torch.Tensor, str]], holds: list[Any]) -> None:
        for (_, what), ok in zip(unread, holds, strict=True):
            if not ok:
                e = PayloadError("checksum mismatch: the payload is corrupted")
                raise DenseCommError(f"{what}: {type(e).__name__}: {e}")

    def _calibrate(self, buf: torch.Tensor, ws: int) -> list[tuple[str, float, float, float, float]]:
        """dense_comm=auto: what each option would cost on this bucket (raw and wire bytes per rank
        as a ring all-reduce would send them, encode and decode seconds)."""
        raw = ring_allreduce_bytes(buf.numel(), ws)
        out = [("none", raw, raw, 0.0, 0.0)]
        for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            t0 = time.perf_counter()
            half = buf.to(dtype)
            t1 = time.perf_counter()
            half.to(buf.dtype)
            out.append((name, raw, raw / 2, t1 - t0, time.perf_counter() - t1))
        if buf.numel() >= self.spec.min_numel:
            t0 = time.perf_counter()
            payload = self._codec.encode(buf.view(1, -1), None, thresholds=[kth_largest_abs(buf, self.spec.keep)])
            t1 = time.perf_counter()
            self._codec.decode(payload)
            t2 = time.perf_counter()
            # decode: every other rank's payload (W - 1 of them) and our own
            header = self._sizer.payload_size(buf.numel(), [buf.numel()], 0, 1)
            aggregation = self.aggregation([buf.numel()], ws)
            wire = sparse_aggregation_bytes(payload.numel() - header, ws, aggregation, header)
            out.append(("dct", raw, wire, t1 - t0, (t2 - t1) * ws))
        return out

    # -- DCT state ------------------------------------------------------------------------------

    @staticmethod
    def _residual(r: torch.Tensor | None, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A parameter's residual ``r`` (zeros before its first iteration), on the gradients' device."""
        if r is None or r.numel() != numel:
            return torch.zeros(numel, dtype=like.dtype, device=like.device)
        return r.to(device=like.device, dtype=like.dtype)

    def refresh_due(self, iteration: int) -> bool:
        """Whether thresholds are refreshed at ``iteration`` (:func:`compression.sparse.refresh_due`)."""
        return refresh_due(iteration, self.spec.refresh_every, self.spec.refresh_warmup)

    def _threshold(self, name: str, f: torch.Tensor) -> torch.Tensor:
        """A parameter's threshold (a 0-d float32 tensor on ``f``'s device: no host wait):
        refreshed on schedule (and when first seen); 0 (send all) for parameters under
        ``min_numel``. Kept per parameter, not per bucket, so that DDP's bucket rebuild after its
        first iterations (and a resume) does not move the schedule."""
        if f.numel() < self.spec.min_numel:
            return torch.zeros((), dtype=torch.float32, device=f.device)
        if name not in self.thresholds or self.refresh_due(self.iteration):
            self.thresholds[name] = kth_largest(f, self.spec.keep)
            self.refreshes.append((self.iteration, name))
        elif self.thresholds[name].device != f.device:  # restored from a checkpoint: moved once
            self.thresholds[name] = self.thresholds[name].to(f.device, non_blocking=True)
        return self.thresholds[name]

    # -- statistics and checkpoints -------------------------------------------------------------

    def _record(
        self,
        *,
        raw: float | None = None,
        wire: float | None = None,
        codec_ms: float | None = None,
        comm_ms: float | None = None,
        kept: int | None = None,
        numel: int | None = None,
        threshold: float | None = None,
        residual_norm: float | None = None,
    ) -> None:
        with self._lock:
            for name, value in (
                ("raw_bytes", raw),
                ("wire_bytes", wire),
                ("codec_ms", codec_ms),
                ("comm_ms", comm_ms),
                ("kept", kept),
                ("numel", numel),
            ):
                if value is not None:
                    self.stats.add(f"dense/{name}", float(value))
            if raw is not None:
                self.stats.add("dense/calls", 1.0)
            for name, value in (("threshold", threshold), ("residual_norm", residual_norm)):
                if value is not None:
                    self.stats.maximum(f"dense/{name}", float(value))

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors; saved per rank): iteration, thresholds, residuals, PowerSGD's."""
        self.check()  # no checkpoint of a run that received a damaged payload
        state: dict[str, Any] = {
            "name": self.spec.name,
            "iteration": self.iteration,
            "thresholds": {n: float(t) for n, t in self.thresholds.items()},
            "residuals": {n: r.detach().cpu() for n, r in self.residuals.items()},
            "owner_residuals": {n: r.detach().cpu() for n, r in self.owner_residuals.items()},
        }
        if self.powersgd is not None:
            state["powersgd"] = {slot: getattr(self.powersgd, slot) for slot in _POWERSGD_STATE}
            state["powersgd"]["rng"] = numpy_rng_state(self.powersgd.rng.get_state())  # plain data
            state["powersgd_rank"] = self.powersgd.matrix_approximation_rank
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("name", self.spec.name) != self.spec.name:
            raise CheckpointError(
                f"the checkpoint holds dense_comm={state.get('name')!r} state; this run uses "
                f"dense_comm={self.spec.name!r} (resume with the same dense_comm, or start anew)"
            )
        self.iteration = int(state.get("iteration", 0))
        self.thresholds = {
            str(k): torch.tensor(float(v), dtype=torch.float32) for k, v in state.get("thresholds", {}).items()
        }
        self.residuals = {str(k): v.clone() for k, v in state.get("residuals", {}).items()}
        self.owner_residuals = {str(k): v.clone() for k, v in state.get("owner_residuals", {}).items()}
        if self.powersgd is not None and "powersgd" in state:
            if state.get("powersgd_rank") != self.spec.rank:
                raise CheckpointError(
                    f"the checkpoint's PowerSGD factors have rank {state.get('powersgd_rank')}; "
                    f"dense_comm.rank is {self.spec.rank} (resume with the same rank, or start anew)"
                )
            for slot, value in state["powersgd"].items():
                if slot == "rng":
                    self.powersgd.rng.set_state(numpy_rng_tuple(value))
                else:
                    setattr(self.powersgd, slot, value)


def _segments(numels: list[int], ws: int, device: torch.device) -> list[tuple[torch.Tensor, list[int]]]:
    """Each rank's segment of a bucket of parameters of ``numels`` entries: the r-th of W
    contiguous pieces of every parameter, as its positions in the bucket (in bucket order) and
    the width of each piece (0 where a parameter has fewer entries than ranks)."""
    out = []
    for r in range(ws):
        starts, ends, widths = [], [], []
        at = 0
        for n in numels:
            lo, hi = at + n * r // ws, at + n * (r + 1) // ws
            starts.append(lo)
            ends.append(hi)
            widths.append(hi - lo)
            at += n
        index = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in zip(starts, ends, strict=True)])
        out.append((index, widths))
    return out


def _segment_of(decoded: torch.Tensor, numel: int) -> torch.Tensor:
    """A decoded segment payload, flat; one of another length is an error."""
    if decoded.numel() != numel:
        raise PayloadError(f"{decoded.numel()} gradients, expected the segment's {numel}")
    return decoded.view(-1)


def _cannot_decode(pg: dist.ProcessGroup, index: int, r: int, nbytes: int, iteration: int) -> str:
    """The start of the error of a dense payload from rank ``r`` that does not decode."""
    me, other = dist.get_global_rank(pg, pg.rank()), dist.get_global_rank(pg, r)
    return (
        f"rank {me}: cannot decode the dense gradient payload of bucket {index} "
        f"({nbytes} bytes) from rank {other} at iteration {iteration}"
    )


def dense_comm_of(model: torch.nn.Module) -> DenseComm | None:
    """The :class:`DenseComm` a DMP model was wrapped with (TorchRec keeps the wrapper it used)."""
    wrapper = getattr(model, "_data_parallel_wrapper", None)
    return wrapper.dense if isinstance(wrapper, CompressedDataParallelWrapper) else None


def dense_comm_hook(state, bucket):
    """The DDP communication hook of every `dense_comm` choice (DDP calls it per bucket).

    Unannotated on purpose: DDP compares the annotations with the real types, and with
    ``from __future__ import annotations`` they would be strings.
    """
    return state.hook(bucket)


class CompressedDataParallelWrapper(DefaultDataParallelWrapper):
    """TorchRec's default DDP wrapping of the dense part, with our hook registered on it."""

    def __init__(self, dense: DenseComm) -> None:
        super().__init__(bucket_cap_mb=dense.spec.bucket_cap_mb)
        self.dense = dense

    def _ddp_wrap(self, dmp: Any, env: ShardingEnv, device: torch.device, ddp_ignore_param_names: set[str]) -> None:
        super()._ddp_wrap(dmp, env, device, ddp_ignore_param_names)
        ddp = dmp._dmp_wrapped_module
        if isinstance(ddp, DistributedDataParallel):
            assert env.process_group is not None
            self.dense.install(ddp, env.process_group)
