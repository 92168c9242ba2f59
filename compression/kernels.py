"""Triton kernels of the hot loops, bit-identical to ``reference.py`` (the CUDA path).

Same functions and results as the reference: ``quantize``, ``dequantize``, ``block_pack``,
``block_unpack``. Rules that keep GPU floats equal to torch's (see the project's Triton notes):
every launch passes ``enable_fp_fusion=False`` (no FMA contraction), division is
``tl.math.div_rn`` (IEEE), rounding is half-to-even by the 2**23 trick (no libdevice), block
values never drive Python control flow, shifts stay in [0, 31], every load/store is masked.
Exclusive prefix sums of the group widths are ``torch.cumsum`` between launches.

On a CPU tensor these run only under ``TRITON_INTERPRET=1`` (set before triton is imported).
Tile sizes are constexpr so tests can use big tiles (few interpreted programs) and GPUs their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import GROUP, QMAX

QUANT_BLOCK = 1024  # values per program (quantize / dequantize)
PACK_GROUPS = 8  # groups of 32 codes per program (the pack tile is [G, 32, 32])
_LAUNCH = {"enable_fp_fusion": False}
_OUT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _round_half_even(t):
    """rint without libdevice: adding 2**23 rounds |t| < 2**23 to an integer, half to even."""
    a = tl.abs(t)
    r = (a + 8388608.0) - 8388608.0
    r = tl.where(a < 8388608.0, r, a)
    return tl.where(t < 0, -r, r)


@triton.jit
def quantize_kernel(
    x_ptr, step_ptr, ed_ptr, codes_ptr, miss_ptr, n, PER_VALUE: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr
):
    """codes = zigzag(round(x / step)) where |recon - x| < ed holds for recon in the output dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PER_VALUE:
        step = tl.load(step_ptr + offs, mask=mask, other=1.0)
        ed = tl.load(ed_ptr + offs, mask=mask, other=0.0)
    else:
        step = tl.load(step_ptr)
        ed = tl.load(ed_ptr)
    r = _round_half_even(tl.math.div_rn(x, step))
    r = tl.minimum(tl.maximum(r, -1073741823.0), 1073741823.0)  # QMAX; NaN is a miss below
    recon = r * step
    if OUT == 1:
        recon = recon.to(tl.float16).to(tl.float32)
    if OUT == 2:  # round to bfloat16 by hand: the interpreter's cast truncates
        b = recon.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        recon = b.to(tl.float32, bitcast=True)
    ok = tl.abs(recon - x) < ed
    q = tl.where(ok, r, 0.0).to(tl.int32)  # masked before the cast: no NaN/overflow conversion
    z = (q << 1) ^ (q >> 31)
    tl.store(codes_ptr + offs, z, mask=mask)
    tl.store(miss_ptr + offs, tl.where(ok, 0, 1).to(tl.int8), mask=mask)


@triton.jit
def dequantize_kernel(codes_ptr, step_ptr, out_ptr, n, PER_VALUE: tl.constexpr, BLOCK: tl.constexpr):
    """out = unzigzag(codes) * step in float32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(codes_ptr + offs, mask=mask, other=0)
    if PER_VALUE:  # noqa: SIM108  (Triton JIT code: the branch on the constexpr stays a statement)
        step = tl.load(step_ptr + offs, mask=mask, other=1.0)
    else:
        step = tl.load(step_ptr)
    q = (z >> 1) ^ (0 - (z & 1))
    tl.store(out_ptr + offs, q.to(tl.float32) * step, mask=mask)


@triton.jit
def _bit_length(m):
    """Bits of a non-negative int32 (0 for 0): a 5-step binary search (no clz off-GPU)."""
    w = tl.zeros(m.shape, dtype=tl.int32)
    t = m
    for s in tl.static_range(5):
        sh = 16 >> s
        c = (t >> sh) != 0
        w = tl.where(c, w + sh, w)
        t = tl.where(c, t >> sh, t)
    return w + (t != 0).to(tl.int32)


@triton.jit
def widths_kernel(codes_ptr, widths_ptr, n, n_groups, G: tl.constexpr):
    """Bit width of the largest code of each group of 32."""
    g = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    j = tl.arange(0, 32)
    idx = g[:, None] * 32 + j[None, :]
    z = tl.load(codes_ptr + idx, mask=idx < n, other=0)
    w = _bit_length(tl.max(z, axis=1))
    tl.store(widths_ptr + g, w.to(tl.uint8), mask=g < n_groups)


@triton.jit
def pack_kernel(codes_ptr, widths_ptr, offsets_ptr, words_ptr, n, n_groups, G: tl.constexpr):
    """Word i of group g = OR over codes j of the bits of code j that fall in [32 i, 32 i + 32)."""
    g = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    gmask = g < n_groups
    w = tl.load(widths_ptr + g, mask=gmask, other=0).to(tl.int32)
    off = tl.load(offsets_ptr + g, mask=gmask, other=0)
    i = tl.arange(0, 32)
    j = tl.arange(0, 32)
    idx = g[:, None] * 32 + j[None, :]
    z = tl.load(codes_ptr + idx, mask=idx < n, other=0).to(tl.uint32, bitcast=True)  # [G, 32 j]
    z3 = z[:, None, :]
    p = j[None, None, :] * w[:, None, None] - 32 * i[None, :, None]  # [G, 32 i, 32 j] bit position
    lo = tl.where((p >= 0) & (p < 32), z3 << tl.minimum(tl.maximum(p, 0), 31).to(tl.uint32), 0)
    hi = tl.where((p < 0) & (p > -w[:, None, None]), z3 >> tl.minimum(tl.maximum(-p, 0), 31).to(tl.uint32), 0)
    word = tl.sum(lo | hi, axis=2)  # bits are disjoint, so the sum is the OR (fast in the interpreter)
    dst = off[:, None] + i[None, :]
    tl.store(words_ptr + dst, word.to(tl.int32, bitcast=True), mask=gmask[:, None] & (i[None, :] < w[:, None]))


@triton.jit
def unpack_kernel(words_ptr, widths_ptr, offsets_ptr, codes_ptr, n, n_groups, G: tl.constexpr):
    """Code j of group g from bits [j w, j w + w) of the group's words (at most two words)."""
    g = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    gmask = g < n_groups
    w = tl.load(widths_ptr + g, mask=gmask, other=0).to(tl.int32)[:, None]
    off = tl.load(offsets_ptr + g, mask=gmask, other=0)[:, None]
    j = tl.arange(0, 32)[None, :]
    bit = j * w
    wi = bit >> 5
    s = bit & 31
    has = gmask[:, None] & (w > 0)
    lo = tl.load(words_ptr + off + wi, mask=has, other=0).to(tl.uint32, bitcast=True)
    spill = has & (s + w > 32)
    hi = tl.load(words_ptr + off + wi + 1, mask=spill, other=0).to(tl.uint32, bitcast=True)
    v = (lo >> s.to(tl.uint32)) | tl.where(spill, hi << tl.maximum(32 - s, 1).to(tl.uint32), 0)
    v = v & ((tl.full(v.shape, 1, tl.uint32) << w.to(tl.uint32)) - 1)  # w <= 31
    idx = g[:, None] * 32 + j
    tl.store(codes_ptr + idx, v.to(tl.int32, bitcast=True), mask=idx < n)


def _scalar_or_values(t: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(float32 tensor on x's device, per-value?) for a 0-d or per-value step/margin."""
    t = t.to(device=x.device, dtype=torch.float32)
    if t.dim() == 0 or t.numel() == 1:
        return t.reshape(1), False
    if t.numel() != x.numel():
        raise ValueError(f"{t.numel()} steps for {x.numel()} values")
    return t.contiguous(), True


def quantize(
    x: torch.Tensor,
    step: torch.Tensor,
    ed: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    block: int = QUANT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`reference.quantize`."""
    x = x.contiguous()
    n = x.numel()
    codes = torch.empty(n, dtype=torch.int32, device=x.device)
    miss = torch.empty(n, dtype=torch.int8, device=x.device)
    if n:
        s, per = _scalar_or_values(step, x)
        e, _ = _scalar_or_values(ed, x)
        quantize_kernel[(triton.cdiv(n, block),)](
            x, s, e, codes, miss, n, PER_VALUE=per, OUT=_OUT_CODE[out_dtype], BLOCK=block, **_LAUNCH
        )
    return codes, miss.bool()


def dequantize(codes: torch.Tensor, step: torch.Tensor, block: int = QUANT_BLOCK) -> torch.Tensor:
    """Kernel version of :func:`reference.dequantize`."""
    n = codes.numel()
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    if n:
        s, per = _scalar_or_values(step, codes)
        dequantize_kernel[(triton.cdiv(n, block),)](
            codes.contiguous(), s, out, n, PER_VALUE=per, BLOCK=block, **_LAUNCH
        )
    return out


def block_pack(v: torch.Tensor, capacity: bool = False, groups: int = PACK_GROUPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`reference.block_pack` (one host sync to size the words, none
    with ``capacity``)."""
    v = v.contiguous()
    n = v.numel()
    n_groups = -(-n // GROUP)
    widths = torch.empty(n_groups, dtype=torch.uint8, device=v.device)
    if n_groups == 0:
        return widths, torch.empty(0, dtype=torch.int32, device=v.device)
    grid = (triton.cdiv(n_groups, groups),)
    widths_kernel[grid](v, widths, n, n_groups, G=groups, **_LAUNCH)
    ends = widths.long().cumsum(0)
    offsets = ends - widths.long()
    words = torch.empty(GROUP * n_groups if capacity else int(ends[-1]), dtype=torch.int32, device=v.device)
    pack_kernel[grid](v, widths, offsets, words, n, n_groups, G=groups, **_LAUNCH)
    return widths, words


def block_unpack(widths: torch.Tensor, words: torch.Tensor, n: int, groups: int = PACK_GROUPS) -> torch.Tensor:
    """Kernel version of :func:`reference.block_unpack`."""
    codes = torch.empty(n, dtype=torch.int32, device=words.device)
    n_groups = widths.numel()
    if n_groups == 0 or n == 0:
        return codes
    offsets = widths.long().cumsum(0) - widths.long()
    grid = (triton.cdiv(n_groups, groups),)
    unpack_kernel[grid](words.contiguous(), widths.contiguous(), offsets, codes, n, n_groups, G=groups, **_LAUNCH)
    return codes


if QMAX != 1073741823:  # quantize_kernel spells the clamp as a literal
    raise ImportError("compression.kernels: QMAX changed in reference.py; update quantize_kernel")
