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
        enable_roll_call(store, rank, world_size, timeout_s)
    return DistEnv(rank, world_size, local_rank, local_world_size, dev, backend)


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
    exception", SIGABRT, so torchrun reported the run failed). Still not reproduced: 12 two-rank
    runs of 24 iterations (none, lossy, lossy + dense dct, the row cache, precision=mixed, auto +
    auto, the progress bar on) with this exit skipped all ended 0 on both ranks. What does outlive
    the run, on every rank, at the end of ``main``: tqdm's monitor thread (a daemon, started even
    where the bar is disabled), and gloo's native threads (``gloo_tcp_loop``, two
    ``pt_gloo_runloop``) of a process group that ``destroy_process_group`` did not free. The model
    is collected by then, no Python object refers to a ProcessGroup, TorchRec's cached intra/cross
    groups are None, and a bare ``init_distributed``/all-reduce/``shutdown`` frees those threads:
    something native in a training run keeps the group until the interpreter tears down, the
    hazard (a collective's thread taking the GIL during finalization) torch's own
    ``destroy_process_group`` notes for hooks. Nothing of ours waits for the teardown, so it is
    skipped. A failed run raises before this and exits non-zero as before.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
