"""The payload container: truncation, bit flips and foreign bytes always raise PayloadError, with
either check (crc32, the host backend's; Adler-32, the device backend's, run here on CPU tensors)."""

import random
import zlib

import pytest
import torch

import dlrm_compression as compression
from dlrm_compression import PayloadError, ops
from dlrm_compression import format as fmt
from dlrm_compression.backend import DEVICE

CHECKS = ["crc32", "adler32"]
BACKEND_OF = {"crc32": "host", "adler32": "device"}  # the backend whose payloads carry each check


@pytest.fixture(params=CHECKS)
def check(request):
    """Which check the payloads built in the test carry (their codec's backend's)."""
    return request.param


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 12, generator=g) * 0.01
    x[::3] = x[0]  # duplicates, so dedup sections are non-trivial
    ids = torch.arange(37)
    ids[::3] = 0
    return x, ids


# Every registered codec, and again with ids where it is bounded (ids only matter to those).
KEYS = sorted(
    [name for name in compression.available_codecs()]
    + [name + "+ids" for name in compression.available_codecs() if compression.get_codec(name).bounded]
)
_CACHE: dict[tuple[str, str], tuple] = {}


def _payload(key: str, check: str = "crc32") -> tuple:
    """(codec, payload, ids) of one small payload; a codec that cannot run here (e.g. an fbgemm
    baseline without its kernels) skips the case, naming why, instead of vanishing from the list."""
    if (key, check) not in _CACHE:
        name, with_ids = key.removesuffix("+ids"), key.endswith("+ids")
        codec = compression.get_codec(name, backend=BACKEND_OF[check])
        x, ids = _inputs()
        try:
            payload = codec.encode(x, 1e-3, ids if with_ids else None)
        except NotImplementedError as e:
            pytest.skip(f"codec {name!r} does not run here: {e}")
        assert bool(payload[7] & fmt.ADLER32) == (check == "adler32")  # the flags record the check
        _CACHE[(key, check)] = (codec, payload, ids if with_ids else None)
    return _CACHE[(key, check)]


@pytest.mark.parametrize("key", KEYS)
def test_every_truncation_raises(key, check):
    codec, payload, ids = _payload(key, check)
    for n in sorted({0, 1, 5, 23, 24, 31, 32, payload.numel() // 2, payload.numel() - 1}):
        with pytest.raises(PayloadError):
            codec.decode(payload[:n].clone(), ids)


@pytest.mark.parametrize("key", KEYS)
def test_every_single_bit_flip_raises(key, check):
    codec, payload, ids = _payload(key, check)
    rng = random.Random(key)
    positions = list(range(min(64, payload.numel()))) + rng.sample(range(payload.numel()), min(64, payload.numel()))
    for pos in positions:
        bad = payload.clone()
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(PayloadError):
            codec.decode(bad, ids)


@pytest.mark.parametrize("key", KEYS)
def test_decode_into_a_callers_tensor(key, check):
    codec, payload, ids = _payload(key, check)
    want = codec.decode(payload, ids)
    rows = torch.full((50, want.shape[1]), -1.0)  # a row window and a column window of bigger tensors
    cols = torch.full((want.shape[0], want.shape[1] + 4), -1.0)
    for buf, view in [(rows, rows[5 : 5 + want.shape[0]]), (cols, cols[:, 3 : 3 + want.shape[1]])]:
        assert codec.decode(payload, ids, out=view) is view
        assert torch.equal(view, want)
        assert int((buf == -1).sum()) == buf.numel() - want.numel()
    for bad in [torch.empty(want.shape[0] + 1, want.shape[1]), torch.empty(want.shape, dtype=torch.float16)]:
        with pytest.raises(ValueError, match="out is"):
            codec.decode(payload, ids, out=bad)


def test_foreign_bytes_raise(check):
    codec = compression.get_codec("none")
    for junk in [
        torch.zeros(0, dtype=torch.uint8),
        torch.arange(200, dtype=torch.uint8),
        torch.frombuffer(bytearray(b"PK\x03\x04" + bytes(60)), dtype=torch.uint8),
    ]:
        with pytest.raises(PayloadError):
            codec.decode(junk)
        with pytest.raises(PayloadError):
            compression.decode(junk)
    with pytest.raises(PayloadError, match="uint8"):
        codec.decode(torch.zeros(40, dtype=torch.float32))


def test_trailing_bytes_raise(check):
    codec, payload, ids = _payload("none", check)
    with pytest.raises(PayloadError, match="trailing"):
        codec.decode(torch.cat([payload, torch.zeros(8, dtype=torch.uint8)]), ids)


def test_sections_survive_an_unaligned_payload_view(check):
    codec, payload, _ = _payload("none", check)
    buf = torch.zeros(payload.numel() + 3, dtype=torch.uint8)
    buf[3:] = payload
    assert torch.equal(codec.decode(buf[3:]), codec.decode(payload))


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_an_empty_section_at_any_offset_reads_as_empty(offset):
    from dlrm_compression.format import view_as

    buf = torch.arange(16, dtype=torch.uint8)
    for dtype in (torch.float32, torch.int64, torch.int16):
        assert view_as(buf[offset:offset], dtype, "empty").shape == (0,)
        # a full section at the same odd offset still reads its bytes (copied to align)
        n = dtype.itemsize
        assert torch.equal(
            view_as(buf[offset : offset + n], dtype, "one"), buf[offset : offset + n].clone().view(dtype)
        )


def test_the_device_check_is_zlibs_adler32_and_either_check_decodes_anywhere():
    x, ids = _inputs()
    by_check = {}
    for c in CHECKS:  # (entropy=auto follows the backend: zstd only on the host's)
        by_check[c] = compression.get_codec("lossy", entropy=True, backend=BACKEND_OF[c]).encode(x, 1e-3, ids)
    codec = compression.get_codec("lossy", entropy=True)  # decoding reads the check from the flags
    for c, p in by_check.items():
        body = p[:20].numpy().tobytes() + p[24:].numpy().tobytes()  # all but the check field
        want = zlib.adler32(body) if c == "adler32" else zlib.crc32(body)
        assert int.from_bytes(p[20:24].numpy().tobytes(), "little") == want
        assert torch.equal(codec.decode(p, ids), codec.decode(by_check["crc32"], ids))
    same = [p[torch.arange(p.numel()) // 4 != 5] for p in by_check.values()]  # only the check and flag differ
    assert torch.equal(same[0][torch.arange(same[0].numel()) != 7], same[1][torch.arange(same[1].numel()) != 7])
    # the device's op against zlib: the mod-65521 sums over and past a wrap, more than one pass of
    # the reference, a skipped field and an end on the device that stops short of the buffer
    for n in (0, 1, 65521, 300_000, (1 << 22) + 4099):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        assert int(ops.adler32(t, None, n, 0, 0, 0)) == zlib.adler32(t.numpy().tobytes())
        end = n * 2 // 3
        if end >= 24:  # (a payload holds its check field)
            want = zlib.adler32(t[:20].numpy().tobytes() + t[24:end].numpy().tobytes())
            assert int(ops.adler32(t, torch.tensor(end), 0, 20, 4, 20)) == want, n
    ones = torch.full((1 << 20,), 255, dtype=torch.uint8)
    assert int(ops.adler32(ones, None, ones.numel(), 0, 0, 0)) == zlib.adler32(bytes([255]) * (1 << 20))


def test_a_deferred_payload_is_the_host_payload_byte_for_byte():
    """pack_deferred frames pieces whose lengths stay on the device in one gather: pieces longer
    than a tile of it, with capacity past their lengths, land as pack joins them."""
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (3 * 4096 + 5, 3000))
    header = fmt.Header(1, torch.float32, 4, 2, [2], [0.5])
    late = fmt.pack_deferred(header, [[(a, a.numel() - 9)], [(b, 17), (b, 2500)]], torch.device("cpu"))
    host = fmt.pack(header, [a[:-9], torch.cat([b[:17], b[:2500]])], backend=DEVICE)
    assert torch.equal(late.take(int(late.length)), host)
    empty = fmt.pack_deferred(header, [[(a, 0)], [(b, torch.tensor(0))]], torch.device("cpu"))
    assert torch.equal(empty.take(int(empty.length)), fmt.pack(header, [a[:0], b[:0]], backend=DEVICE))


def test_the_device_check_reads_only_the_header_on_the_host(check, monkeypatch):
    """crc32 hands the host every byte of the payload; Adler-32 only its first kilobyte (prefix
    and header) with the verdict (seen by the bytes that reach numpy: on CPU tensors no
    dispatcher op shows a host copy). The fixed-length coder, on each backend."""
    x, ids = torch.randn(2048, 16, generator=torch.Generator().manual_seed(2)), torch.arange(2048)
    codec = compression.get_codec("lossy", entropy=False, backend=BACKEND_OF[check])
    seen: list[int] = []
    real = torch.Tensor.numpy
    monkeypatch.setattr(torch.Tensor, "numpy", lambda t, *a, **k: seen.append(t.numel()) or real(t, *a, **k))
    payload = codec.encode(x, 1e-3, ids)
    codec.decode(payload, ids)
    if check == "adler32":
        assert max(seen) <= 1024 + 1 < payload.numel() // 8
    else:
        assert max(seen) >= payload.numel() - 24


def test_block_pack_in_slices_packs_every_group_as_one_pass_would():
    """The torch block coder packs in slices of groups (small tables): codes past a slice
    boundary, at capacity too, unpack to themselves, and the packed words are the whole pass's."""
    from dlrm_compression import reference

    n = 32 * reference._PACK_GROUPS + 1000
    g = torch.Generator().manual_seed(5)
    v = (torch.randint(0, 1 << 20, (n,), generator=g) >> torch.randint(0, 21, (n,), generator=g)).int()
    for capacity in (False, True):
        widths, words = reference.block_pack(v, capacity=capacity)
        used = words[: int(widths.long().sum())]
        assert torch.equal(reference.block_unpack(widths, used, n), v)
        saved = reference._PACK_GROUPS
        try:
            reference._PACK_GROUPS = 1 << 30  # one pass
            assert torch.equal(reference.block_pack(v, capacity=capacity)[1], words)
        finally:
            reference._PACK_GROUPS = saved
