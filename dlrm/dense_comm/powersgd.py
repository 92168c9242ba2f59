"""``dense_comm=powersgd``: torch's PowerSGD hook (low-rank factors, error feedback), with its state
checkpointed per rank and the elements it sends counted."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from dlrm.dense_comm.config import DenseCommSpec
from dlrm.dense_comm.stats import DenseStats
from dlrm.performance.network import ring_allreduce_bytes
from dlrm.trainer.state import CheckpointError, numpy_rng_state, numpy_rng_tuple

Future = torch.futures.Future

# PowerSGD's state; its hyperparameters (rank, start, ...) come from the config, not a checkpoint.
_SLOTS = (
    "rng",
    "error_dict",
    "p_memory_dict",
    "q_memory_dict",
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
)


class PowerSGD:
    """torch's :class:`PowerSGDState` for ``spec`` on ``process_group``, and the backward passes
    this process made (its first is a plain all-reduce: see :func:`powersgd_hook`)."""

    def __init__(self, spec: DenseCommSpec, process_group: dist.ProcessGroup, stats: DenseStats) -> None:
        self.rank, self.process_group, self.stats = spec.rank, process_group, stats
        self.process_iterations = 0  # not restored on resume
        self.torch_state = PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=spec.rank,
            start_powerSGD_iter=spec.start_iter,
            min_compression_rate=spec.min_compression_rate,
            use_error_feedback=True,
            warm_start=spec.warm_start,
            random_seed=0,
        )

    def state_dict(self) -> dict[str, Any]:
        """The factors, error feedback, random stream and counters (plain data and tensors), and the rank."""
        ps = self.torch_state
        state = {slot: getattr(ps, slot) for slot in _SLOTS}
        state["rng"] = numpy_rng_state(ps.rng.get_state())
        return {"powersgd": state, "powersgd_rank": ps.matrix_approximation_rank}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """:meth:`state_dict`'s keys; factors of another rank than ``dense_comm.rank`` are refused."""
        if "powersgd" not in state:
            return
        if state.get("powersgd_rank") != self.rank:
            raise CheckpointError(
                f"the checkpoint's PowerSGD factors have rank {state.get('powersgd_rank')}; "
                f"dense_comm.rank is {self.rank} (resume with the same rank, or start anew)"
            )
        for slot, value in state["powersgd"].items():
            if slot == "rng":
                self.torch_state.rng.set_state(numpy_rng_tuple(value))
            else:
                setattr(self.torch_state, slot, value)


def powersgd_hook(state: PowerSGD, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """torch's PowerSGD hook, recording the elements it sends.

    The first backward of every process is a plain all-reduce, as torch's hook does before
    ``start_iter``: PowerSGD keys its state by bucket index, and DDP's first iteration uses one
    bucket of everything before rebuilding the layout that a resumed state belongs to.
    """
    t0 = time.perf_counter()
    ps, pg, numel = state.torch_state, state.process_group, bucket.buffer().numel()
    if state.process_iterations == 0:
        ps.maybe_increase_iter(bucket)
        fut, sent = default_hooks.allreduce_hook(pg, bucket), numel
    else:
        before = (ps.total_numel_before_compression, ps.total_numel_after_compression)
        fut = powerSGD_hook(ps, bucket)
        after = (ps.total_numel_before_compression, ps.total_numel_after_compression)
        sent = after[1] - before[1] if after[0] > before[0] else numel  # vanilla before start
    if bucket.is_last():
        state.process_iterations += 1
    ws = pg.size()
    return state.stats.timed(fut, ring_allreduce_bytes(numel, ws), ring_allreduce_bytes(sent, ws), t0)
