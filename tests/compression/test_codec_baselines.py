"""fbgemm baselines (TorchRec's qcomms): sizes and errors against independent reference bounds."""

import pytest
import torch

import dlrm_compression as compression


def _chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """The flattened tensor zero-padded into [n, size] chunks, as the codecs quantise it."""
    flat = x.float().reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % size)]).view(-1, size)


@pytest.mark.parametrize("row_dim", [32, 64])
def test_int8_rowwise_error_is_half_a_step_of_each_chunk(row_dim):
    g = torch.Generator().manual_seed(row_dim)
    x = torch.randn(257, 48, generator=g) * torch.rand(257, 1, generator=g)
    codec = compression.get_codec("int8", row_dim=row_dim)
    payload = codec.encode(x)
    y = codec.decode(payload)
    chunks = _chunks(x, row_dim)
    step = (chunks.amax(1) - chunks.amin(1)) / 255
    err = _chunks(y - x, row_dim).abs().amax(1)
    assert bool((err <= step * 0.5 * (1 + 1e-3) + 1e-7).all())
    wire = chunks.shape[0] * (row_dim + 8)  # one byte per value, fp32 scale and bias per chunk
    assert wire < payload.numel() < wire + 256


def test_fp8_is_hfp8_143_with_its_relative_error_and_clamp():
    x = torch.tensor([[0.3, -0.7, 0.001, 0.9375, 5.0, -5.0, 1e-3, 0.05]])
    y = compression.get_codec("fp8").decode(compression.get_codec("fp8").encode(x))
    normal = (x.abs() <= 0.9375) & (x.abs() >= 2.0**-14)
    assert bool(((y - x).abs()[normal] <= x.abs()[normal] * 2.0**-4).all())  # 3 mantissa bits
    assert y[0, 4].item() == 0.9375 and y[0, 5].item() == -0.9375  # TorchRec's clamp


def test_fp8_rowwise_is_registered_but_needs_cuda():
    with pytest.raises(NotImplementedError, match="CUDA"):
        compression.get_codec("fp8", rowwise=True).encode(torch.randn(4, 32))


def test_mx4_error_within_half_the_group_max_and_its_size():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g) * 0.01
    codec = compression.get_codec("mx4")
    payload = codec.encode(x)
    y = codec.decode(payload)
    gmax = _chunks(x, 32).abs().amax(1, keepdim=True)
    assert bool((_chunks(y - x, 32).abs() <= gmax / 2).all())
    assert x.numel() // 2 + x.numel() // 32 < payload.numel() < x.numel() // 2 + x.numel() // 32 + 256


@pytest.mark.parametrize("name", ["int8", "fp8", "mx4"])
@pytest.mark.parametrize("shape", [(0, 8), (1, 5), (7, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shapes_and_dtypes_round_trip(name, shape, dtype):
    x = (torch.randn(*shape) * 0.1).to(dtype)
    codec = compression.get_codec(name)
    y = codec.decode(codec.encode(x, 1e-3))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert compression.decode(codec.encode(x)).shape == x.shape
