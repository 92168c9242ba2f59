"""Hydra resolvers for a run directory that every rank, and every torchrun restart, agrees on."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from omegaconf import OmegaConf


def run_id() -> str:
    """A name for this job, the same on all ranks and across `torchrun --max-restarts` restarts.

    A user-given rendezvous id (`torchrun --rdzv-id`, needed for multi-node jobs) names the job.
    Otherwise the elastic agent's per-job scratch directory (its creation time and suffix) does,
    since it outlives worker restarts; a plain `python -m dlrm.train` uses the current time.
    """
    rdzv_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv_id and rdzv_id != "none" and len(rdzv_id) < 32:
        return rdzv_id
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # <tmp>/torchelastic_<x>/<run id>_<suffix>/attempt_<k>/<rank>/error.json
        job_dir = Path(error_file).parents[2]
        if job_dir.exists():
            stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(job_dir.stat().st_ctime))
            return f"{stamp}_{job_dir.name.rsplit('_', 1)[-1][:6]}"
    return time.strftime("%Y-%m-%d_%H-%M-%S")


def task_rank() -> str:
    """This process's rank before the process group exists: torchrun's, else a submitit task's."""
    for var in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        if var in os.environ:
            return os.environ[var]
    return "0"


def short_dirname(name: str, limit: int = 120) -> str:
    """``name`` (a sweep job's overrides) as one file name: no ``/`` (a path in an override would nest
    directories), at most ``limit`` characters, the cut part replaced by a hash so that distinct jobs
    keep distinct directories."""
    name = name.replace("/", "_")
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return f"{name[: limit - 11]}~{digest}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("task_rank"):
        OmegaConf.register_new_resolver("task_rank", task_rank)
    if not OmegaConf.has_resolver("short_dirname"):
        OmegaConf.register_new_resolver("short_dirname", short_dirname)
