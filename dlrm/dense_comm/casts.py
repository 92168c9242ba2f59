"""``dense_comm=fp16`` / ``bf16``: cast, all-reduce, cast back (torch's compress hooks), and the
plain fp32 average (DDP's own, for ``none`` under ``auto`` and DCT's buckets under ``min_numel``).

torch's hook functions are called, not registered as DDP builtins: bf16 then runs on gloo too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dlrm.dense_comm.stats import DenseStats
from dlrm.performance.network import ring_allreduce_bytes

Future = torch.futures.Future

_HOOKS = {
    None: default_hooks.allreduce_hook,
    torch.float16: default_hooks.fp16_compress_hook,
    torch.bfloat16: default_hooks.bf16_compress_hook,
}


@dataclass(frozen=True)
class CastState:
    """One cast: the dtype on the wire (None: fp32, uncast), the group, the statistics."""

    process_group: dist.ProcessGroup
    stats: DenseStats
    dtype: torch.dtype | None = None


def cast_hook(state: CastState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """The bucket averaged over the ranks through a ring all-reduce in ``state.dtype``."""
    t0 = time.perf_counter()
    numel, ws = bucket.buffer().numel(), state.process_group.size()
    fut = _HOOKS[state.dtype](state.process_group, bucket)
    wire = ring_allreduce_bytes(numel, ws, 4.0 if state.dtype is None else 2.0)
    return state.stats.timed(fut, ring_allreduce_bytes(numel, ws), wire, t0)
