"""Codec throughput on the GPU printed beside the CPU's (``dlrm.bench.codec`` on one batch)."""

from __future__ import annotations

import time

import pytest
import torch

from dlrm.bench import codec as bench
from dlrm.bench.criteo_like import criteo_like_batch

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False here); run `make test-gpu` on a GPU machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
VARIANTS = [
    v for v in bench.VARIANTS if v.label in {"lossy+ids fixed", "lossy fixed (index sent)", "fp16", "int8 (row-wise)"}
]


def synchronized_clock() -> float:
    """Wall time once the device has finished its queue (kernels return before they end)."""
    torch.cuda.synchronize()
    return time.perf_counter()


def test_codec_gigabytes_per_second_on_the_gpu_beside_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = criteo_like_batch(rows=4096, tables=13, dim=64, seed=0)
    on_gpu = {name: {k: v.cuda() for k, v in t.items()} for name, t in tables.items()}
    cpu = bench.benchmark(tables, repeats=3, variants=VARIANTS, bound_values=[1e-3], log=print)
    monkeypatch.setattr(bench, "_clock", synchronized_clock)
    gpu = bench.benchmark(on_gpu, repeats=5, variants=VARIANTS, bound_values=[1e-3], log=print)
    print(
        f"{'codec':28}{'mode':>5}  {'CPU enc GB/s':>12}{'GPU enc GB/s':>13}  {'CPU dec GB/s':>12}{'GPU dec GB/s':>13}"
    )
    on_cpu = {(c.codec, c.mode): c for c in cpu}
    for g in gpu:  # (a variant that cannot run on this GPU, e.g. without FBGEMM's CUDA ops, is absent)
        c = on_cpu[(g.codec, g.mode)]
        print(
            f"{c.codec:28}{c.mode:>5}  {c.compress_MBps / 1e3:12.2f}{g.compress_MBps / 1e3:13.2f}"
            f"  {c.decompress_into_MBps / 1e3:12.2f}{g.decompress_into_MBps / 1e3:13.2f}"
        )
        assert g.bound_held in (None, True), f"{g.codec} {g.mode}: the bound failed on the GPU"
