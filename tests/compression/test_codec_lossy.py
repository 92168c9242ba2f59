"""The lossy codec: the error bound holds on every element, whatever the data, ids and blocks."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dlrm_compression as compression
from dlrm_compression import PayloadError, ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = [float("nan"), float("inf"), -float("inf"), 1e-40, -1e-45, 3e30, -0.0]


@st.composite
def cases(draw):
    """A tensor with duplicate rows consistent with its ids, blocks, bounds and specials."""
    rows = draw(st.integers(0, 48))
    nb = draw(st.integers(1, 4))
    widths = [draw(st.integers(0 if nb > 1 else 1, 9)) for _ in range(nb)]
    cols = sum(widths)
    dtype = draw(st.sampled_from(DTYPES))
    scale = 10.0 ** draw(st.integers(-8, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    distinct = draw(st.integers(1, max(rows, 1)))
    g = torch.Generator().manual_seed(seed)
    # Rows of each block come from a small table indexed by per-block ids: equal id, equal row.
    ids = torch.randint(0, distinct, (rows, nb), generator=g) * 7 - 3
    x = torch.empty(rows, cols)
    start = 0
    for b, w in enumerate(widths):
        table = torch.randn(distinct, w, generator=g) * scale
        if draw(st.booleans()) and distinct * w:  # sprinkle specials into the table
            flat = table.view(-1)
            k = draw(st.integers(1, min(4, flat.numel())))
            where = torch.randperm(flat.numel(), generator=g)[:k]
            flat[where] = torch.tensor([SPECIALS[draw(st.integers(0, len(SPECIALS) - 1))] for _ in range(k)])
        x[:, start : start + w] = table[(ids[:, b] + 3) // 7]
        start += w
    x = x.to(dtype)
    rel = [10.0 ** draw(st.floats(-7, 1)) for _ in range(nb)]
    eb = [r * scale for r in rel]
    if draw(st.booleans()):
        eb[draw(st.integers(0, nb - 1))] = 0.0
    return x, widths, eb, ids


def check_bound(x: torch.Tensor, y: torch.Tensor, widths, eb) -> None:
    """|y - x| <= eb per block in float64; NaN stays NaN and +-Inf stays exactly."""
    assert y.shape == x.shape and y.dtype == x.dtype
    xd, yd = x.double(), y.double()
    nan = torch.isnan(xd)
    assert torch.equal(nan, torch.isnan(yd)), "NaN positions changed"
    ints = torch.int32 if x.dtype == torch.float32 else torch.int16
    assert torch.equal(x.view(ints)[nan], y.view(ints)[nan]), "NaN bits changed"
    inf = torch.isinf(xd)
    assert torch.equal(xd[inf], yd[inf]), "Inf changed"
    start = 0
    for w, e in zip(widths, eb, strict=True):
        fx, fy = xd[:, start : start + w], yd[:, start : start + w]
        fin = torch.isfinite(fx)
        if fin.any():
            err = (fy[fin] - fx[fin]).abs().max().item()
            assert err <= e, f"error {err!r} > bound {e!r} in block at column {start}"
        start += w


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), entropy=st.booleans(), id_form=st.sampled_from(["none", "per_block", "shared"]))
def test_bound_holds_on_every_element(case, entropy, id_form):
    x, widths, eb, ids = case
    if id_form == "shared":  # one id per row for every block: equal id must mean equal row
        ids = ids[:, 0].contiguous()
        first = {}
        x = x[[first.setdefault(int(i), r) for r, i in enumerate(ids)]]
    elif id_form == "none":
        ids = None
    codec = compression.get_codec("lossy", entropy=entropy)
    payload = codec.encode(x, eb, ids, blocks=widths)
    # the bounds as a float64 tensor (relative_to_absolute's form), through the device code: same payload
    device = compression.get_codec("lossy", entropy=entropy, backend="device")
    eb_t = torch.tensor(eb, dtype=torch.float64)
    assert torch.equal(device.encode(x, eb_t, ids, blocks=widths), device.encode(x, eb, ids, blocks=widths))
    y = codec.decode(payload, ids)
    check_bound(x, y, widths, eb)
    # Into a caller's buffer: a strided column window of a wider tensor, the rest untouched.
    ints = {torch.float32: torch.int32}.get(x.dtype, torch.int16)
    wide = torch.full((x.shape[0], x.shape[1] + 5), 7.0, dtype=x.dtype)
    window = wide[:, 2 : 2 + x.shape[1]]
    assert codec.decode(payload, ids, out=window) is window
    assert torch.equal(window.view(ints), y.view(ints))
    assert bool((wide[:, :2] == 7).all()) and bool((wide[:, 2 + x.shape[1] :] == 7).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_ids_path_equals_value_path_and_fixed_equals_entropy(case):
    x, widths, eb, ids = case
    outs = []
    for entropy in (True, False):
        codec = compression.get_codec("lossy", entropy=entropy)
        outs.append(codec.decode(codec.encode(x, eb, ids, blocks=widths), ids))
        outs.append(codec.decode(codec.encode(x, eb, blocks=widths)))
        outs.append(
            compression.get_codec("lossy", entropy=entropy, dedup=False).decode(codec.encode(x, eb, blocks=widths))
        )
    ints = {torch.float32: torch.int32}.get(x.dtype, torch.int16)
    for o in outs[1:]:
        assert torch.equal(o.view(ints), outs[0].view(ints))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_device_dedup_code_matches_the_host_fast_path(case):
    # CPU tensors take numpy's sorts and compares; CUDA tensors the torch code, run here on CPU.
    from dlrm_compression import dedup

    x, widths, eb, ids = case
    ints = {torch.float32: torch.int32}.get(x.dtype, torch.int16)
    outs = []
    for host in (True, False):
        codec = compression.get_codec("lossy", entropy=True, backend="host" if host else "device")
        for i in (ids, None):
            plan = dedup.plan_by_ids(ids, numpy=host) if i is not None else dedup.plan_by_value(x, widths, numpy=host)
            outs.append((plan.counts.tolist(), codec.decode(codec.encode(x, eb, i, blocks=widths), i)))
    assert outs[2][0] == outs[0][0] and outs[3][0] == outs[1][0]  # same unique rows either way
    for _, y in outs[1:]:
        assert torch.equal(y.view(ints), outs[0][1].view(ints))


def test_zero_bound_is_lossless_and_empty_and_one_row_work():
    codec = compression.get_codec("lossy")
    x = torch.randn(5, 8)
    assert torch.equal(codec.decode(codec.encode(x, 0.0)), x)
    for shape in [(0, 8), (1, 8), (3, 0), (0, 0)]:
        x = torch.randn(*shape)
        for ids in (None, torch.arange(shape[0])):
            y = codec.decode(codec.encode(x, 1e-2, ids), ids)
            assert y.shape == x.shape
            check_bound(x, y, [shape[1]], [1e-2])


def test_duplicates_shrink_the_payload():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(16, 64, generator=g) * 0.01
    ids = torch.randint(0, 16, (1024,), generator=g)
    x = table[ids]
    codec = compression.get_codec("lossy")
    with_ids = codec.encode(x, 1e-3, ids).numel()
    by_value = codec.encode(x, 1e-3).numel()
    plain = compression.get_codec("lossy", dedup=False, entropy=False).encode(x, 1e-3).numel()
    assert with_ids < by_value < plain / 10  # (zstd alone would find some repeats: use blocks)


def test_decoding_with_missing_or_other_ids_raises():
    x = torch.randn(64, 8)
    ids = torch.arange(64) % 10
    x = x[ids]
    codec = compression.get_codec("lossy")
    payload = codec.encode(x, 1e-3, ids)
    with pytest.raises(PayloadError, match="pass the same ids"):
        codec.decode(payload)
    with pytest.raises(PayloadError, match="ids differ"):
        codec.decode(payload, ids.flip(0))
    with pytest.raises(ValueError, match="ids shape"):
        codec.decode(payload, ids[:10])


def test_per_block_ids_with_different_tables():
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randint(0, 5, (200,), generator=g), torch.randint(0, 50, (200,), generator=g)], 1)
    x = torch.cat(
        [(torch.randn(5, 16, generator=g) * 0.1)[ids[:, 0]], (torch.randn(50, 32, generator=g) * 10)[ids[:, 1]]], 1
    )
    codec = compression.get_codec("lossy")
    y = codec.decode(codec.encode(x, [1e-3, 1e-1], ids, blocks=[16, 32]), ids)
    check_bound(x, y, [16, 32], [1e-3, 1e-1])


def test_bad_bounds_are_rejected():
    codec = compression.get_codec("lossy")
    x = torch.randn(4, 4)
    for eb in [None, -1.0, math.nan, math.inf]:
        with pytest.raises(ValueError, match="bound"):
            codec.encode(x, eb)
    with pytest.raises(ValueError, match="entropy"):
        compression.get_codec("lossy", entropy="yes")


def test_value_dedup_survives_hash_collisions(monkeypatch):
    from dlrm_compression import dedup

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 16, generator=g) * 0.01)[torch.randint(0, 8, (300,), generator=g)]
    monkeypatch.setattr(
        dedup, "_row_hashes", lambda x, widths, host=False: torch.zeros(x.shape[0], len(widths), dtype=torch.int64)
    )
    codec = compression.get_codec("lossy")
    y = codec.decode(codec.encode(x, [1e-3, 1e-3], blocks=[8, 8]))
    check_bound(x, y, [8, 8], [1e-3, 1e-3])  # every row "collides": dedup falls back per block


def test_shared_ids_and_their_per_table_expansion_are_interchangeable():
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 30, (128,), generator=g)
    x = (torch.randn(30, 48, generator=g) * 0.01)[ids]
    codec = compression.get_codec("lossy")
    expanded = ids[:, None].expand(128, 3).contiguous()
    a = codec.decode(codec.encode(x, [1e-3] * 3, ids), expanded)
    b = codec.decode(codec.encode(x, [1e-3] * 3, expanded), ids.int())
    assert torch.equal(a, b)
    check_bound(x, a, [16, 16, 16], [1e-3] * 3)


def test_verify_ids_catches_rows_that_break_the_id_contract():
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 0], [1, 1], [3, 0], [2, 2]])  # block 1: rows 0 and 2 share id 0, differ
    codec = compression.get_codec("lossy", verify_ids=True)
    with pytest.raises(ValueError, match=r"block\(s\) \[1\]"):
        codec.encode(x, [1e-3, 1e-3], ids, blocks=[4, 4])
    shared = torch.tensor([0, 1, 0, 2])
    good = x[shared]
    check_bound(good, codec.decode(codec.encode(good, 1e-3, shared), shared), [8], [1e-3])


# -- the device framing: lengths left on the device, heads read once per collective --------------


def _deferred_round_trip(codec, x, eb, ids, widths):
    """(the usual payload, the deferred one settled, its decode through a read head, the syncs
    of the deferred encode and of that decode)."""
    from dlrm.telemetry.sync_counter import HostSyncCounter
    from dlrm_compression import format as fmt

    want = codec.encode(x, eb, ids, blocks=widths)
    enc, dec = HostSyncCounter(), HostSyncCounter()
    with enc:
        late = codec.encode_deferred(x, eb, ids, blocks=widths)
    assert isinstance(late, fmt.Deferred)
    [payload] = fmt.settle([late])
    extra, state = codec.prepare_decode(payload, ids)
    [head] = fmt.read_heads([payload], [extra], [codec.head_size(len(widths))])
    head.state = state
    with dec:
        y = codec.decode(payload, ids, head=head)
    return want, payload, y, enc.total, dec.total


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), by=st.sampled_from(["ids", "value", "none"]))
def test_device_framing_writes_the_same_payload_and_decodes_it_without_host_syncs(case, by):
    from dlrm.telemetry.sync_counter import HostSyncCounter
    from dlrm_compression import dedup

    x, widths, eb, ids = case
    i = ids if by == "ids" else None
    # rows by id, by value, or as they are; the device backend's code on CPU tensors
    codec = compression.get_codec("lossy", entropy=False, dedup=by != "none", backend="device")
    want, payload, y, enc_syncs, dec_syncs = _deferred_round_trip(
        codec, x, torch.tensor(eb, dtype=torch.float64), i, widths
    )
    plain = codec.decode(want, i)
    with HostSyncCounter() as c:  # what a sender knows its peer decodes, without the payload
        held = codec.decoded(x, torch.tensor(eb, dtype=torch.float64), widths)
        plan = None if i is None else dedup.plan_capacity(i)
    per_block = torch.tensor(eb, dtype=torch.float64).expand(len(widths))  # as an encode checked them
    checked = codec.decoded(x, per_block, widths, checked=True)
    assert torch.equal(payload, want)  # byte for byte: lengths, check and sections
    assert enc_syncs == dec_syncs == c.total == 0
    ints = {torch.float32: torch.int32}.get(x.dtype, torch.int16)
    assert torch.equal(y.view(ints), plain.view(ints)) and torch.equal(held.view(ints), plain.view(ints))
    assert torch.equal(checked.view(ints), plain.view(ints))
    if plan is not None:  # the capacity plan: the dedup plan's counts and inverse, one sort
        counts, _, inverse = dedup.unique_per_block(i)
        assert torch.equal(plan[0], counts) and torch.equal(plan[2], inverse)


def test_device_framing_with_one_id_column_shared_by_every_block_and_a_corrupted_payload():
    from dlrm_compression import format as fmt

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 9, (70, 1), generator=g)
    x = (torch.randn(9, 30, generator=g) * 0.1)[ids[:, 0]]
    x[ids[:, 0] == ids[0, 0], 5] = float("nan")  # an exception, the same in every row of that id
    codec = compression.get_codec("lossy", entropy=False, backend="device")
    shared = ids.expand(70, 3)
    want, payload, y, enc_syncs, dec_syncs = _deferred_round_trip(codec, x, [1e-3, 1e-2, 0.0], shared, [10] * 3)
    assert torch.equal(payload, want) and enc_syncs == dec_syncs == 0
    assert torch.equal(y.view(torch.int32), codec.decode(want, shared).view(torch.int32))
    bad = payload.clone()
    bad[bad.numel() // 2] ^= 0x10
    extra, state = codec.prepare_decode(bad, shared)
    [head] = fmt.read_heads([bad], [extra])
    head.state = state
    with pytest.raises(fmt.PayloadError, match="checksum"):
        codec.decode(bad, shared, head=head)
    other = shared.clone()
    other[0, :] += 1  # the receiver's ids differ from the sender's: caught from the read values
    extra, state = codec.prepare_decode(payload, other)
    [head] = fmt.read_heads([payload], [extra])
    head.state = state
    with pytest.raises(fmt.PayloadError, match="ids"):
        codec.decode(payload, other, head=head)


@pytest.mark.parametrize("n_blocks", [1, 47, 120])
def test_device_framing_reads_whole_heads_of_many_blocks_and_keeps_bf16_nan_bits(n_blocks):
    from dlrm_compression import format as fmt

    g = torch.Generator().manual_seed(n_blocks)
    ids = torch.randint(0, 5, (9, n_blocks), generator=g)
    table = torch.randn(5, 4 * n_blocks, generator=g)
    x = torch.cat([table[ids[:, b], 4 * b : 4 * b + 4] for b in range(n_blocks)], 1).to(torch.bfloat16)
    x.view(torch.int16)[ids[:, 0] == ids[0, 0], 1] = 0x7FC1  # a NaN with a payload, in every row of that id
    codec = compression.get_codec("lossy", entropy=False, backend="device")
    want, payload, y, enc_syncs, dec_syncs = _deferred_round_trip(codec, x, [1e-2] * n_blocks, ids, [4] * n_blocks)
    read = fmt.read_heads([payload], [None], [codec.head_size(n_blocks)])[0]
    assert torch.equal(payload, want) and enc_syncs == dec_syncs == 0
    assert torch.equal(y.view(torch.int16), codec.decode(want, ids).view(torch.int16))
    assert int(y.view(torch.int16)[0, 1]) == 0x7FC1  # the exception's bits, as sent
    header, _ = fmt.unpack(payload, read)
    assert read.section(header, 0, 8 * n_blocks) is not None  # the counts came with the head


def test_a_forged_check_on_the_device_path_cannot_read_past_the_payload():
    """Widths that disagree with the packed words, under a recomputed (valid) check: the decode
    reads nothing past the words (zero-width groups), where the host path names the mismatch."""
    from dlrm_compression import format as fmt

    ids = torch.arange(64)[:, None] % 7
    x = torch.randn(7, 8)[ids[:, 0]]
    codec = compression.get_codec("lossy", entropy=False, backend="device")
    payload = codec.encode(x, [1e-3], ids, blocks=[8])
    header, _ = fmt.unpack(payload)
    codes_at = header.offsets[2]
    forged = payload.clone()
    forged[codes_at : codes_at + 2] = 31  # two groups claim 31-bit codes
    ops.adler32_seal_(forged, None, forged.numel(), fmt._CRC_AT, 4, fmt._CRC_AT)  # a valid check
    extra, state = codec.prepare_decode(forged, ids)
    [head] = fmt.read_heads([forged], [extra], [codec.head_size(1)])
    head.state = state
    y = codec.decode(forged, ids, head=head)  # no IndexError, no read past the words
    with pytest.raises(PayloadError, match="widths say"):
        codec.decode(forged, ids)
    assert y.shape == x.shape


@pytest.mark.parametrize("kw", [dict(entropy=False), dict(entropy=True), dict(entropy=False, backend="device")])
def test_each_blocks_bytes_are_read_from_the_payloads_sections(kw):
    # a constant block, a narrow-range one and a wide-range one: their shares of one payload
    # follow what each costs encoded alone (an independent figure), and add up to the payload
    g = torch.Generator().manual_seed(0)
    rows, blocks = 256, [16, 16, 32]
    x = torch.cat(
        [torch.zeros(rows, 16), torch.randn(rows, 16, generator=g) * 0.01, torch.randn(rows, 32, generator=g)], 1
    )
    codec = compression.get_codec("lossy", **kw)
    payload = codec.encode(x, [1e-3] * 3, blocks=blocks)
    shares = codec.block_bytes(payload, blocks).tolist()
    assert sum(shares) == pytest.approx(payload.numel(), abs=1e-6)
    solo = [
        codec.encode(x[:, a : a + w].contiguous(), 1e-3, blocks=[w]).numel() for a, w in [(0, 16), (16, 16), (32, 32)]
    ]
    assert shares[0] < 0.01 * payload.numel()  # by width it would be a quarter
    slack = 0.4 if kw["entropy"] else 0.15  # a zstd frame is split as the fixed coder would size each block
    for share, alone in zip(shares[1:], solo[1:], strict=True):
        assert abs(share - alone) < slack * alone, (shares, solo)
