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


def _duplicate_ids(rows: int, blocks: int, distinct: int, seed: int, shared: bool = False) -> torch.Tensor:
    """[rows, blocks] ids drawn from ``distinct`` values (many duplicates; shared: one column for
    every block, as a [rows] id tensor expands)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, distinct - 1, (rows, 1 if shared else blocks), generator=g)  # (-1: the empty bag's)
    return ids.expand(rows, blocks) if shared else ids


def _wide(rows: int, cols: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Finite values over many magnitudes (whose sums depend on their order), a few -0.0 and inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.pow(10.0, torch.randint(-4, 4, (rows, cols), generator=g).float())
    if x.numel() > 4:
        x.view(-1)[torch.randperm(x.numel(), generator=g)[:4]] = torch.tensor([-0.0, -0.0, float("inf"), -0.0])
    return x.to(dtype)


# (rows, widths, distinct ids, shared ids)
SUMMED_CASES = [(300, [16, 0, 8], 12, False), (257, [5, 5, 5, 5], 3, True), (64, [7], 64, False), (1, [3, 2], 1, False)]


@pytest.mark.parametrize("name", sorted(CASTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["host", "device"])
def test_summed_duplicate_ids_are_the_transports_sums_bit_for_bit(name, dtype, backend):
    """``context.summed``: the payload is the one the transport's duplicate-id stage sent before
    (``sum_duplicates`` then the cast), byte for byte: every id's sum the same float, summed in row
    order; ``keep_first`` decodes what ``keep_first_duplicates`` kept. On the device backend (the
    fused ops, :func:`compression.ops.cast_pack_summed` / ``cast_unpack_first``) and on the host's."""
    from dlrm.embedding_comm.ids import keep_first_duplicates, sum_duplicates
    from dlrm_compression.base import CodecContext

    codec = compression.get_codec(name, backend=backend)
    assert codec.sums_duplicates(torch.device("cpu")) == (backend == "device")
    for k, (rows, widths, distinct, shared) in enumerate(SUMMED_CASES):
        x = _wide(rows, sum(widths), k, dtype)
        ids = _duplicate_ids(rows, len(widths), distinct, k, shared)
        today = codec.encode(sum_duplicates(x, ids, widths), blocks=widths)
        payload = codec.encode(x, ids=ids, blocks=widths, context=CodecContext(summed=True))
        assert torch.equal(payload, today), (rows, widths)
        assert torch.equal(
            codec.encode(x, ids=ids, blocks=widths), codec.encode(x, blocks=widths)
        )  # not summed: ids unread
        want = keep_first_duplicates(codec.decode(today), ids, widths)
        got = codec.decode(payload, ids, context=CodecContext(keep_first=True))
        assert _same_bits(got, want)
        if codec.checks_in_decode(x.device) and codec._fused(dtype):  # the device's receiver: into a window
            window = torch.full((rows, sum(widths) + 2), 7.0, dtype=dtype)
            verdict = codec.decode_checked(payload, window[:, 1:-1], widths, CodecContext(keep_first=True), ids=ids)
            assert verdict.tolist() == [1, 1] and _same_bits(window[:, 1:-1], want)
            assert (window[:, 0] == 7).all() and (window[:, -1] == 7).all()


def test_summed_casts_make_no_host_read_and_keep_first_needs_ids():
    from dlrm.bench.host_syncs import counted_reads
    from dlrm.telemetry.sync_counter import HostSyncCounter
    from dlrm_compression.base import CodecContext

    codec = compression.get_codec("fp16", backend="device")
    x, ids, widths = _wide(128, 24, 0, torch.float32), _duplicate_ids(128, 3, 9, 0), [8, 8, 8]
    out, counter = torch.empty(128, 24), HostSyncCounter()
    codec.encode(x, ids=ids, blocks=widths, context=CodecContext(summed=True))  # (the header goes up once per shape)
    with counted_reads(counter), counter:
        payload = codec.encode(x, ids=ids, blocks=widths, context=CodecContext(summed=True))
        verdict = codec.decode_checked(payload, out, widths, CodecContext(keep_first=True), ids=ids)
    assert counter.total == 0 and sum(counter.launches.values()) == 4  # a sort and one op, each way
    assert verdict.tolist() == [1, 1]
    with pytest.raises(ValueError, match="summed needs"):
        codec.encode(x, blocks=widths, context=CodecContext(summed=True))
    with pytest.raises(ValueError, match="keep_first needs"):
        codec.decode_checked(payload, out, widths, CodecContext(keep_first=True))
    with pytest.raises(ValueError, match="keep_first needs"):
        codec.decode(payload, context=CodecContext(keep_first=True))
