"""Groups made after the world (TorchRec's intra- and cross-node groups) time out after
comm_timeout_s like the world, not after torch's default of 30 minutes for gloo."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from multiprocess import run_ranks

from dlrm.process.env import subgroups_time_out_after
from dlrm.process.timeout import GLOO_TIMEOUT

TIMEOUT_S, SILENT_S = 2.0, 10.0


def _subgroup_all_reduce_with_a_silent_peer(rank: int, world_size: int) -> tuple[float, str] | None:
    subgroups_time_out_after(timedelta(seconds=TIMEOUT_S))
    group = dist.new_group([0, 1])  # as TorchRec makes its groups: no timeout given
    if rank == 1:
        time.sleep(SILENT_S)  # alive, connected, silent
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, "no error"


def test_a_subgroup_made_without_a_timeout_waits_comm_timeout_s():
    waited, error = run_ranks(_subgroup_all_reduce_with_a_silent_peer, 2, timeout=120)[0]
    # gloo's timeout, not the peer's exit after SILENT_S (nor torch's 30 minutes)
    assert GLOO_TIMEOUT.search(error), error
    assert TIMEOUT_S - 0.5 < waited < SILENT_S - 2, (waited, error)
