"""Relative-to-range bounds on the device: equal, bit for bit, to the per-block Python-float range
they replace, and taken by the lossy codec as a tensor with the same payload as the floats."""

import math

import numpy as np
import pytest
import torch

import dlrm_compression as compression
from dlrm.bench.criteo_like import criteo_like_batch


def host_range_bounds(x: torch.Tensor, rel: list[float], widths: list[int]) -> list[float]:
    """An independent reference: each block's finite max and min as Python floats (numpy)."""
    a, out, s = x.float().numpy(), [], 0
    for r, w in zip(rel, widths, strict=True):
        block = a[:, s : s + w]
        fin = block[np.isfinite(block)]
        span = float(fin.max()) - float(fin.min()) if fin.size else 0.0
        out.append(r * span)
        s += w
    return out


def wide_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values over many magnitudes (float32 range differences that float32 itself would round),
    with NaN and infinities sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-6, 30, (rows, cols), generator=g)
    x.view(-1)[torch.randperm(rows * cols, generator=g)[: rows * cols // 50]] = float("nan")
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), 7.0])
    return x


@pytest.mark.parametrize(
    "widths", [[16] * 5, [3, 0, 17, 1, 9]], ids=["equal blocks (a view)", "unequal and empty (scatter_reduce)"]
)
def test_device_bounds_equal_the_host_float_range_bit_for_bit(widths):
    x = wide_values(97, sum(widths), seed=len(widths) + widths[0])
    x[:, sum(widths[:3]) : sum(widths[:4])] = float("nan")  # a block with no finite value: bound 0
    rel = [0.3, 1e-3, 0.07, 2.0, 1e-6]
    got = compression.relative_to_absolute(x, rel, widths)
    assert got.dtype == torch.float64 and got.device == x.device
    assert got.tolist() == host_range_bounds(x, rel, widths)
    assert got.tolist()[3] == 0.0
    for dtype in (torch.float16, torch.bfloat16):  # the range of what is sent, widened exactly
        xd = x.clamp(-6e4, 6e4).to(dtype)
        assert compression.relative_to_absolute(xd, rel, widths).tolist() == host_range_bounds(xd, rel, widths)


def test_device_bounds_on_criteo_like_rows_and_one_shared_fraction():
    batch = criteo_like_batch(rows=512, tables=13, dim=16, seed=3)
    x = torch.cat([t["values"] for t in batch.values()], 1)
    got = compression.relative_to_absolute(x, 0.01, [16] * 13)
    assert got.tolist() == host_range_bounds(x, [0.01] * 13, [16] * 13)
    # a tensor of fractions, as a policy on the device would give them: the same bounds
    frac = torch.full((13,), 0.01, dtype=torch.float64)
    assert torch.equal(compression.relative_to_absolute(x, frac, [16] * 13), got)


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("with_ids", [False, True])
def test_codec_takes_a_tensor_of_bounds_with_the_floats_payload(entropy, with_ids):
    """CPU tensors of bounds through the device backend's code (the host's reads them as floats)."""
    batch = criteo_like_batch(rows=300, tables=4, dim=8, seed=5)
    x = torch.cat([t["values"] for t in batch.values()], 1)
    ids = torch.stack([t["ids"] for t in batch.values()], 1) if with_ids else None
    widths = [8, 8, 8, 8]
    eb = compression.relative_to_absolute(x, [0.01, 0.02, 1e-4, 0.5], widths)
    codec = compression.get_codec("lossy", entropy=entropy, backend="device")
    payload = codec.encode(x, eb, ids, blocks=widths)
    assert torch.equal(payload, codec.encode(x, eb.tolist(), ids, blocks=widths))
    y = codec.decode(payload, ids)
    for k, (b, s) in enumerate(zip(eb.tolist(), range(0, 32, 8), strict=True)):
        assert (y[:, s : s + 8] - x[:, s : s + 8]).abs().max().item() <= b, k
    one = compression.relative_to_absolute(x[:, :8], 0.01)  # one block: a shared scalar step
    assert torch.equal(codec.encode(x[:, :8], one), codec.encode(x[:, :8], one.tolist()))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_bad_bound_tensor_is_refused(bad):
    codec = compression.get_codec("lossy", backend="device")
    with pytest.raises(RuntimeError, match="error bounds must be finite and >= 0"):
        codec.encode(torch.randn(4, 4), torch.tensor([0.1, bad], dtype=torch.float64), blocks=[2, 2])
    with pytest.raises(RuntimeError, match="relative bounds must be >= 0"):
        compression.relative_to_absolute(torch.randn(4, 4), torch.tensor([0.1, -1.0]), [2, 2])
