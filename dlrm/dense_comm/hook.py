"""The dense (data-parallel) gradient all-reduce through a DDP communication hook.

:class:`DenseComm` is one `dense_comm` choice: it hands each DDP bucket to the hook of the option
in use, each hook a module with its own state class, as torch's ``ddp_comm_hooks`` are laid out:

* :mod:`dlrm.dense_comm.casts`: ``fp16`` / ``bf16`` (torch's compress hooks), and the plain fp32
  average (``none`` under ``auto``, DCT's buckets under ``min_numel``);
* :mod:`dlrm.dense_comm.powersgd`: torch's PowerSGD;
* :mod:`dlrm.dense_comm.dct`: DCT-DP, its aggregation an all-gather or a reduce-scatter.

Under ``auto`` the option is :attr:`DenseComm.mode` (set by :mod:`dlrm.strategy.controller`),
and while it calibrates every option is measured on the real buckets
(:mod:`dlrm.dense_comm.calibration`). :mod:`dlrm.dense_comm.wrapper` registers the hook through
TorchRec's data-parallel wrapper; the statistics are :mod:`dlrm.dense_comm.stats`'. DenseComm is
this rank's checkpointed state: the iteration and each hook's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dlrm.dense_comm.calibration import Sample, calibrate
from dlrm.dense_comm.casts import CastState, cast_hook
from dlrm.dense_comm.config import DenseCommSpec
from dlrm.dense_comm.dct.hook import dct_hook
from dlrm.dense_comm.dct.state import DCTState
from dlrm.dense_comm.powersgd import PowerSGD, powersgd_hook
from dlrm.dense_comm.stats import DenseStats
from dlrm.trainer.state import CheckpointError, PerRank

Future = torch.futures.Future

# DCT's keys, in every checkpoint (empty without DCT), as before each hook had its own state
_NO_DCT: dict[str, Any] = {"thresholds": {}, "residuals": {}, "owner_residuals": {}}
_CASTS = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class DenseComm(PerRank):
    """One `dense_comm` choice: the hooks' states, the option in use, and the statistics. Built
    before the model is wrapped; :meth:`install` hooks it in."""

    def __init__(self, spec: DenseCommSpec) -> None:
        self.spec = spec
        self.stats = DenseStats()
        self.iteration = 0  # DDP backward passes seen (DCT's refresh schedule; checkpointed)
        self.dct = DCTState(spec, self.stats) if spec.name in ("dct", "auto") else None
        self.powersgd: PowerSGD | None = None  # built with the process group (prepare)
        self.casts: dict[str, CastState] = {}
        self.pg: dist.ProcessGroup | None = None
        # dense_comm=auto: the option in use (the others' name is their own), and while
        # calibrating, every option measured on the real buckets
        self.mode = spec.fallback if spec.name == "auto" else spec.name
        self.calibrating = False
        self.samples: list[Sample] = []

    def prepare(self, module: torch.nn.Module, pg: dist.ProcessGroup) -> None:
        """Give each hook's state the DDP module's parameters and the group (no hook yet)."""
        self.pg = pg
        self.casts = {mode: CastState(pg, self.stats, dtype) for mode, dtype in _CASTS.items()}
        if self.dct is not None:
            self.dct.prepare(module, pg)
        if self.spec.name == "powersgd":
            self.powersgd = PowerSGD(self.spec, pg, self.stats)

    def install(self, ddp: DistributedDataParallel, pg: dist.ProcessGroup) -> None:
        """Register the hook on ``ddp`` (nothing for ``none``: stock DDP)."""
        self.prepare(ddp.module, pg)
        if self.spec.hooked:
            ddp.register_comm_hook(self, dense_comm_hook)

    def hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        """One bucket through the hook of the option in use."""
        assert self.pg is not None, "DenseComm.install() was not called"
        if self.calibrating:
            assert self.dct is not None, "only dense_comm=auto calibrates"
            self.samples.extend(calibrate(self.dct, bucket.buffer(), self.pg.size()))
        mode = self.mode
        if mode == "dct" and bucket.buffer().numel() >= self.spec.min_numel:
            assert self.dct is not None
            self.dct.iteration = self.iteration  # the run's, every option's under auto
            fut = dct_hook(self.dct, bucket)
        elif mode == "powersgd":
            assert self.powersgd is not None
            fut = powersgd_hook(self.powersgd, bucket)
        else:  # a cast, or the plain average (also a DCT bucket under min_numel)
            fut = cast_hook(self.casts.get(mode, self.casts["none"]), bucket)
        if bucket.is_last():
            if mode == "dct":
                assert self.dct is not None
                self.dct.end_iteration()
            self.iteration += 1
        return fut

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors; saved per rank): the option, the iteration, each hook's state."""
        state: dict[str, Any] = {"name": self.spec.name, "iteration": self.iteration, **_NO_DCT}
        for part in (self.dct, self.powersgd):
            if part is not None:
                state.update(part.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("name", self.spec.name) != self.spec.name:
            raise CheckpointError(
                f"the checkpoint holds dense_comm={state.get('name')!r} state; this run uses "
                f"dense_comm={self.spec.name!r} (resume with the same dense_comm, or start anew)"
            )
        self.iteration = int(state.get("iteration", 0))
        for part in (self.dct, self.powersgd):
            if part is not None:
                part.load_state_dict(state)


def dense_comm_hook(state, bucket):
    """The DDP communication hook of every `dense_comm` choice (DDP calls it per bucket).

    Unannotated on purpose: DDP compares the annotations with the real types, and with
    ``from __future__ import annotations`` they would be strings.
    """
    return state.hook(bucket)
