"""`dlrm-train -m`: Hydra sweeps whose jobs launch their own ranks (elastic launcher locally,
submitit tasks on a cluster), Optuna's multi-objective search, and the sweep summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from trainer_runs import REPO, SMALL, env_for, losses, train

from dlrm.process.launch import SWEEP_JOB_ENV, check_launch_keys, submitit_rendezvous

TINY = [*SMALL, "max_iterations=3", "limit_eval_batches=1", "batch_size=32", "eval_batch_size=128", "loss_log=true"]


def sweep(sweep_dir: Path, cache: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """What a user types: `dlrm-train -m OVERRIDES` (here `python -m dlrm.train`, no torchrun)."""
    cmd = [
        sys.executable,
        "-m",
        "dlrm.train",
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        f"data.cache_dir={cache}",
        *TINY,
        *overrides,
    ]
    env = env_for(cache)
    env.pop("RANK", None)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p.parent for p in sweep_dir.glob("*/metrics.json")), key=lambda p: int(p.name.split("-")[0]))


@pytest.fixture(scope="module")
def torchrun_dual(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The data cache and per-iteration losses of the sweeps' dual point under plain torchrun."""
    tmp = tmp_path_factory.mktemp("torchrun")
    train(tmp / "run", tmp / "cache", [*TINY[len(SMALL) :], "policy=dual", "seed=0"])
    return tmp / "cache", losses(tmp / "run")


def test_local_sweep_launches_each_jobs_ranks_and_matches_torchrun(tmp_path, torchrun_dual):
    cache, reference = torchrun_dual
    out = sweep(tmp_path / "s", cache, "policy=fixed,dual", "seed=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = job_dirs(tmp_path / "s")
    assert len(jobs) == 2
    for job in jobs:
        metrics = json.loads((job / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and metrics["iterations"] == 3  # launch.nproc_per_node ranks
        assert list((job / "tensorboard").glob("events.out.tfevents.*"))
        assert (job / "ranks").is_dir()  # every rank's stdout/stderr kept beside the run
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "| fixed |" in md and "| dual |" in md
    assert (tmp_path / "s" / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert losses(jobs[1]) == reference  # the sweep job ran the same training as torchrun


def test_submitit_tasks_are_the_ranks_and_train_the_same(tmp_path, torchrun_dual):
    """hydra/launcher=submitit_tasks runs the SLURM launcher's code path on this machine."""
    cache, reference = torchrun_dual
    out = sweep(tmp_path / "s", cache, "hydra/launcher=submitit_tasks", "policy=dual", "seed=0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (job,) = job_dirs(tmp_path / "s")
    assert json.loads((job / "metrics.json").read_text())["world_size"] == 2
    assert (job / "train_rank1.log").exists()  # each task logged as its own rank
    assert losses(job) == reference


def test_a_failed_job_is_reported_and_the_others_still_run(tmp_path):
    out = sweep(tmp_path / "s", tmp_path / "cache", "device=cpu,tpu", "seed=0")
    assert out.returncode != 0
    assert "config key 'device' must be auto, cpu or cuda" in out.stdout + out.stderr
    (done,) = job_dirs(tmp_path / "s")
    assert done.name.startswith("0-")
    assert "device=cpu" in (tmp_path / "s" / "summary.md").read_text()  # written after each job


def test_optuna_pareto_search_returns_each_trials_objectives(tmp_path):
    out = sweep(
        tmp_path / "s",
        tmp_path / "cache",
        "hydra/sweeper=pareto",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.population_size=2",
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trials = {}
    for job in job_dirs(tmp_path / "s"):
        metrics = json.loads((job / "metrics.json").read_text())
        params = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        trials[tuple(p for p in params if p.startswith("policy."))] = (metrics["auc"], metrics["forward_ratio"])
    assert len(trials) == 2
    results = yaml.safe_load((tmp_path / "s" / "optimization_results.yaml").read_text())
    front = results["solutions"]  # Optuna's Pareto front: a subset of the trials, with their metrics
    assert 1 <= len(front) <= 2
    for sol in front:
        key = tuple(f"{k}={v}" for k, v in sol["params"].items())
        assert tuple(sorted(key)) in {tuple(sorted(k)) for k in trials}
        match = next(v for k, v in trials.items() if sorted(k) == sorted(key))
        assert sol["values"] == pytest.approx(list(match))
    assert "★" in (tmp_path / "s" / "summary.md").read_text()


def test_a_sweep_inside_torchrun_is_refused_with_the_way_out(tmp_path):
    env = env_for(tmp_path / "cache")
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = subprocess.run(
        [sys.executable, "-m", "dlrm.train", "-m", f"hydra.sweep.dir={tmp_path / 's'}", "seed=0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "run `dlrm-train -m ...` without torchrun" in out.stderr


def test_launch_keys_without_effect_are_refused(monkeypatch):
    monkeypatch.delenv(SWEEP_JOB_ENV, raising=False)
    launch = OmegaConf.create({"nnodes": 1})
    with pytest.raises(ValueError, match=r"\['launch.nproc_per_node'\] configure the ranks of sweep jobs"):
        check_launch_keys("single", False, ["seed=1", "launch.nproc_per_node=4"], launch)
    with pytest.raises(ValueError, match=r"launch\.nproc_per_node"):  # a user's own torchrun
        check_launch_keys("torchrun", False, ["launch.nproc_per_node=4"], launch)
    monkeypatch.setenv(SWEEP_JOB_ENV, "1")  # the ranks a sweep job launched see the job's overrides
    check_launch_keys("torchrun", False, ["launch.nproc_per_node=4"], launch)
    check_launch_keys("launch", True, ["launch.nproc_per_node=4"], launch)
    with pytest.raises(ValueError, match="hydra/launcher=slurm"):
        check_launch_keys("launch", True, [], OmegaConf.create({"nnodes": 2}))


def test_slurm_launcher_composes_one_task_per_rank():
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "hydra/launcher=slurm",
                "launch.nnodes=2",
                "launch.nproc_per_node=8",
                "hydra.launcher.partition=gpu",
            ],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.partition) == (2, 8, "gpu")
    assert launcher.max_num_timeout > 0  # a timed-out job is requeued and resumes from its checkpoints


def test_slurm_task_environment_becomes_torchs_rendezvous(monkeypatch):
    """SLURM's variables for task 13 of 16 (2 nodes x 8): rank 13, node 1, local rank 5, the
    first host of the node list as the address, a port that is the same for every task."""
    for k in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    env = dict(
        SLURM_JOB_ID="4242",
        SLURM_NTASKS="16",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NODEID="1",
        SLURM_PROCID="13",
        SLURM_LOCALID="5",
        SLURM_JOB_NODELIST="gpu-[07-08]",
    )
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = submitit_rendezvous(master_port=None)
    assert got["MASTER_ADDR"] == "gpu-07"
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"], got["LOCAL_WORLD_SIZE"]) == ("13", "16", "5", "8")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert submitit_rendezvous(master_port=None)["MASTER_PORT"] == got["MASTER_PORT"]
    assert submitit_rendezvous(master_port=29555)["MASTER_PORT"] == "29555"
