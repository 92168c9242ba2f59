"""The trainer on CUDA with NCCL: one GPU (and two ranks where two GPUs exist), a few iterations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_runs import train

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False here); run `make test-gpu` on a GPU machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA devices (found {GPUS})"))]
)
@pytest.mark.parametrize("compression", ["lossy", "none"])
def test_the_trainer_runs_on_cuda_with_nccl(tmp_path: Path, cache: Path, compression: str, nproc: int) -> None:
    run_dir = tmp_path / "run"
    train(run_dir, cache, ["device=cuda", f"compression={compression}", "max_iterations=8"], nproc=nproc)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["iterations"] == 8 and metrics["world_size"] == nproc
    assert 0.0 <= metrics["logloss"] < 10
    print(
        f"compression={compression} ranks={nproc}: {metrics['samples_per_s']:.0f} samples/s, "
        f"host syncs per iteration {metrics['host_syncs_per_iteration']} {metrics['host_syncs_by_op']}"
    )
    assert metrics["host_syncs_per_iteration"] is not None
