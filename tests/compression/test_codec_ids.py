"""The ids codec: exact round trip of jagged ids, bad payloads raise, no host sync per key, never more bytes
than raw and a small header, the launch budget."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm.telemetry.sync_counter import HostSyncCounter
from dlrm_compression import PayloadError
from dlrm_compression import format as fmt
from dlrm_compression.ids_codec import PAYLOAD_BYTES, STORED_BYTES, STORED_VERSION, IdsCodec, stored_bytes

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


# -- the payloads of before, stored payloads, the launch budget ---------------------------------


def _golden_batch(values32: bool, weighted: bool) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
    """4 keys of 64, 48, 0 and 40 bags (1 id a bag; 1-3; none; 0 or 1), ids from a 5,000-wide
    range and int64's ends; made without a random generator (the same on every torch)."""
    bags = [64, 48, 0, 40]
    lengths = [1] * 64 + [i % 3 + 1 for i in range(48)] + [i % 2 for i in range(40)]
    n = sum(lengths)
    values = [(i * 7919) % 5000 + (1 << 40) for i in range(n)]
    values[3], values[5], values[70] = I64.min, I64.max, -1
    if values32:
        values = [v % (1 << 31) for v in values]
    weights = torch.tensor([i % 17 / 4 for i in range(n)]) if weighted else None
    dtype = torch.int32 if values32 else torch.int64
    return torch.tensor(lengths, dtype=torch.int32), torch.tensor(values, dtype=dtype), bags, weights


# sha256 (first 16 hex digits) of both destinations' payloads, as main wrote them before stored
# payloads existed (commit 89420d5): (backend, entropy, weights, int32 ids) -> digest
BEFORE = {
    ("host", False, False, False): "eb8e54f318ad595d",
    ("host", False, False, True): "1081573f6da783d3",
    ("host", False, True, False): "1d42a18d72b23fb1",
    ("host", False, True, True): "5d2d6e4c94879382",
    ("host", True, False, False): "de45478fed9b8da9",
    ("host", True, False, True): "00713e284df49030",
    ("host", True, True, False): "e52464b64ab0fdd4",
    ("host", True, True, True): "184c986e398ff85b",
    ("device", False, False, False): "2613bb7cf4ff9805",
    ("device", False, False, True): "eb3eae4dc812259d",
    ("device", False, True, False): "a8e059524ae419f1",
    ("device", False, True, True): "ef17cc5df5123490",
}


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_a_coded_payload_is_the_bytes_it_was_before(case):
    """Payloads that code smaller than raw keep their format byte for byte (crc32 on the host,
    zstd or not; Adler-32 on the device): no version bump, old and new decoders read each other's."""
    import hashlib

    backend, entropy, weighted, values32 = case
    lengths, values, bags, weights = _golden_batch(values32, weighted)
    payloads = IdsCodec(entropy=entropy, backend=backend).encode(lengths, values, bags, weights, [2, 2])
    assert all(p[4] == 1 for p in payloads)  # the container's version: coded
    assert hashlib.sha256(b"".join(bytes(p.numpy()) for p in payloads)).hexdigest()[:16] == BEFORE[case]
    parts = IdsCodec(backend=backend).decode_all(payloads)
    assert torch.equal(torch.cat([p.values for p in parts]), values)


def _raw_bytes(lengths: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None) -> int:
    """What TorchRec's all-to-all sends for these tensors."""
    return sum(t.numel() * t.element_size() for t in (lengths, values, weights) if t is not None)


def test_a_small_batch_goes_stored_and_decodes_bit_for_bit():
    """One bag of a few ids: the plan and the container's header would outweigh them, so the
    payload is the tensors' bytes behind a 24-byte header (zeros to 8 bytes), checked like any other."""
    lengths = torch.tensor([3, 0, 2], dtype=torch.int32)
    values = torch.tensor([5, I64.max, 5, I64.min, 0])
    weights = torch.tensor([0.5, -1.0, 2.0, 3.0, float("nan")])
    for backend in ("host", "device"):
        (p,) = IdsCodec(backend=backend).encode(lengths, values, [3], weights)
        assert p[4] == STORED_VERSION and p.numel() == stored_bytes([3], 5, 4, 8, 4) == STORED_BYTES + 72
        assert p.numel() == _raw_bytes(lengths, values, weights) + STORED_BYTES  # (72 bytes: no padding)
        part = IdsCodec(backend="device" if backend == "host" else "host").decode(p)  # either check, any backend
        assert part.bags_per_key == [3] and part.plan is None
        assert part.lengths.dtype == torch.int32 and torch.equal(part.lengths, lengths)
        assert torch.equal(part.values, values)
        assert torch.equal(part.weights.view(torch.int32), weights.view(torch.int32))


@pytest.fixture(scope="module", params=["host", "device"])
def stored(request) -> torch.Tensor:
    lengths = torch.tensor([2, 1, 0, 1, 3], dtype=torch.int32)
    values = torch.tensor([9, 8, 7, 6, 5, 4, 3])
    (p,) = IdsCodec(backend=request.param).encode(lengths, values, [2, 3], torch.rand(7))  # bags vary
    assert p[4] == STORED_VERSION
    return p


def test_every_truncation_and_bit_flip_of_a_stored_payload_raises(stored):
    rng = random.Random(5)
    for n in sorted({0, 1, 23, 24, 25, stored.numel() // 2, stored.numel() - 1}):
        with pytest.raises(PayloadError, match=r"truncated|shorter|checksum"):
            IdsCodec().decode(stored[:n].clone())
    for pos in range(stored.numel()):
        bad = stored.clone()
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(PayloadError, match=r"from rank 3: "):
            IdsCodec(backend=rng.choice(["host", "device"])).decode(bad, "from rank 3")


def test_a_decoder_without_stored_payloads_refuses_one_by_its_version():
    """The container's decoder (every decoder before stored payloads, which went through it first)
    names the version it does not read."""
    (p,) = IdsCodec().encode(torch.ones(2, dtype=torch.int32), torch.tensor([4, 5]), [2])
    with pytest.raises(PayloadError, match=r"payload format version 2, this decoder reads version 1"):
        fmt.unpack(p)


@pytest.mark.parametrize("version", [0, 3, 255])
def test_a_payload_of_another_format_version_is_refused_naming_the_versions_read(version):
    """A coded or stored payload whose version byte is neither kind's (an older or newer release's)
    is refused before anything else is read from it; the two kinds' bytes never coincide."""
    assert STORED_VERSION != fmt.VERSION
    coded = IdsCodec().encode(*_criteo_like(2, batch=200))[0]
    (stored,) = IdsCodec().encode(torch.ones(2, dtype=torch.int32), torch.tensor([4, 5]), [2])
    for p, kind in ((coded, fmt.VERSION), (stored, STORED_VERSION)):
        assert p[4] == kind
        bad = p.clone()
        bad[4] = version
        with pytest.raises(PayloadError, match=rf"^from rank 2: payload format version {version}: the ids codec reads "
                           rf"versions 1 \(coded\) and 2 \(stored\)"):  # fmt: skip
            IdsCodec().decode(bad, "from rank 2")


@st.composite
def any_batch(draw):
    """Small (TorchRec's own KJT tests: 1-142 ids a rank), large, incompressible (distinct random
    int64 ids) or repetitive batches, fixed or per-key batch sizes, with or without weights."""
    kind = draw(st.sampled_from(["small", "large", "random", "repeats"]))
    n_keys = draw(st.integers(1, 5))
    fixed = draw(st.booleans())
    most = {"small": 6, "large": 300, "random": 300, "repeats": 300}[kind]
    bags = [draw(st.integers(0, most))] * n_keys if fixed else [draw(st.integers(0, most)) for _ in range(n_keys)]
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 11 if kind == "small" else 3, (sum(bags),), generator=g, dtype=torch.int32)
    n = int(lengths.sum())
    if kind == "random":
        values = torch.randint(I64.min, I64.max, (n,), generator=g)
    elif kind == "repeats":
        values = torch.randint(0, 5, (n,), generator=g) * 1_000_003
    else:
        values = torch.randint(0, 1001, (n,), generator=g)
    values = values.to(draw(st.sampled_from([torch.int32, torch.int64]))) if kind != "random" else values
    weights = torch.rand(n, generator=g) if draw(st.booleans()) else None
    cut = draw(st.integers(0, n_keys))
    return lengths, values, bags, weights, [cut, n_keys - cut]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=any_batch(), backend=st.sampled_from(["host", "device"]), entropy=st.booleans())
def test_a_payload_never_exceeds_its_raw_bytes_and_a_stored_header(case, backend, entropy):
    """Each destination's payload is at most the bytes TorchRec sends for its share plus the stored
    header and 7 bytes of padding (and a bag count per key where the keys' batch sizes differ), and
    decodes bit for bit."""
    lengths, values, bags, weights, keys_per_dest = case
    payloads = IdsCodec(entropy=entropy, backend=backend).encode(lengths, values, bags, weights, keys_per_dest)
    parts = IdsCodec(backend=backend).decode_all(payloads)
    key0 = bag0 = id0 = 0
    for p, part, nk in zip(payloads, parts, keys_per_dest, strict=True):
        mine = bags[key0 : key0 + nk]
        nb = sum(mine)
        ni = int(lengths[bag0 : bag0 + nb].sum())
        share = [t[a : a + m] for t, a, m in ((lengths, bag0, nb), (values, id0, ni))]
        w = None if weights is None else weights[id0 : id0 + ni]
        vary = 8 * (-(-nk // 2)) if len(set(mine)) > 1 else 0
        assert p.numel() <= _raw_bytes(*share, w) + STORED_BYTES + 7 + vary, (p.numel(), p[4])
        assert torch.equal(part.lengths, share[0]) and torch.equal(part.values, share[1])
        assert part.values.dtype == values.dtype and part.bags_per_key == mine
        assert (part.weights is None) == (w is None) and (w is None or torch.equal(part.weights, w))
        key0, bag0, id0 = key0 + nk, bag0 + nb, id0 + ni


def test_payloads_of_a_collective_decode_together_naming_a_bad_one():
    """decode_all: stored and coded payloads of several sources, from one received buffer or apart;
    a corrupted one is refused by name."""
    lengths, values, bags = _criteo_like(3, batch=200)
    big = IdsCodec(backend="device").encode(lengths, values, bags, keys_per_dest=[2, 1])
    small = IdsCodec(backend="device").encode(torch.ones(2, dtype=torch.int32), torch.tensor([3, 4]), [1, 1])
    payloads = [big[0], small[0], big[1]]
    assert [int(p[4]) for p in payloads] == [1, STORED_VERSION, 1]
    buffer = torch.cat(payloads)
    received = list(torch.split(buffer, [p.numel() for p in payloads]))  # as the transport receives them
    for got in (received, payloads):
        parts = IdsCodec(backend="device").decode_all(got, ["rank 0", "rank 1", "rank 2"])
        assert torch.equal(torch.cat([parts[0].values, parts[2].values]), values)
        assert torch.equal(parts[1].values, torch.tensor([3, 4])) and parts[1].plan is None
    bad = buffer.clone()
    bad[big[0].numel() + 30] ^= 2
    with pytest.raises(PayloadError, match=r"^rank 1: checksum mismatch"):
        IdsCodec(backend="device").decode_all(
            list(torch.split(bad, [p.numel() for p in payloads])), ["rank 0", "rank 1", "rank 2"]
        )


def _count(rows: int, tables: int, dests: int) -> tuple[int, int, int]:
    """(launches, encode syncs, decode syncs) of encoding ``tables`` keys of ``rows`` single ids
    for ``dests`` destinations and decoding every payload, on the device backend (CPU tensors)."""
    from dlrm.bench.host_syncs import counted_reads

    g = torch.Generator().manual_seed(rows + tables)
    values = (torch.rand(rows * tables, generator=g) ** 4 * 50_000).long()
    lengths = torch.ones(rows * tables, dtype=torch.int32)
    per = [tables // dests] * dests
    per[-1] += tables - sum(per)
    codec = IdsCodec(backend="device")
    counter = HostSyncCounter()
    with counted_reads(counter), counter:
        with counter.label("encode"):
            payloads = codec.encode(lengths, values, [rows] * tables, keys_per_dest=per)
        with counter.label("decode"):
            parts = codec.decode_all(payloads)
    assert torch.equal(torch.cat([p.values for p in parts]), values)
    assert all(p[4] == 1 for p in payloads)  # coded, not stored
    return sum(counter.launches.values()), counter.by_label["encode"], counter.by_label["decode"]


def test_the_codec_keeps_its_launch_budget_whatever_the_batch_keys_and_destinations():
    """Encode for every destination and decode of every payload: at most 100 dispatcher ops (the
    first count: 207 + 178 at 2 destinations, growing by destination), the same count at every
    size, table count and destination count; one host sync to encode, two to decode them all."""
    counts = {case: _count(*case) for case in [(2048, 26, 2), (2048, 13, 2), (8192, 26, 2), (2048, 26, 8), (64, 3, 3)]}
    assert len(set(counts.values())) == 1, counts
    launches, encode_syncs, decode_syncs = counts[(2048, 26, 2)]
    assert launches <= 100 and (encode_syncs, decode_syncs) == (1, 2), counts


@pytest.mark.scale
def test_the_codec_keeps_its_launch_budget_at_65536_rows():
    assert _count(65536, 26, 2) == _count(2048, 26, 2)
