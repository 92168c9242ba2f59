"""Process-group setup: one code path for torchrun (any world size) and a plain single process."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from dlrm.process.timeout import enable_roll_call


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the torchrun job (or make a 1-process group) on CUDA/NCCL when available, else CPU/gloo.

    A process group exists even for one process, so TorchRec's DistributedModelParallel and the
    metrics take the same path everywhere. ``timeout_s`` (config key ``comm_timeout_s``) bounds how
    long a collective waits for a silent peer (:mod:`dlrm.process.timeout` names both in the error).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"config key 'comm_timeout_s' must be a positive number of seconds (got {timeout_s!r})")
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("config key 'device' is 'cuda' but no CUDA device is available")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"config key 'device' must be auto, cpu or cuda (got {device!r})")
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # plain `python -m dlrm.train`: a private 1-rank group
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        timeout = timedelta(seconds=timeout_s)
        # torchrun restarts reuse the agent's store, where the dead attempt's gloo addresses still
        # sit under the same keys; a per-attempt prefix keeps new workers from dialling them.
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(f"dlrm/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        subgroups_time_out_after(timeout)
        enable_roll_call(store, rank, world_size, timeout_s)
    return DistEnv(rank, world_size, local_rank, local_world_size, dev, backend)


def subgroups_time_out_after(timeout: timedelta) -> None:
    """Groups made later without a timeout wait ``timeout`` too, not torch's default (30 min for gloo).

    TorchRec's intra- and cross-node groups (table_row_wise, grid and 2D sharding) come from
    ``dist.new_group`` without one; a peer cut off from them would otherwise hang the others for half
    an hour instead of failing after ``comm_timeout_s``. torch reads this default at each new_group.
    """
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must be on for ``group``'s collectives (default: the world): the current
    CUDA device when the group runs NCCL (which rejects CPU tensors), else the CPU (gloo, or no
    process group at all)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group))  # "nccl", "gloo", or per device type: "cpu:gloo,cuda:nccl"
    if any(entry.rpartition(":")[2] == "nccl" for entry in backend.split(",")):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued on it, before a clock is read around a timed
    region (kernels and NCCL collectives return to the host before they finish); no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_without_teardown() -> NoReturn:
    """End the process once its run succeeded and every result is written (metrics, TensorBoard,
    checkpoints, logs), without the interpreter's teardown.

    A CI run had a rank abort after a successful run ("terminate called without an active
    exception", SIGABRT, so torchrun reported the run failed). Still not reproduced: 19 two-rank
    runs of 4-24 iterations (none, lossy, lossy + dense dct, the row cache, precision=mixed, auto +
    auto, the progress bar on, pipeline=false) with this exit skipped all ended 0 on both ranks.
    What outlives the run on every rank at the end of ``main``, so runs on into the interpreter's
    teardown without this exit:

    - tqdm's monitor thread (a daemon, started with the first bar even where it is disabled);
      ``tqdm.monitor.exit()`` after the run's bar is closed ends it.
    - gloo's native threads (``gloo_tcp_loop``, two ``pt_gloo_runloop``) of the default process
      group, which ``destroy_process_group`` cannot free. One holder found: TorchRec's
      apply_optimizer_in_backward imports ``torch.distributed.optim`` after the group exists, and
      its ZeroRedundancyOptimizer binds ``dist.group.WORLD`` as a default argument at import
      (``_broadcast_object``); importing it before ``init_process_group`` frees the group in a
      bare 2-rank DMP training (tests/dense_comm's ``_train``), but a full run still keeps it:
      not the pipeline, not an lru_cache, nothing reachable from any module's globals, so a
      native reference (not found).

    That is the suspected hazard (a collective's thread alive while the interpreter finalizes,
    which torch's own ``destroy_process_group`` notes for hooks), not a shown cause. Nothing of
    ours waits for the teardown, so it is skipped. A failed run raises before this and exits
    non-zero as before.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
