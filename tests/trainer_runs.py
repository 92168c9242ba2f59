"""Launch the real trainer with torchrun in a subprocess, as a user would."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from multiprocess import free_port

REPO = Path(__file__).resolve().parents[1]
# A small model and short runs keep each launch to seconds on 2 CPU cores.
SMALL = [
    "model.embedding_dim=16",
    "model.dense_arch_layer_sizes=[32,16]",
    "model.over_arch_layer_sizes=[32,1]",
    "progress_bar=false",
    "log_every=1",
]


def torchrun_cmd(nproc: int, overrides: list[str], max_restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m",
        "dlrm.train",
        *overrides,
    ]


def env_for(cache: Path) -> dict[str, str]:
    # gloo binds to loopback: the only link inside a test's private network namespace
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo")
    env["DLRM_TEST_CACHE"] = str(cache)
    return env


def train(
    run_dir: Path,
    cache: Path,
    overrides: list[str],
    nproc: int = 2,
    check: bool = True,
    timeout: float = 300,
    prefix: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Train to the end; ``prefix`` runs torchrun under another command (e.g. ``ip netns exec NS``)."""
    cmd = [*prefix, *torchrun_cmd(nproc, [f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}", *SMALL, *overrides])]
    # its own session, so that a run past its timeout goes with all its ranks (not only torchrun)
    pipe = subprocess.PIPE
    with subprocess.Popen(
        cmd, cwd=REPO, env=env_for(cache), stdout=pipe, stderr=pipe, text=True, start_new_session=True
    ) as agent:
        try:
            stdout, stderr = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            raise
    proc = subprocess.CompletedProcess(cmd, agent.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def launch(
    run_dir: Path, cache: Path, overrides: list[str], output: Path, nproc: int = 2, max_restarts: int = 0
) -> subprocess.Popen:
    """Start training in the background, its stdout and stderr to the file ``output`` (a pipe that
    no one reads while the caller waits would fill and stall the ranks); the caller waits for it."""
    cmd = torchrun_cmd(nproc, [f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}", *SMALL, *overrides], max_restarts)
    with open(output, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env_for(cache), stdout=out, stderr=subprocess.STDOUT, text=True)


def losses(run_dir: Path) -> dict[int, float]:
    """iteration -> loss from losses.txt (a restarted run appends; the last value wins)."""
    out = {}
    for line in (run_dir / "losses.txt").read_text().splitlines(keepends=True):
        if line.endswith("\n"):  # a line still being written has no newline yet
            it, loss = line.split()
            out[int(it)] = float(loss)
    return out


def resume_from(full: Path, part: Path, stop: int) -> None:
    """Leave in ``part`` what a run stopped after ``stop`` leaves for a resume: ``full``'s periodic
    checkpoint of iteration ``stop`` (its ``checkpoint.every`` and ``keep`` must hold it), alone."""
    step = full / "checkpoints" / f"step-{stop}"
    assert step.is_dir(), f"{full} kept no checkpoint of iteration {stop} (checkpoint.every, checkpoint.keep?)"
    ckpts = part / "checkpoints"
    shutil.copytree(step, ckpts / step.name)
    (ckpts / "latest").write_text(step.name)


def resumed_losses(
    full: Path, part: Path, cache: Path, common: list[str], stop: int, total: int
) -> tuple[dict[int, float], dict[int, float]]:
    """The losses of a run of ``total`` iterations in ``full``, and of one in ``part`` resumed from
    its checkpoint of iteration ``stop`` to ``total`` (:func:`resume_from`): (uninterrupted, resumed,
    the resumed run's own iterations only)."""
    train(full, cache, [*common, f"max_iterations={total}"])
    resume_from(full, part, stop)
    train(part, cache, [*common, f"max_iterations={total}", "resume=true"])
    return losses(full), losses(part)


def worker_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the trainer processes the torchrun agent started (not its helpers)."""
    out = {}
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")]
            if b"dlrm.train" in cmdline and rank:
                out[int(rank[0])] = int(child)
    return out
