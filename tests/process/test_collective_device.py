"""The device a process group's collectives need: NCCL rejects CPU tensors, gloo takes them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dlrm.process.env import collective_device, device_synchronize


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo world in this process, destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_no_process_group_means_the_cpu() -> None:
    assert not dist.is_initialized()
    assert collective_device() == torch.device("cpu")


def test_gloo_collectives_run_on_the_cpu(gloo_group: None) -> None:
    device = collective_device()
    assert device == torch.device("cpu")
    t = torch.ones(3, device=device)
    dist.all_reduce(t)  # the helper's device is one the group accepts
    assert t.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_collectives_run_on_the_current_cuda_device(
    gloo_group: None, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert collective_device() == torch.device("cuda", 1)


def test_device_synchronize_waits_only_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    device_synchronize(torch.device("cpu"))
    assert waited == []
    device_synchronize(torch.device("cuda", 0))
    assert waited == [torch.device("cuda", 0)]
