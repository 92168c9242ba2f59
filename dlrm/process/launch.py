"""Where a Hydra job's ranks come from, so that `dlrm-train` and `dlrm-train -m` work without torchrun.

Four cases, told apart by the environment:
- ``torchrun``: the ranks already run (torchrun or this module's launcher started them);
- ``submitit``: a submitit task (hydra-submitit-launcher on SLURM, or its local executor) is one
  rank; the rendezvous (MASTER_ADDR/PORT, RANK, WORLD_SIZE) comes from submitit's job environment;
- ``launch``: a job of a local sweep (`dlrm-train -m ...`): the job launches
  ``launch.nproc_per_node`` fresh processes through torch's elastic launcher, which run the same
  entry point in Hydra's run mode with the job's overrides and output directory;
- ``single``: a plain `dlrm-train`: one process, a private 1-rank group.

Why fresh processes per sweep job rather than Hydra's multirun inside torchrun: every rank would
run the jobs one after another in the same processes, re-creating the process group on torchrun's
store (job 2 meets job 1's keys) and resolving its own ``${now:}`` sweep directory; one failed job
would end the sweep.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

RankSource = Literal["torchrun", "submitit", "launch", "single"]
SWEEP_JOB_ENV = "DLRM_SWEEP_JOB"  # set in the ranks a sweep job launches


def rank_source(multirun: bool, env: Mapping[str, str] = os.environ) -> RankSource:
    if "SUBMITIT_EXECUTOR" in env:
        return "submitit"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    return "launch" if multirun else "single"


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The keys that Hydra command-line overrides set (``+key=``, ``~key`` included)."""
    return {o.lstrip("+~").split("=", 1)[0] for o in overrides}


def check_launch_keys(source: RankSource, multirun: bool, overrides: Sequence[str], launch: Any) -> None:
    """Refuse a sweep inside torchrun, and a ``launch.*`` setting that would have no effect."""
    if source == "torchrun" and multirun:
        raise RuntimeError(
            "a sweep (-m) launches each job's ranks itself: run `dlrm-train -m ...` without torchrun "
            "(config keys launch.nproc_per_node, launch.max_restarts)"
        )
    given = sorted(k for k in override_keys(overrides) if k.startswith("launch."))
    launched_here = os.environ.get(SWEEP_JOB_ENV) == "1"  # a sweep job's ranks get the job's overrides
    if given and (source == "single" or (source == "torchrun" and not launched_here)):
        raise ValueError(
            f"config key(s) {given} configure the ranks of sweep jobs (dlrm-train -m ...); a single run's "
            "ranks come from torchrun: torchrun --nproc_per_node N -m dlrm.train (or make train NPROC=N)"
        )
    if source == "launch" and launch.nnodes != 1:
        raise ValueError(
            f"config key launch.nnodes={launch.nnodes}: a local sweep runs each job on this machine; "
            "several nodes need a cluster launcher (hydra/launcher=slurm)"
        )


def submitit_rendezvous(master_port: int | None) -> dict[str, str]:
    """torch's env:// rendezvous for this submitit task: one task = one rank.

    Rank 0 is the first task of the first node (submitit's global rank order); the port is
    ``launch.master_port`` or, by default, derived from the job id so that concurrent sweep jobs on
    the same node do not collide.
    """
    import submitit

    job = submitit.JobEnvironment()
    port = master_port or 20000 + int(hashlib.sha1(job.job_id.encode()).hexdigest(), 16) % 20000
    return {
        "MASTER_ADDR": job.hostnames[0],
        "MASTER_PORT": str(port),
        "RANK": str(job.global_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "LOCAL_RANK": str(job.local_rank),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // job.num_nodes),
        "GROUP_RANK": str(job.node),
    }


def module_of(fn: Any) -> str:
    """The importable module defining ``fn`` (``python -m dlrm.train`` names it ``__main__``)."""
    module: str = fn.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise RuntimeError("a sweep job relaunches its entry point as a module: start it with -m or dlrm-train")
        module = spec.name
    return module


def launch_ranks(
    module: str, overrides: Sequence[str], run_dir: Path, nproc_per_node: int, max_restarts: int
) -> dict[str, Any]:
    """Run ``python -m module overrides`` as ``nproc_per_node`` ranks in ``run_dir``; its metrics.

    Rank outputs go to ``run_dir/ranks/`` (rank 0's also to the console). A failed rank restarts the
    whole group up to ``max_restarts`` times (each restart resumes from the run's checkpoints under
    ``resume: auto``), then raises torch's ChildFailedError naming the failed rank and its error.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # as `torchrun --standalone`: a free port on this host
        max_restarts=max_restarts,
        logs_specs=DefaultLogsSpecs(
            log_dir=str(run_dir / "ranks"), redirects=Std.ALL, tee=Std.ALL, local_ranks_filter={0}
        ),
    )
    args = [*overrides, f"hydra.run.dir={_hydra_quote(str(run_dir))}"]
    if "progress_bar" not in override_keys(overrides):  # a bar redrawn in a log file is noise
        args.append("progress_bar=false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several ranks per node
    os.environ[SWEEP_JOB_ENV] = "1"
    elastic_launch(config, entrypoint=sys.executable)("-u", "-m", module, *args)
    path = run_dir / "metrics.json"
    if not path.exists():
        raise RuntimeError(f"the ranks of {module} exited without writing {path} (logs: {run_dir / 'ranks'})")
    metrics: dict[str, Any] = json.loads(path.read_text())
    return metrics


def objectives(metrics: Mapping[str, Any], keys: Sequence[str]) -> list[float]:
    """The metrics an optimising sweeper (Optuna) maximises, in ``keys`` order; NaN where undefined."""
    missing = [k for k in keys if k not in metrics]
    if missing:
        raise KeyError(f"config key 'objectives' names {missing}, which metrics.json does not have")
    return [float("nan") if metrics[k] is None else float(metrics[k]) for k in keys]


def _hydra_quote(value: str) -> str:
    """A path as a Hydra override value: quoted, since Hydra's grammar reads ``,`` ``=`` and spaces."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
