"""The ids codec: exact round trip of jagged ids, bad payloads raise, no host sync per key."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm.telemetry.sync_counter import HostSyncCounter
from dlrm_compression import PayloadError
from dlrm_compression.ids_codec import PAYLOAD_BYTES, IdsCodec

I64 = torch.iinfo(torch.int64)
EDGE = [I64.min, I64.min + 1, -1, 0, 1, I64.max - 1, I64.max]


@st.composite
def batches(draw):
    """keys x destinations of jagged ids: empty keys, zero-length bags, int64 ends, few distinct."""
    n_keys = draw(st.integers(0, 5))
    bags = [draw(st.integers(0, 6)) for _ in range(n_keys)]
    lengths = [draw(st.integers(0, 4)) for _ in range(sum(bags))]
    pool = draw(st.lists(st.one_of(st.sampled_from(EDGE), st.integers(I64.min, I64.max)), min_size=1, max_size=6))
    values = [draw(st.sampled_from(pool)) for _ in range(sum(lengths))]
    cut = sorted(draw(st.lists(st.integers(0, n_keys), max_size=2)))
    keys_per_dest = [b - a for a, b in zip([0, *cut], [*cut, n_keys], strict=True)]
    return bags, lengths, values, keys_per_dest


def _split(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, counts)) if counts else []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=batches(),
    entropy=st.booleans(),
    dtypes=st.sampled_from([(torch.int32, torch.int64), (torch.int64, torch.int64), (torch.int32, torch.int32)]),
    weighted=st.booleans(),
)
def test_round_trip_is_exact_per_destination(case, entropy, dtypes, weighted):
    bags, lengths, values, keys_per_dest = case
    len_dtype, val_dtype = dtypes
    if val_dtype == torch.int32:
        values = [v % (1 << 31) for v in values]
    L = torch.tensor(lengths, dtype=len_dtype)
    V = torch.tensor(values, dtype=val_dtype)
    W = torch.rand(len(values)) if weighted else None
    payloads = IdsCodec(entropy=entropy).encode(L, V, bags, W, keys_per_dest)
    assert len(payloads) == len(keys_per_dest)
    key0, bag0, id0 = 0, 0, 0
    for p, nk in zip(payloads, keys_per_dest, strict=True):
        part = IdsCodec().decode(p)
        nb = sum(bags[key0 : key0 + nk])
        ni = sum(lengths[bag0 : bag0 + nb])
        assert part.bags_per_key == bags[key0 : key0 + nk]
        assert part.lengths.dtype == len_dtype and part.values.dtype == val_dtype
        assert torch.equal(part.lengths, L[bag0 : bag0 + nb])
        assert torch.equal(part.values, V[id0 : id0 + ni])
        assert (part.weights is None) == (W is None)
        if W is not None:
            assert torch.equal(part.weights, W[id0 : id0 + ni])
        key0, bag0, id0 = key0 + nk, bag0 + nb, id0 + ni


def test_empty_batch_and_keys_without_bags_round_trip():
    codec = IdsCodec()
    for bags in ([], [0], [0, 0, 0]):
        (p,) = codec.encode(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64), bags)
        part = codec.decode(p)
        assert part.bags_per_key == bags and part.lengths.numel() == 0 and part.values.numel() == 0
    (p,) = codec.encode(torch.zeros(4, dtype=torch.int32), torch.zeros(0, dtype=torch.int64), [4])
    assert torch.equal(codec.decode(p).lengths, torch.zeros(4, dtype=torch.int32))


def _criteo_like(n_keys: int, batch: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.ones(n_keys * batch, dtype=torch.int32)
    values = (torch.rand(n_keys * batch, generator=g) ** 4 * 5000).long() + (1 << 40)
    return lengths, values, [batch] * n_keys


def test_coded_size_is_the_distinct_ids_and_indices_not_eight_bytes_an_id():
    """Single-valued bags whose ids lie in a 5,000-wide range: a constant length costs no bits, a
    gap between distinct ids at most 13, an index ceil(log2(distinct)): far below the 8 + 4 bytes
    a lookup that TorchRec sends."""
    lengths, values, bags = _criteo_like(4)
    raw = values.numel() * 8 + lengths.numel() * 4
    bits = 0
    for i in range(4):
        d = values[i * 512 : (i + 1) * 512].unique().numel()
        bits += 512 * (d - 1).bit_length() + d * 13
    for entropy in (False, True):
        (p,) = IdsCodec(entropy=entropy).encode(lengths, values, bags)
        assert p.numel() <= bits / 8 + 400 < raw / 4  # 400: header, plan and first ids of 4 keys
        assert torch.equal(IdsCodec().decode(p).values, values)


def test_the_traffic_models_header_is_the_payloads():
    """dlrm/placement/traffic.py prices each input payload's header as PAYLOAD_BYTES: the
    container's own header_len field of real payloads (with and without entropy coding)."""
    import struct

    lengths, values, bags = _criteo_like(2)
    for entropy in (False, True):
        (p,) = IdsCodec(entropy=entropy).encode(lengths, values, bags)
        header_len = struct.unpack_from("<I", bytes(p[:12].tolist()), 8)[0]  # after magic and four bytes
        assert header_len == PAYLOAD_BYTES


def test_a_key_costs_no_host_synchronisation():
    """The counts of one call do not grow with the number of keys: the syncs are per call."""
    counts = []
    for n_keys in (2, 20):
        lengths, values, bags = _criteo_like(n_keys, batch=64)
        lengths[::7] = 3  # variable lengths: the bit-packed branch
        values = torch.cat([values, values[: 2 * (lengths.numel() // 7 + 1)]])[: int(lengths.sum())]
        codec = IdsCodec(entropy=False)
        with HostSyncCounter() as enc:
            payloads = codec.encode(lengths, values, bags, keys_per_dest=[n_keys // 2, n_keys - n_keys // 2])
        with HostSyncCounter() as dec:
            part = codec.decode(payloads[0])
        assert torch.equal(part.values, values[: part.values.numel()])
        counts.append((enc.total, dec.total))
    assert counts[0] == counts[1], counts
    assert counts[0][0] <= 1, counts  # encode: the sizes of what it packs, once per call


@pytest.fixture(scope="module")
def payload() -> torch.Tensor:
    lengths, values, bags = _criteo_like(3, batch=40)
    lengths[5] = 0
    lengths[6] = 2
    return IdsCodec(entropy=False).encode(lengths, values, bags, torch.rand(values.numel()))[0]


def test_every_truncation_raises(payload):
    for n in sorted({0, 1, 5, 23, 24, 31, 32, 100, payload.numel() // 2, payload.numel() - 1}):
        with pytest.raises(PayloadError):
            IdsCodec().decode(payload[:n].clone())


def test_every_single_bit_flip_raises(payload):
    rng = random.Random(3)
    positions = list(range(96)) + rng.sample(range(payload.numel()), 96)
    for pos in positions:
        bad = payload.clone()
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(PayloadError):
            IdsCodec().decode(bad)


def test_a_payload_of_another_codec_raises():
    import dlrm_compression as compression

    other = compression.get_codec("fp16").encode(torch.zeros(3, 2), 0.0)
    with pytest.raises(PayloadError, match="codec id"):
        IdsCodec().decode(other)
