"""Run a function on N real gloo ranks (separate processes) and collect each rank's result."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensors by value; torch's shared-memory handles die with the child.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function (it is pickled). Any rank's exception fails the call
    with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, status, value = queue.get()
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) < world_size:
        raise AssertionError(f"only ranks {sorted(results)} of {world_size} reported (timeout or crash)")
    return [results[r] for r in range(world_size)]


# --------------------------------------------------------------------------- several cases, one job


class CaseFailed(AssertionError):
    """A case of a shared job failed on some rank (or the whole job did)."""


class _Failure:
    """A case's exception on one rank, kept as text so the rank goes on with the next case."""

    def __init__(self, rank: int, key: Hashable, trace: str) -> None:
        self.rank, self.key, self.trace = rank, key, trace


def _cases(rank: int, world_size: int, cases: Mapping[Hashable, tuple]) -> dict[Hashable, Any]:
    out: dict[Hashable, Any] = {}
    for key, (fn, *args) in cases.items():
        print(f"rank {rank}: case {key}", file=sys.stderr, flush=True)  # a timeout's output names the case
        try:
            out[key] = fn(rank, world_size, *args)
        except Exception:  # this case's failure only: its own test reports it
            out[key] = _Failure(rank, key, traceback.format_exc())
    return out


class CaseResults(dict):
    """key -> each rank's result; a case that failed on any rank raises CaseFailed when read."""

    def __getitem__(self, key: Hashable) -> list:
        __tracebackhide__ = True  # pytest: the case's message, not this dict
        value = super().__getitem__(key)
        if isinstance(value, CaseFailed):
            raise CaseFailed(*value.args)
        return value


def run_cases(
    world_size: int, cases: Mapping[Hashable, tuple], per_case_timeout: float, **run_ranks_kwargs: Any
) -> CaseResults:
    """Run each ``cases[key] = (fn, *args)`` as ``fn(rank, world_size, *args)``, in order, in one job.

    A case's exception fails that case alone (read back as CaseFailed, with each failing rank's
    traceback); a crash or timeout of the job fails the call. ``fn`` must be module-level.
    """
    timeout = per_case_timeout * len(cases)
    by_rank = run_ranks(_cases, world_size, dict(cases), timeout=timeout, **run_ranks_kwargs)
    out = CaseResults()
    for key in cases:
        got = [r[key] for r in by_rank]
        failed = [f for f in got if isinstance(f, _Failure)]
        if failed:
            ranks = ", ".join(str(f.rank) for f in failed)
            traces = "\n".join(f"rank {f.rank}:\n{f.trace}" for f in failed)
            got = CaseFailed(f"case {key} failed on rank {ranks} of {world_size}:\n{traces}")  # type: ignore[assignment]
        out[key] = got
    return out


class SharedJob:
    """Cases by world size, each world's run in one job on first use (starting ranks costs more
    than most cases). A job that crashed or timed out is stored and raised again for each of its
    tests, never run again (a hang would otherwise cost every test its timeout)."""

    def __init__(self, jobs: Mapping[int, Mapping[Hashable, tuple]], per_case_timeout: float = 150) -> None:
        self.jobs, self.per_case_timeout = jobs, per_case_timeout
        self.done: dict[int, CaseResults | CaseFailed] = {}

    def results(self, key: Hashable, world_size: int | None = None) -> list:
        __tracebackhide__ = True
        if world_size is None:  # the one world of a job table with one
            (world_size,) = self.jobs
        if world_size not in self.done:
            try:
                self.done[world_size] = run_cases(world_size, self.jobs[world_size], self.per_case_timeout)
            except Exception as e:
                n = len(self.jobs[world_size])  # (each rank's stderr names the case it was in)
                self.done[world_size] = CaseFailed(f"the shared job of {world_size} ranks, {n} cases, failed:\n{e}")
        done = self.done[world_size]
        if isinstance(done, CaseFailed):
            raise CaseFailed(*done.args)
        return done[key]

    __getitem__ = results  # job[key], for a table of one world
