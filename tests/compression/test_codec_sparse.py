"""The threshold codec (DCT's hard thresholding) on bare tensors."""

from __future__ import annotations

import math

import pytest
import torch

import dlrm_compression as compression
from dlrm_compression.base import CodecContext
from dlrm_compression.sparse import kth_largest_abs


def gradients(n: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 1, generator=g) * torch.rand(n, 1, generator=g) ** 3).contiguous()


@pytest.mark.parametrize("keep", [0.001, 0.01, 0.1, 0.5, 1.0])
def test_the_threshold_keeps_the_largest_fraction_and_nothing_else(keep):
    x = gradients()
    tau = kth_largest_abs(x, keep)
    # independent: the ceil(keep * n) largest magnitudes by a full sort
    k = math.ceil(keep * x.numel())
    largest = x.abs().view(-1).sort(descending=True).values
    assert tau == (0.0 if keep == 1.0 else float(largest[k - 1]))
    codec = compression.get_codec("threshold", threshold=tau)
    y = codec.decode(codec.encode(x))
    kept = y != 0
    assert int(kept.sum()) == k  # no ties in continuous data
    assert torch.equal(y[kept], x[kept])  # values exact (fp32)
    assert torch.equal(kept, x.abs() >= tau)


def test_positions_travel_as_deltas_when_sparse_and_as_a_bitmap_when_dense():
    n = 80000
    x = gradients(n)
    headers = compression.get_codec("threshold", threshold=1e9).encode(x).numel()  # nothing kept
    positions = {}
    for keep in (0.005, 0.5):
        codec = compression.get_codec("threshold", threshold=kth_largest_abs(x, keep))
        positions[keep] = codec.encode(x).numel() - headers - math.ceil(keep * n) * 4  # minus fp32 values
    assert positions[0.005] < 400 * 2  # sparse: under two bytes per index (a u32 index list: 4)
    assert n // 8 - 8 <= positions[0.5] <= n // 8 + 8  # dense: the bitmap, n/8 bytes (+ alignment)


@pytest.mark.parametrize("values, tolerance", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_cast_values_round_to_their_precision(values, tolerance):
    x = gradients()
    codec = compression.get_codec("threshold", threshold=kth_largest_abs(x, 0.05), values=values)
    y = codec.decode(codec.encode(x))
    kept = x.abs() >= codec.thresholds[0]
    torch.testing.assert_close(y[kept], x[kept], rtol=tolerance, atol=0)
    assert bool((y[~kept] == 0).all())


def test_lossy_values_hold_their_bound_and_shrink_the_payload():
    x = gradients(20000)
    tau = kth_largest_abs(x, 0.05)
    exact = compression.get_codec("threshold", threshold=tau)
    lossy = compression.get_codec("threshold", threshold=tau, values="lossy")
    eb = 0.01 * float(x.abs().max())
    y = lossy.decode(p := lossy.encode(x, eb))
    kept = x.abs() >= tau
    assert float((y[kept] - x[kept]).abs().max()) <= eb
    assert p.numel() < exact.encode(x).numel() / 2
    with pytest.raises(ValueError, match="needs one absolute bound"):
        lossy.encode(x)


def test_per_block_thresholds_non_finite_values_and_strided_output():
    x = torch.tensor([[0.5, -3.0, 0.1], [2.0, float("nan"), -0.2], [float("-inf"), 0.0, 0.3]])
    codec = compression.get_codec("threshold", threshold=[1.0, 0.25])
    y = codec.decode(codec.encode(x, blocks=[2, 1]))
    # block 0 (columns 0-1) keeps |x| >= 1 and the non-finite values; block 1 keeps |x| >= 0.25
    want = torch.tensor([[0.0, -3.0, 0.0], [2.0, float("nan"), 0.0], [float("-inf"), 0.0, 0.3]])
    assert torch.equal(y.nan_to_num(7.0), want.nan_to_num(7.0))
    wide = torch.full((3, 5), 9.0)
    codec.decode(codec.encode(x, blocks=[2, 1]), out=wide[:, 1:4])
    assert torch.equal(wide[:, 1:4].nan_to_num(7.0), want.nan_to_num(7.0)) and bool((wide[:, [0, 4]] == 9).all())
    assert codec.positions(codec.encode(x, blocks=[2, 1])).tolist() == [1, 3, 4, 6, 8]


def test_a_damaged_payload_raises_instead_of_decoding_wrong_values():
    x = gradients()
    codec = compression.get_codec("threshold", threshold=kth_largest_abs(x, 0.01))
    payload = codec.encode(x)
    for cut in (payload.numel() // 2, payload.numel() - 1):
        with pytest.raises(compression.PayloadError):
            codec.decode(payload[:cut])
    for at in range(0, payload.numel(), max(1, payload.numel() // 50)):
        bad = payload.clone()
        bad[at] ^= 0x10
        with pytest.raises(compression.PayloadError):
            codec.decode(bad)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="values must be one of"):
        compression.get_codec("threshold", values="zip")
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        compression.get_codec("threshold", threshold=-1.0)
    with pytest.raises(ValueError, match="keep must be > 0"):
        kth_largest_abs(gradients(), 0.0)


def test_many_non_finite_values_give_an_infinite_threshold_that_still_encodes():
    # a parameter whose k largest |values| are inf or NaN (a diverging run): the threshold is
    # inf, and exactly the non-finite values travel, so that the optimizer sees them
    x = torch.tensor([[1.0, float("inf"), -2.0, float("nan"), float("-inf"), 0.5]])
    tau = kth_largest_abs(x, 0.5)  # k = 3 of 6: inf, nan (counted as largest), -inf
    assert tau == float("inf")
    codec = compression.get_codec("threshold", threshold=tau)
    y = codec.decode(codec.encode(x))
    assert y[0, [0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert y[0, 1] == float("inf") and y[0, 4] == float("-inf") and torch.isnan(y[0, 3])


# --------------------------------------------------------------------------- the device coding


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("values", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("keep", [0.0005, 0.005, 0.1, 0.5, 1.0])
def test_the_device_coding_decodes_to_the_host_codings_values_bit_for_bit(values, keep):
    """The device backend's coding of the positions (and its payload check), on CPU tensors."""
    from dlrm_compression import sparse

    n = 40000
    x = gradients(n).view(1, -1).clone()
    x[0, :3] = torch.tensor([math.nan, math.inf, -0.0])  # non-finite travel; -0.0 keeps its sign at keep 1
    tau = sparse.kth_largest_abs_tensor(x, keep)
    host = compression.get_codec("threshold", values=values).decode(
        compression.get_codec("threshold", values=values).encode(x, thresholds=[float(tau)])
    )
    codec = compression.get_codec("threshold", values=values, backend="device")
    keep_mask = codec.mask(x, [n], [tau]).view(-1)
    count, width = int(keep_mask.sum()), int(sparse.delta_width(keep_mask))
    payload = codec.encode_known(x, keep_mask, count, width, [n])
    assert payload.numel() == codec.payload_size(n, [n], count, width)  # known before it is built
    assert torch.equal(codec.encode(x, thresholds=[tau]), payload)  # the plain encode, on a device
    dense, ok = codec.decode_known(payload, (1, n), torch.float32, [n], count, width)
    assert bool(ok)
    for got in (dense, codec.decode(payload), codec.sent(x, keep_mask)):
        assert torch.equal(_bits(got), _bits(host))
    # the positions: bit-packed deltas when sparse, the bitmap (numpy's bytes) when dense
    assert codec._header(payload)[0].info[:3] == [sparse.positions_mode(n, count, width), count, width * (keep <= 0.1)]
    assert sparse.positions_mode(n, count, width) == (sparse.PACKED if keep <= 0.1 else sparse.BITMAP)


def test_device_positions_are_bit_packed_deltas_smaller_than_a_bitmap_at_dcts_keep():
    from dlrm_compression import sparse

    n = 80000
    x = gradients(n).view(1, -1)
    codec = compression.get_codec("threshold", threshold=kth_largest_abs(x, 0.005), backend="device")
    keep = codec.mask(x, [n]).view(-1)
    idx = keep.nonzero().view(-1)
    deltas = torch.diff(idx, prepend=idx.new_zeros(1))
    width = int(sparse.delta_width(keep))
    assert width == int(deltas.max()).bit_length()
    assert torch.equal(sparse.unpack_bits(sparse.pack_bits(deltas, width), idx.numel(), width), deltas)
    positions = codec._header(codec.encode(x))[1][0].numel()
    assert positions == math.ceil(idx.numel() * width / 8) < n // 8 // 4  # under a quarter of the bitmap


def test_a_damaged_device_payload_fails_its_check_and_a_truncated_one_raises():
    from dlrm_compression import sparse

    n = 20000
    x = gradients(n).view(1, -1)
    codec = compression.get_codec("threshold", threshold=kth_largest_abs(x, 0.01), backend="device")
    keep = codec.mask(x, [n]).view(-1)
    count, width = int(keep.sum()), int(sparse.delta_width(keep))
    payload = codec.encode_known(x, keep, count, width, [n])
    for at in range(0, payload.numel(), max(1, payload.numel() // 50)):
        bad = payload.clone()
        bad[at] ^= 0x10
        dense, ok = codec.decode_known(bad, (1, n), torch.float32, [n], count, width)  # positions stay in range
        assert not bool(ok) and dense.shape == (1, n)
        with pytest.raises(compression.PayloadError):
            codec.decode(bad)
    for cut in (payload.numel() // 2, payload.numel() - 1):
        with pytest.raises(compression.PayloadError, match="truncated"):
            codec.decode_known(payload[:cut], (1, n), torch.float32, [n], count, width)


@pytest.mark.parametrize("values", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("keep", [0.0005, 0.005, 0.1, 0.5, 1.0])
def test_the_deferred_payload_is_built_and_decoded_from_its_read_head_without_a_host_read(values, keep):
    from dlrm.bench.host_syncs import counted_reads
    from dlrm.telemetry.sync_counter import HostSyncCounter
    from dlrm_compression import format as fmt
    from dlrm_compression import sparse

    x = gradients(40000).view(100, 400).clone()
    x[0, :3] = torch.tensor([math.nan, math.inf, -0.0])
    blocks = [150, 250]
    taus = [sparse.kth_largest_abs_tensor(x[:, :150], keep), sparse.kth_largest_abs_tensor(x[:, 150:], keep * 2)]
    on_host = compression.get_codec("threshold", values=values)  # zstd deltas or numpy's bitmap, crc32: the reference
    host = on_host.decode(on_host.encode(x, blocks=blocks, thresholds=[float(t) for t in taus]))
    codec = compression.get_codec("threshold", values=values, backend="device")
    counter = HostSyncCounter()
    with counted_reads(counter), counter:
        deferred = codec.encode_deferred(x, blocks=blocks, context=CodecContext(thresholds=taus))
    assert isinstance(deferred, fmt.Deferred) and counter.total == 0
    [payload] = fmt.settle([deferred])  # the transport's one read of every length
    assert torch.equal(payload, codec.encode(x, blocks=blocks, thresholds=taus))  # the device coding's bytes
    [head] = fmt.read_heads([payload], [None], [codec.head_size(len(blocks))])  # the receiver's one read
    with counted_reads(counter), counter:
        got = codec.decode(payload, head=head)
        where = codec.positions(payload, head)
    assert counter.total == 0
    assert torch.equal(_bits(got), _bits(host))
    assert torch.equal(where, codec.mask(x, blocks, taus).view(-1).nonzero().view(-1))
    bad = payload.clone()
    bad[-1] ^= 0x01  # a byte the host never reads: only the device check can tell
    [bad_head] = fmt.read_heads([bad], [None], [codec.head_size(len(blocks))])
    with pytest.raises(compression.PayloadError, match="checksum mismatch"):
        codec.decode(bad, head=bad_head)
