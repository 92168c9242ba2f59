"""The payload container: truncation, bit flips and foreign bytes always raise PayloadError."""

import random

import pytest
import torch

import dlrm_compression as compression
from dlrm_compression import PayloadError


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
_CACHE: dict[str, tuple] = {}


def _payload(key: str) -> tuple:
    """(codec, payload, ids) of one small payload; a codec that cannot run here (e.g. an fbgemm
    baseline without its kernels) skips the case, naming why, instead of vanishing from the list."""
    if key not in _CACHE:
        name, with_ids = key.removesuffix("+ids"), key.endswith("+ids")
        codec = compression.get_codec(name)
        x, ids = _inputs()
        try:
            payload = codec.encode(x, 1e-3, ids if with_ids else None)
        except NotImplementedError as e:
            pytest.skip(f"codec {name!r} does not run here: {e}")
        _CACHE[key] = (codec, payload, ids if with_ids else None)
    return _CACHE[key]


@pytest.mark.parametrize("key", KEYS)
def test_every_truncation_raises(key):
    codec, payload, ids = _payload(key)
    for n in sorted({0, 1, 5, 23, 24, 31, 32, payload.numel() // 2, payload.numel() - 1}):
        with pytest.raises(PayloadError):
            codec.decode(payload[:n].clone(), ids)


@pytest.mark.parametrize("key", KEYS)
def test_every_single_bit_flip_raises(key):
    codec, payload, ids = _payload(key)
    rng = random.Random(key)
    positions = list(range(min(64, payload.numel()))) + rng.sample(range(payload.numel()), min(64, payload.numel()))
    for pos in positions:
        bad = payload.clone()
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(PayloadError):
            codec.decode(bad, ids)


@pytest.mark.parametrize("key", KEYS)
def test_decode_into_a_callers_tensor(key):
    codec, payload, ids = _payload(key)
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


def test_foreign_bytes_raise():
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


def test_trailing_bytes_raise():
    codec, payload, ids = _payload("none")
    with pytest.raises(PayloadError, match="trailing"):
        codec.decode(torch.cat([payload, torch.zeros(8, dtype=torch.uint8)]), ids)


def test_sections_survive_an_unaligned_payload_view():
    codec, payload, _ = _payload("none")
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
