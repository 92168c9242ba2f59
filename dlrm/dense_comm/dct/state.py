"""What DCT keeps on each rank: per parameter its residual, its threshold and the owner residual of
the reduce-scatter, the refresh schedule, and the codec; checkpointed per rank.

Residuals and thresholds are kept per parameter, not per bucket, so that a rebuilt bucket layout
(DDP's after its first iteration, or a resume) keeps them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlrm.dense_comm.config import DenseCommSpec
from dlrm.dense_comm.dct.payload import Segments, segments
from dlrm.dense_comm.stats import DenseStats
from dlrm.performance.network import cheaper_aggregation
from dlrm_compression.positions import halves_of, ramp_of
from dlrm_compression.sparse import ThresholdCodec, kth_largest_magnitude, magnitudes, refresh_due
from dlrm_compression.sparse import kth_largest_abs_tensor as kth_largest


class DenseCommError(RuntimeError):
    """A dense-gradient payload could not be decoded; the message names the ranks and the bucket."""


def cannot_decode(pg: dist.ProcessGroup, index: int, r: int, nbytes: int, iteration: int) -> str:
    """The start of the error of a dense payload from rank ``r`` that does not decode."""
    me, other = dist.get_global_rank(pg, pg.rank()), dist.get_global_rank(pg, r)
    return (
        f"rank {me}: cannot decode the dense gradient payload of bucket {index} "
        f"({nbytes} bytes) from rank {other} at iteration {iteration}"
    )


@dataclass
class Accumulated:
    """One bucket as DCT sees it: DDP's buffer and index, its parameters' names and numels, and
    ``f``, the gradients plus each parameter's residuals."""

    buf: torch.Tensor
    index: int
    names: list[str]
    numels: list[int]
    f: torch.Tensor
    mags: torch.Tensor | None = None  # f's magnitudes (float32 f): its thresholds' and mask's, made once


class DCTState:
    """One rank's DCT state for ``spec``; :meth:`prepare` gives it the DDP module and group."""

    def __init__(self, spec: DenseCommSpec, stats: DenseStats) -> None:
        self.spec, self.stats = spec, stats
        self.iteration = 0  # the run's backward passes (every option's under auto): the refresh schedule
        self.thresholds: dict[str, torch.Tensor] = {}  # parameter name -> threshold (0-d, on the gradients' device)
        self.refreshes: list[tuple[int, str]] = []  # (iteration, parameter name) of every refresh
        self.residuals: dict[str, torch.Tensor] = {}  # parameter name -> flat residual
        # reduce-scatter: parameter name -> what this rank, as the owner of a segment, dropped from
        # its sum (flat, zeros outside the segment)
        self.owner_residuals: dict[str, torch.Tensor] = {}
        self.norm_sq = 0.0  # squared residual norm of the buckets seen this iteration
        self.codec = ThresholdCodec(values=spec.values).with_backend(spec.backend)
        # payload headers, for sizes: lossy values' header is the fp32 one's size
        self.sizer = ThresholdCodec(values="none" if spec.values == "lossy" else spec.values).with_backend(spec.backend)
        self.pg: dist.ProcessGroup | None = None
        self.names: dict[int, str] = {}
        # the reduce-scatter's segments of each bucket layout (numels, ranks, device): made once
        self.layouts: dict[tuple[tuple[int, ...], int, torch.device], Segments] = {}
        # constants of the coding, made once: width_less_one's halves and the bit streams' ramp by
        # (size, device), and the zeros of the values dropped by (dtype, device)
        self._halves: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._ramps: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def prepare(self, module: torch.nn.Module, pg: dist.ProcessGroup) -> None:
        """Learn the DDP module's parameter names (the keys of the per-parameter state) and its group."""
        self.pg = pg
        self.names = {id(p): n for n, p in module.named_parameters()}

    # -- one bucket -----------------------------------------------------------------------------

    def accumulated(self, bucket: dist.GradBucket) -> Accumulated:
        """The bucket with ``f``: the gradients plus each parameter's residual and owner residual
        (what this rank, owning pieces of it in the reduce-scatter, dropped from their sums:
        consumed here, its own pieces counting whole)."""
        buf = bucket.buffer()
        layout = [(self.names.get(id(p), f"param{i}"), p.numel()) for i, p in enumerate(bucket.parameters())]
        names, numels = [n for n, _ in layout], [n for _, n in layout]
        held = _joined([_residual(self.residuals.get(name), numel, buf) for name, numel in layout])
        owned = [self.owner_residuals.pop(name, None) for name in names]  # consumed: f carries them now
        if any(o is not None for o in owned):
            held = held + _joined([_residual(o, numel, buf) for o, numel in zip(owned, numels, strict=True)])
        f = buf + held
        return Accumulated(buf, bucket.index(), names, numels, f, magnitudes(f) if f.dtype == torch.float32 else None)

    def threshold(self, name: str, f: torch.Tensor, mags: torch.Tensor | None = None) -> torch.Tensor:
        """A parameter's threshold (a 0-d float32 tensor on ``f``'s device: no host wait):
        refreshed on schedule (and when first seen); 0 (send all) for parameters under
        ``min_numel``. ``mags``: ``f``'s magnitudes, made already."""
        if f.numel() < self.spec.min_numel:
            return torch.zeros((), dtype=torch.float32, device=f.device)
        if name not in self.thresholds or self.refresh_due(self.iteration):
            keep = self.spec.keep
            self.thresholds[name] = kth_largest(f, keep) if mags is None else kth_largest_magnitude(mags, keep)
            self.refreshes.append((self.iteration, name))
        elif self.thresholds[name].device != f.device:  # restored from a checkpoint: moved once
            self.thresholds[name] = self.thresholds[name].to(f.device, non_blocking=True)
        return self.thresholds[name]

    def refresh_due(self, iteration: int) -> bool:
        """Whether thresholds are refreshed at ``iteration`` (:func:`compression.sparse.refresh_due`)."""
        return refresh_due(iteration, self.spec.refresh_every, self.spec.refresh_warmup)

    def bound(self, x: torch.Tensor) -> float | None:
        """Lossy values' absolute bound for a selection of ``x``: ``values_eb`` x its largest finite
        ``|x|`` (non-finite entries travel exactly, unbounded); None for cast values."""
        if self.spec.values != "lossy":
            return None
        return self.spec.values_eb * float(x.abs().nan_to_num(0.0, 0.0).max())

    def keep_residuals(self, acc: Accumulated, sent: torch.Tensor) -> torch.Tensor:
        """What was not sent of ``f`` becomes each parameter's residual; returns it whole."""
        # a non-finite entry travels exactly, so only it makes a NaN here (inf - inf, NaN - NaN): no
        # residual; an infinity is a finite entry's cast overflow and stays (one op, not isfinite's five)
        residual = (acc.f - sent).nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
        for name, piece in zip(acc.names, residual.split(acc.numels), strict=True):
            self.residuals[name] = piece
        return residual

    def segments(self, numels: list[int], ws: int, device: torch.device) -> Segments:
        """The reduce-scatter's segments of a bucket of parameters of ``numels`` entries over
        ``ws`` ranks (:func:`.payload.segments`), made at the layout's first bucket."""
        key = (tuple(numels), ws, device)
        if key not in self.layouts:
            self.layouts[key] = segments(numels, ws, device)
        return self.layouts[key]

    def owner_thresholds(
        self, total: torch.Tensor, numels: list[int], widths: list[int], mags: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The reduce-scatter owner's threshold of each piece of its summed segment ``total`` (one
        per non-empty piece of ``widths``): its k-th largest ``|sum|`` for ``keep``, every
        iteration, or 0 (all of it) for a parameter under ``min_numel``. ``mags``: ``total``'s
        magnitudes, made already."""
        pieces = [(n, w) for n, w in zip(numels, widths, strict=True) if w]
        keep = self.spec.keep
        split = total.split([w for _, w in pieces]) if mags is None else mags.split([w for _, w in pieces])
        return [
            (kth_largest(piece, keep) if mags is None else kth_largest_magnitude(piece, keep))
            if n >= self.spec.min_numel
            else torch.zeros((), dtype=torch.float32, device=total.device)
            for (n, _), piece in zip(pieces, split, strict=True)
        ]

    def keep_owner_residuals(
        self, acc: Accumulated, total: torch.Tensor, kept: torch.Tensor, mine: torch.Tensor, signed_zeros: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the owner of the bucket positions ``mine`` sends of their sum ``total`` (``kept``,
        as decoded) and drops, each placed in a bucket-sized tensor; what it drops becomes each
        parameter's owner residual. Without ``signed_zeros`` a -0.0 sent is placed as +0.0 (added
        to the zeros: the same op)."""
        summed = torch.zeros(acc.f.numel(), dtype=total.dtype, device=total.device)
        summed.index_put_((mine,), kept, accumulate=not signed_zeros)
        dropped = torch.zeros_like(summed)
        dropped[mine] = (total - kept).nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)  # as keep_residuals
        for name, piece in zip(acc.names, dropped.split(acc.numels), strict=True):
            self.owner_residuals[name] = piece
        return summed, dropped

    def halves(self, n: int, device: torch.device) -> torch.Tensor:
        """:func:`~compression.positions.halves_of` ``n`` on ``device``, made once."""
        key = (n, device)
        if key not in self._halves:
            self._halves[key] = halves_of(n, device)
        return self._halves[key]

    def ramp(self, n: int, device: torch.device) -> torch.Tensor:
        """:func:`~compression.positions.ramp_of` ``n`` (a bucket's entries: its segments' too) on
        ``device``, made once."""
        key = (n, device)
        if key not in self._ramps:
            self._ramps[key] = ramp_of(n, device)
        return self._ramps[key]

    def zero(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zero of ``dtype`` on ``device`` (one element: :meth:`ThresholdCodec.sent`'s), made
        once (the value of the entries not sent)."""
        key = (dtype, device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(1, dtype=dtype, device=device)
        return self._zeros[key]

    def aggregation(self, numels: list[int], ws: int) -> str:
        """How a bucket of parameters of ``numels`` entries is summed over ``ws`` ranks:
        ``dense_comm.aggregation``, or with ``auto`` the one that sends fewer bytes per rank
        (:func:`~dlrm.performance.network.cheaper_aggregation`) for ``keep`` x entries, each a value
        and about a byte of position, in payloads with this bucket's header. A bucket without a
        parameter of ``ws`` entries or more, whose pieces would leave a rank's segment empty, is
        all-gathered."""
        choice = self.spec.aggregation
        if choice == "auto":
            item = 2 if self.spec.values in ("fp16", "bf16") else 4
            header = self.sizer.payload_size(sum(numels), numels, 0, 1)  # no entry: headers only
            choice = cheaper_aggregation((item + 1) * self.spec.keep * sum(numels), ws, header)
        return choice if max(numels) >= ws else "allgather"

    def end_iteration(self) -> None:
        """Report this iteration's residual norm (after its last bucket) and start the next sum."""
        self.stats.record(residual_norm=self.norm_sq**0.5)
        self.norm_sq = 0.0

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Thresholds (floats), residuals and owner residuals (CPU tensors), by parameter name."""
        return {
            "thresholds": {n: float(t) for n, t in self.thresholds.items()},
            "residuals": {n: r.detach().cpu() for n, r in self.residuals.items()},
            "owner_residuals": {n: r.detach().cpu() for n, r in self.owner_residuals.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """:meth:`state_dict`'s keys (each absent one: empty), moved to the gradients' device when used."""
        self.thresholds = {
            str(k): torch.tensor(float(v), dtype=torch.float32) for k, v in state.get("thresholds", {}).items()
        }
        self.residuals = {str(k): v.clone() for k, v in state.get("residuals", {}).items()}
        self.owner_residuals = {str(k): v.clone() for k, v in state.get("owner_residuals", {}).items()}


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces, one after another: a view where they are consecutive pieces of one flat
    tensor (the split of the last iteration's residual: no copy to launch), else their ``cat``."""
    first, at = pieces[0], pieces[0].storage_offset()
    for p in pieces:
        if p.dim() != 1 or p.stride(0) != 1 or p.storage_offset() != at or p.dtype != first.dtype:
            return torch.cat(pieces)
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.device != first.device:
            return torch.cat(pieces)
        at += p.numel()
    return first.as_strided((at - first.storage_offset(),), (1,), first.storage_offset())


def _residual(r: torch.Tensor | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A parameter's residual ``r`` (zeros before its first iteration), on the gradients' device."""
    if r is None or r.numel() != numel:
        return torch.zeros(numel, dtype=like.dtype, device=like.device)
    return r.to(device=like.device, dtype=like.dtype)
