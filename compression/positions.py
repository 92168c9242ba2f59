"""The positions of the entries a threshold keeps, coded on the device (:mod:`.sparse`'s device
coding): the deltas between kept positions bit-packed at the width of the largest
(:data:`PACKED`), or a bitmap (:data:`BITMAP`, numpy's bytes), each one bit stream placed by
:func:`compression.ops.bits_pack` and read back by :func:`~compression.ops.bits_unpack` or
``nonzero_static``: no host synchronisation once the count and the width are known."""

from __future__ import annotations

import torch

from . import format as fmt
from . import ops

DELTAS, BITMAP, PACKED = 0, 1, 2  # the positions' codings (info[0]); DELTAS is the host's (zstd)


def delta_width(keep: torch.Tensor) -> torch.Tensor:
    """Bits of the largest delta between kept positions (the first from 0) of a flat mask, at
    least 1: the width of the bit-packed deltas, as an int64 0-d tensor on the mask's device."""
    return width_less_one(keep).long().add_(1)


def width_less_one(keep: torch.Tensor, halves: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`delta_width` less one (an int32 0-d tensor): the bit length of half the largest
    delta, as the exponent of its float64 (exact below 2**53 positions; 0 for no delta).
    ``halves``: :func:`halves_of` the mask's size, made once by a caller that codes it often."""
    if keep.numel() < 2:  # no delta but the first position's, 0
        return torch.zeros((), dtype=torch.int32, device=keep.device)
    # half of the last kept position at or before each (0 before the first): a kept one's half
    # delta is the step from its predecessor's, a dropped one's 0
    if halves is None:
        last = halves_of(keep.numel(), keep.device).mul_(keep).cummax(0).values
    else:
        last = torch.mul(halves, keep).cummax(0).values
    return torch.frexp((last[1:] - last[:-1]).max()).exponent


def halves_of(n: int, device: torch.device) -> torch.Tensor:
    """Half of each of the positions ``0 .. n-1`` (float64): :func:`width_less_one`'s constant."""
    return torch.arange(0, n / 2, 0.5, dtype=torch.float64, device=device)


def positions_mode(n: int, count: int, width: int) -> int:
    """The device coding of ``count`` positions among ``n`` with deltas of ``width`` bits: the
    bit-packed deltas when smaller than the bitmap."""
    return PACKED if (count * width + 7) // 8 < (n + 7) // 8 else BITMAP


def pack_bits(values: torch.Tensor, width: int, ramp: torch.Tensor | None = None) -> torch.Tensor:
    """Non-negative int64 values below ``2**width`` as one little-endian bit stream (uint8): the
    i-th from bit ``i * width`` on (:func:`compression.ops.bits_pack`). ``ramp``: :func:`ramp_of`
    a caller's, made once (the starts are then a view of it)."""
    n = values.numel()
    starts, _ = _starts(ramp, n, width, values.device)
    return _stream(values.reshape(-1), starts, n * width)


def unpack_bits(section: torch.Tensor, count: int, width: int, ramp: torch.Tensor | None = None) -> torch.Tensor:
    """The ``count`` int64 values of ``width`` bits that :func:`pack_bits` wrote (``ramp``: as its)."""
    words = section if section.numel() % 8 == 0 else torch.nn.functional.pad(section, (0, -section.numel() % 8))
    starts, widths = _starts(ramp, count, width, section.device)
    return ops.bits_unpack(fmt.view_as(words, torch.int64, "bit stream"), starts, widths)


def ramp_of(n: int, device: torch.device) -> torch.Tensor:
    """``0, 1, ...`` (int64) long enough for the bit starts of :data:`PACKED` positions among
    ``n`` (fewer bits than the bitmap's) and every width: the constant that :func:`pack_bits`
    and :func:`unpack_bits` take their starts and widths from, as views."""
    return torch.arange(n + 72, device=device)


def _starts(
    ramp: torch.Tensor | None, count: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bit starts of ``count`` fields of ``width`` bits and their widths (int64): views of
    ``ramp`` where it is long enough (strided; the kernels take strides), else made."""
    if ramp is not None and width >= 1 and ramp.numel() > max(count * width, width):
        return ramp[: count * width : width], ramp[width : width + 1].expand(count)
    starts = torch.arange(0, count * width, width, device=device)
    return starts, starts.new_full((count,), width)


def bitmap_bytes(idx: torch.Tensor, n: int) -> torch.Tensor:
    """The bitmap of ``n`` entries with the positions ``idx`` set, the first in a byte's high bit
    (numpy's packbits): entry k is bit ``k ^ 7`` of the little-endian stream."""
    return _stream(torch.ones_like(idx), idx.bitwise_xor(7), n)


def _stream(values: torch.Tensor, starts: torch.Tensor, bits: int) -> torch.Tensor:
    """The first ``bits`` bits (whole bytes) of ``values`` placed at their bit ``starts``."""
    return ops.bits_pack(values, starts, (bits + 63) // 64).view(torch.uint8)[: (bits + 7) // 8]


def _pack_bits_capacity(values: torch.Tensor, count: torch.Tensor, width: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits` of ``values[:count]`` at a ``width`` known on the device only (0-d
    int64 tensors): the stream's first ``bits`` bits (zero past ``count * width``), as bytes."""
    at = torch.arange(bits, device=values.device)
    which = (at // width).clamp_(max=max(values.numel() - 1, 0))  # the value each bit belongs to
    bit = values[which].bitwise_right_shift(at % width).bitwise_and_(1)
    return _bytes_of(torch.where(at < count * width, bit, 0), msb_first=False)


def _bytes_of(bits: torch.Tensor, msb_first: bool) -> torch.Tensor:
    """0/1 values, 8 to a byte (the first in the high bit with ``msb_first``: numpy's packbits)."""
    bits = torch.cat([bits.to(torch.int32), bits.new_zeros(-bits.numel() % 8, dtype=torch.int32)])
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    weights = torch.ones(8, dtype=torch.int32, device=bits.device)
    weights.bitwise_left_shift_(shifts.flip(0) if msb_first else shifts)
    return (bits.view(-1, 8) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def _bits_of(section: torch.Tensor, n: int, msb_first: bool) -> torch.Tensor:
    """The first ``n`` bits of a byte stream, as uint8 0/1 (inverse of :func:`_bytes_of`)."""
    shifts = torch.arange(8, device=section.device, dtype=torch.uint8)
    bits = section.reshape(-1, 1).bitwise_right_shift(shifts.flip(0) if msb_first else shifts).bitwise_and_(1)
    return bits.reshape(-1)[:n]


def _compact(keep: torch.Tensor, count: int) -> torch.Tensor:
    """The flat indices of the first ``count`` set entries of a mask, without ``nonzero`` (its
    output size would have to be read on the host); entries past ``count`` are dropped, missing
    ones 0."""
    return torch.nonzero_static(keep.reshape(-1), size=count, fill_value=0).view(-1)


def known_positions(
    section: torch.Tensor, n: int, count: int, mode: int, width: int, ramp: torch.Tensor | None = None
) -> torch.Tensor:
    """The flat indices of device-coded positions (``mode`` :data:`PACKED` or :data:`BITMAP`)
    whose count and width the host knows, without a host synchronisation: kept in range, so that
    a damaged payload (its check read later) decodes into wrong values, never out of bounds.
    ``ramp``: :func:`unpack_bits`'."""
    if mode == PACKED:
        return unpack_bits(section, count, width, ramp).cumsum(0).clamp_(0, max(n - 1, 0))
    return _compact(_bits_of(section, n, msb_first=True).bool(), count)
