"""Plain-torch reference of the hot loops; ``kernels.py`` must match it bit for bit.

Quantisation: ``q = round_half_even(x / step)`` with ``step = float32(2 * eb)``; the decoder
rebuilds ``q * step`` in float32 (then casts to the output dtype), and the encoder keeps ``q``
only where that exact reconstruction satisfies ``|recon - x| < ed`` in float32, with ``ed`` the
largest float32 <= eb. Rounding is monotone, so the strict float32 test implies the true
``|recon - x| <= eb``; every other value (NaN, Inf, huge, or unlucky rounding) becomes a raw
exception with code 0. Codes are zig-zagged to non-negative int32 (|q| < 2**30).

Block packing (the cuSZp-style fixed-length stage): codes in groups of 32; group g has width
``w[g]`` = bit length of its largest code (0..31) and takes exactly ``w[g]`` 32-bit words, code
j at bits ``[j*w, j*w + w)`` of the group's bit string, least significant bit first.
"""

from __future__ import annotations

import numpy as np
import torch

QMAX = (1 << 30) - 1  # |q| <= QMAX keeps zig-zag codes below 2**31 (non-negative int32)
GROUP = 32


def float32_at_most(eb: float) -> float:
    """The largest float32 that is <= ``eb``."""
    e = np.float32(eb)
    if float(e) > eb:
        e = np.nextafter(e, np.float32(-np.inf))
    return float(e)


def step_of(eb: float) -> float:
    """Bin width ``2 * eb`` rounded to float32, the value both encoder and decoder use."""
    return float(np.float32(2.0 * eb))


def quantize(
    x: torch.Tensor, step: torch.Tensor, ed: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zig-zag codes (int32) and the miss mask of float32 ``x``; ``step``/``ed`` broadcast to it."""
    r = torch.round(x / step).clamp_(-QMAX, QMAX)  # NaN stays NaN; it is a miss below
    recon = r * step
    if out_dtype != torch.float32:  # verify what the decoder returns, after its final cast
        recon = recon.to(out_dtype).float()
    ok = (recon - x).abs_() < ed
    q = r.nan_to_num_(0.0).to(torch.int32).mul_(ok)
    return (q << 1) ^ (q >> 31), ok.logical_not_()


def dequantize(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """float32 reconstruction ``q * step`` from zig-zag codes (exceptions are patched later)."""
    if step.dim() == 0 and codes.numel() > _TABLE_MAX and codes.device.type == "cpu":  # a CPU cache trick
        top = int(codes.max())
        if top < _TABLE_MAX:  # one gather from the (same-arithmetic) table of every code's value
            return torch.index_select(
                _dequantize(torch.arange(top + 1, dtype=torch.int32, device=codes.device), step), 0, codes
            )
    return _dequantize(codes, step)


_TABLE_MAX = 4096


def _dequantize(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    q = (codes >> 1) ^ -(codes & 1)
    return q.float().mul_(step)


def bit_length(m: torch.Tensor) -> torch.Tensor:
    """Bits needed for each non-negative value below 2**31 (0 for 0), as int64."""
    return torch.frexp(m.double())[1].long()  # m = f * 2**e with f in [0.5, 1): e bits


def _layout_tables(device: torch.device) -> list[torch.Tensor]:
    """Per width (row) and code (column) of a group: word within the group (int64), shift,
    spill shift and low-part mask (int32)."""
    w = torch.arange(GROUP, dtype=torch.int64)[:, None]
    pos = torch.arange(GROUP, dtype=torch.int64)[None, :] * w
    word, shift = pos >> 5, pos & 31
    spill = (32 - shift).clamp(max=31)  # s == 0: shifting by 31 moves the code past any w-bit mask
    low_mask = torch.where(shift == 0, -1, (1 << (32 - shift)) - 1)  # undo the sign fill of >>
    low_mask = low_mask - ((low_mask >> 31) << 32)  # 2**31 - 1 stays, 2**32 - 1 wraps to -1
    return [word.to(device)] + [t.to(torch.int32).to(device) for t in (shift, spill, low_mask)]


_TABLES: dict[torch.device, list[torch.Tensor]] = {}


def _per_code(widths: torch.Tensor) -> list[torch.Tensor]:
    """[word in group (int64), shift, spill shift, low mask (int32)], each contiguous [G, 32]."""
    device = widths.device
    if device not in _TABLES:
        _TABLES[device] = _layout_tables(device)
    return [torch.index_select(t, 0, widths) for t in _TABLES[device]]


def block_pack(v: torch.Tensor, capacity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack non-negative int32 codes: (uint8 widths per group of 32, int32 words); ``capacity``:
    no host wait, the words' buffer sized for the widest groups (its first ``widths.sum()``
    words are the packed ones)."""
    n = v.numel()
    g = -(-n // GROUP)
    vp = v.to(torch.int32)
    if n != g * GROUP:
        vp = torch.cat([vp, vp.new_zeros(g * GROUP - n)])
    vp = vp.view(g, GROUP)
    w = bit_length(vp.amax(dim=1)) if g else torch.zeros(0, dtype=torch.int64, device=v.device)
    ends = w.cumsum(0)
    total = (GROUP * g if capacity else int(ends[-1])) if g else 0
    out = torch.zeros(total + 2, dtype=torch.int32, device=v.device)  # zero-width tail groups point past the end
    for at in range(0, g, _PACK_GROUPS):  # in slices: the per-code tables stay small at any size
        ws, vs = w[at : at + _PACK_GROUPS], vp[at : at + _PACK_GROUPS]
        word, shift, spill = _per_code(ws)[:3]
        index = ((ends[at : at + _PACK_GROUPS] - ws)[:, None] + word).view(-1)  # global word of each code
        # int32 arithmetic wraps: << keeps the bits that land in this word; bits are disjoint, so add == or.
        out.index_add_(0, index, (vs << shift).view(-1))
        out[1:].index_add_(0, index, (vs >> spill).view(-1))  # the part that spills into the next word
    return w.to(torch.uint8), out[:total]


_PACK_GROUPS = 1 << 13  # groups of 32 codes per slice of block_pack: tables of ~1 MiB each


def block_unpack(widths: torch.Tensor, words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`block_pack`: the first ``n`` codes as int32."""
    w = widths.long()
    if w.numel() == 0:
        return torch.zeros(0, dtype=torch.int32, device=words.device)
    word, shift, spill, low_mask = _per_code(w)
    index = ((w.cumsum(0) - w)[:, None] + word).view(-1)
    padded = torch.cat([words.to(torch.int32), words.new_zeros(2, dtype=torch.int32)])
    lo = torch.index_select(padded, 0, index).view_as(shift)
    hi = torch.index_select(padded[1:], 0, index).view_as(shift)
    mask = torch.index_select(_VALUE_MASKS.to(words.device), 0, w)[:, None]
    return ((((lo >> shift) & low_mask) | (hi << spill)) & mask).view(-1)[:n]


_VALUE_MASKS = ((1 << torch.arange(GROUP, dtype=torch.int64)) - 1).to(torch.int32)
