"""The cast baselines (none, fp16, bf16) and the codec API they share with every codec."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dlrm_compression as compression
from dlrm_compression import PayloadError

CASTS = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _special_tensor(rows: int, cols: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values spanning many magnitudes, with NaN, +-Inf, zeros and subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.pow(10.0, torch.randint(-8, 5, (rows, cols), generator=g).float())
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39])
    pick = torch.rand(rows, cols, generator=g) < 0.1
    x[pick] = specials[torch.randint(0, len(specials), (int(pick.sum()),), generator=g)]
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so NaN == NaN and -0.0 != 0.0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.view(ints), b.view(ints))


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(CASTS)),
    rows=st.integers(0, 40),
    cols=st.integers(0, 20),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_cast_codecs_match_torch_casts(name, rows, cols, dtype, seed):
    x = _special_tensor(rows, cols, seed, dtype)
    codec = compression.get_codec(name)
    payload = codec.encode(x, 1e-3)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    y = codec.decode(payload)
    wire = CASTS[name]
    expected = x if wire is None else x.to(wire).to(dtype)
    assert _same_bits(y, expected)
    assert _same_bits(compression.decode(payload), expected)  # the header names the codec


def test_none_is_exact_and_does_not_alias_the_payload():
    x = _special_tensor(7, 5, 0, torch.float32)
    codec = compression.get_codec("none")
    payload = codec.encode(x)
    y = codec.decode(payload)
    payload.zero_()
    assert _same_bits(y, x)


def test_cast_codecs_ignore_bound_and_ids_but_check_their_shapes():
    x = torch.randn(6, 8)
    codec = compression.get_codec("fp16")
    ids = torch.arange(12).reshape(6, 2)
    y = codec.decode(codec.encode(x, [1e-3, 1e-2], ids, blocks=[3, 5]), ids)
    assert _same_bits(y, x.half().float())
    with pytest.raises(ValueError, match="ids shape"):
        codec.encode(x, 1e-3, torch.arange(5))
    with pytest.raises(ValueError, match="blocks"):
        codec.encode(x, [1e-3, 1e-3], blocks=[3, 4])
    with pytest.raises(ValueError, match="2 error bounds for 3 blocks"):
        codec.encode(x, [1e-3, 1e-3], blocks=[3, 3, 2])


def test_bad_inputs_are_named():
    codec = compression.get_codec("none")
    with pytest.raises(ValueError, match="2-D"):
        codec.encode(torch.randn(4))
    with pytest.raises(ValueError, match="dtype"):
        codec.encode(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        compression.get_codec("nope")
    with pytest.raises(TypeError, match="codec 'fp16'"):
        compression.get_codec("fp16", level=3)


def test_foreign_payload_is_rejected_by_the_wrong_codec():
    payload = compression.get_codec("fp16").encode(torch.randn(3, 4))
    with pytest.raises(PayloadError, match="written by codec 'fp16', not 'bf16'"):
        compression.get_codec("bf16").decode(payload)


def test_relative_to_absolute_uses_each_blocks_finite_range():
    x = torch.tensor([[0.0, 10.0, 5.0], [2.0, -10.0, float("inf")], [1.0, 0.0, 7.0]])
    eb = compression.relative_to_absolute(x, [0.1, 0.01], blocks=[1, 2])
    assert eb[0] == pytest.approx(0.1 * 2.0)
    assert eb[1] == pytest.approx(0.01 * 20.0)
    assert compression.relative_to_absolute(torch.zeros(0, 3), 0.1).tolist() == [0.0]
    assert math.isclose(compression.relative_to_absolute(x, 0.5)[0], 0.5 * 20.0)


@pytest.mark.parametrize("backend", ["host", "device"])
@pytest.mark.parametrize("name", sorted(CASTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_casts_known_size_is_its_payloads_length(backend, name, dtype):
    codec = compression.get_codec(name, backend=backend)
    for rows, blocks in [(1, [1]), (3, [2, 5]), (7, [4, 4, 3]), (64, [16] * 13)]:
        x = torch.randn(rows, sum(blocks)).to(dtype)
        assert codec.known_size((rows, sum(blocks)), dtype, blocks) == codec.encode(x, blocks=blocks).numel()
