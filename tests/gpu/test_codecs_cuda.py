"""Every registered codec and the Triton kernels on CUDA, bit for bit against the CPU.

`make test-gpu` runs this suite (pytest marker ``gpu``); without CUDA every case skips, naming why.
"""

from __future__ import annotations

import pytest
import torch

import dlrm_compression as compression
from dlrm_compression import kernels as K
from dlrm_compression import reference as R

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False here); run `make test-gpu` on a GPU machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

# every registered codec, and again with ids where it is bounded (as tests/compression/test_codec_format.py)
KEYS = sorted(
    [*compression.available_codecs()]
    + [f"{name}+ids" for name in compression.available_codecs() if compression.get_codec(name).bounded]
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the CPU (NaN payloads and -0.0 compared exactly)."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor, bounded: bool) -> bool:
    """Bit for bit for our bounded codecs (our kernels: every bit is ours, NaN payloads too); for
    the casts and FBGEMM's baselines equal values with NaN where NaN is: a device's float casts
    give NaN its own payload (CUDA's canonical NaN), which the formats do not promise to keep."""
    if bounded:
        return torch.equal(bits(a), bits(b))
    a, b = a.detach().cpu(), b.detach().cpu()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(bits(a[~nan]), bits(b[~nan]))


def encoded(codec: compression.Codec, x: torch.Tensor, eb, ids, blocks) -> torch.Tensor:
    """``codec.encode`` on CUDA; a baseline whose FBGEMM op has no CUDA kernel here (fbgemm-gpu-cpu
    on a GPU host: int8, fp8) skips, naming it."""
    try:
        return codec.encode(x, eb, ids, blocks=blocks)
    except NotImplementedError as e:
        pytest.skip(f"codec {codec.name!r} cannot encode on CUDA here (FBGEMM's CUDA ops are missing): {e}")


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding-like rows (duplicated ids, so dedup is exercised), 3 tables of 16, with specials."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (512,), generator=g)
    x = (torch.randn(50, 48, generator=g) * 0.05)[ids]
    x[7, 3], x[9, 20], x[11, 40] = float("nan"), float("inf"), -0.0
    ids[7], ids[9], ids[11] = 1000, 1001, 1002  # rows with specials get ids of their own
    return x, ids


EB = [1e-3, 1e-2, 1e-4]  # the bounds of inputs()' three tables


def case(key: str) -> tuple[compression.Codec, torch.Tensor, torch.Tensor | None]:
    """A key's codec, its input, and the ids it is encoded with (None without ``+ids``)."""
    x, ids = inputs()
    return compression.get_codec(key.removesuffix("+ids")), x, ids if key.endswith("+ids") else None


@pytest.mark.parametrize("key", KEYS)
def test_a_cuda_payload_decodes_on_cuda_bit_for_bit_as_on_the_cpu(key: str) -> None:
    codec, x, i = case(key)
    payload = encoded(codec, x.cuda(), EB, None if i is None else i.cuda(), [16, 16, 16])
    assert payload.device.type == "cuda" and payload.dtype == torch.uint8
    on_cuda = codec.decode(payload, None if i is None else i.cuda())
    assert on_cuda.device.type == "cuda" and on_cuda.shape == x.shape and on_cuda.dtype == x.dtype
    try:
        on_cpu = codec.decode(payload.cpu(), i)  # the CPU reference decode of the same bytes
    except NotImplementedError as e:  # a CUDA-only format (fp8 rowwise): nothing to compare with
        pytest.skip(f"codec {codec.name!r} has no CPU decode: {e}")
    assert same(on_cuda, on_cpu, codec.bounded), f"{key}: the CUDA decode differs from the CPU decode"
    if codec.bounded:
        fin = torch.isfinite(x)
        err = (on_cpu[fin] - x[fin]).abs().view(-1, 1)
        assert bool((err <= torch.tensor(1e-2)).all())


@pytest.mark.parametrize("key", KEYS)
def test_a_round_trip_on_cuda_reconstructs_what_the_cpu_round_trip_does(key: str) -> None:
    codec, x, i = case(key)
    try:
        cpu = codec.decode(codec.encode(x, EB, i, blocks=[16, 16, 16]), i)
    except NotImplementedError as e:
        pytest.skip(f"codec {codec.name!r} does not run on the CPU: {e}")
    gi = None if i is None else i.cuda()
    cuda = codec.decode(encoded(codec, x.cuda(), EB, gi, [16, 16, 16]), gi)
    assert same(cuda, cpu, codec.bounded), f"{key}: the CUDA round trip differs from the CPU round trip"


def values() -> torch.Tensor:
    """Values over 13 decades with NaN, infinities, huge, subnormal and -0.0 (as test_triton.py)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6000, generator=g) * torch.pow(10.0, torch.randint(-8, 5, (6000,), generator=g).float())
    x[::97] = float("nan")
    x[5], x[6], x[7], x[8], x[9] = float("inf"), -float("inf"), 3e38, 1e-40, -0.0
    return x


@pytest.mark.parametrize("out", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("eb", [1e-3, 1e-6, 5.0])
def test_triton_quantize_on_cuda_is_the_cpu_reference(eb: float, out: torch.dtype) -> None:
    x = values().to(out).float()
    step, ed = torch.tensor(R.step_of(eb)), torch.tensor(R.float32_at_most(eb))
    codes, miss = K.quantize(x.cuda(), step.cuda(), ed.cuda(), out)
    ref_codes, ref_miss = R.quantize(x, step, ed, out)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(miss.cpu(), ref_miss)
    assert torch.equal(bits(K.dequantize(ref_codes.cuda(), step.cuda())), bits(R.dequantize(ref_codes, step)))


@pytest.mark.parametrize("n", [0, 1, 31, 33, 1000, 4099])
def test_triton_block_pack_on_cuda_is_the_cpu_reference(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    v = torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int32) >> torch.randint(
        0, 31, (n,), generator=g, dtype=torch.int32
    )
    widths, words = K.block_pack(v.cuda())
    ref_widths, ref_words = R.block_pack(v)
    assert torch.equal(widths.cpu(), ref_widths) and torch.equal(words.cpu(), ref_words)
    assert torch.equal(K.block_unpack(ref_widths.cuda(), ref_words.cuda(), n).cpu(), v)


@pytest.mark.parametrize("use_ids", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_the_triton_backend_on_cuda_writes_the_torch_backends_payload(entropy: bool, use_ids: bool) -> None:
    x, ids = inputs()
    i = ids.cuda() if use_ids else None
    eb = [1e-3, 1e-2, 1e-4]
    triton_codec = compression.get_codec("lossy", entropy=entropy, kernels="triton")
    torch_codec = compression.get_codec("lossy", entropy=entropy, kernels="torch")
    p_triton = triton_codec.encode(x.cuda(), eb, i, blocks=[16] * 3)
    p_torch = torch_codec.encode(x.cuda(), eb, i, blocks=[16] * 3)
    assert torch.equal(p_triton.cpu(), p_torch.cpu())
    assert torch.equal(bits(triton_codec.decode(p_torch, i)), bits(torch_codec.decode(p_torch, i)))
