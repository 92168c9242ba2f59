"""Triton kernels of the hot loops, bit-identical to ``reference.py`` (the CUDA path).

Same functions and results as the reference: ``quantize``, ``dequantize``, ``block_pack``,
``block_unpack``. Rules that keep GPU floats equal to torch's (see the project's Triton notes):
every launch passes ``enable_fp_fusion=False`` (no FMA contraction), division is
``tl.math.div_rn`` (IEEE), rounding is half-to-even by the 2**23 trick (no libdevice), block
values never drive Python control flow, shifts stay in [0, 31], every load/store is masked.
Exclusive prefix sums of the group widths are ``torch.cumsum`` between launches.

On a CPU tensor these run only under ``TRITON_INTERPRET=1`` (set before triton is imported).
Tile sizes are constexpr so tests can use big tiles (few interpreted programs) and GPUs their own.

Over 500 lines because every kernel of the CUDA path lives here beside the rules above, each
mirroring the function of the same name in ``reference.py``, so one file holds what must stay
bit-identical to it.
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
    q, ok = _quantized(x, step, ed, OUT)
    tl.store(codes_ptr + offs, (q << 1) ^ (q >> 31), mask=mask)
    tl.store(miss_ptr + offs, tl.where(ok, 0, 1).to(tl.int8), mask=mask)


@triton.jit
def _quantized(x, step, ed, OUT: tl.constexpr):
    """(q, ok): x's bin ``round(x / step)`` (int32; 0 where not ok) and whether its reconstruction
    ``q * step`` in the output dtype (OUT: 0 float32, 1 float16, 2 bfloat16) is within ``ed``."""
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
    return tl.where(ok, r, 0.0).to(tl.int32), ok  # masked before the cast: no NaN/overflow conversion


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


ADLER_BLOCK = 4096  # bytes per program of the Adler-32 partial sums
ADLER_VALUE, ADLER_HOLDS, ADLER_SEAL = 0, 1, 2  # what adler_finish_kernel does with the check


@triton.jit
def adler_partials_kernel(
    data_ptr, end_ptr, size, skip_at, skip_len, part_ptr, HAS_END: tl.constexpr, BLOCK: tl.constexpr
):
    """Per program (block of BLOCK bytes): A = sum(d) and C = sum(v * d) mod 65521, v the byte's
    place among the checked bytes: those before the end (``end_ptr``'s, else ``size``) outside
    [skip_at, skip_at + skip_len). Programs past the end write zeros at once."""
    pid = tl.program_id(0).to(tl.int64)
    end = tl.load(end_ptr) if HAS_END else size
    start = pid * BLOCK
    a = tl.zeros((), dtype=tl.int64)
    c = tl.zeros((), dtype=tl.int64)
    if start < end:
        i = start + tl.arange(0, BLOCK)
        keep = (i < end) & ((i < skip_at) | (i >= skip_at + skip_len))
        d = tl.load(data_ptr + i, mask=keep, other=0).to(tl.int64)
        v = tl.where(i >= skip_at + skip_len, i - skip_len, i)
        a = tl.sum(d, axis=0)
        c = tl.sum(v * d, axis=0) % 65521  # each term < 2**40: the block's sum is exact in int64
    tl.store(part_ptr + 2 * pid, a)
    tl.store(part_ptr + 2 * pid + 1, c)


@triton.jit
def _adler_check(a, c, checked):
    """The Adler-32 check of ``checked`` bytes from their summed partials: ``a`` (the bytes' sums,
    each reduced mod 65521) and ``c`` (the position-weighted sums)."""
    a = a % 65521
    lm = checked % 65521
    b = ((lm + lm * a - c % 65521) % 65521 + 65521) % 65521
    return b * 65536 + (a + 1) % 65521


@triton.jit
def adler_finish_kernel(
    part_ptr, n_parts, end_ptr, size, skip_len, check_at, data_ptr, out_ptr,
    HAS_END: tl.constexpr, MODE: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: A = 1 + sum(d), B = L + sum((L - v) d) = L + L sum(d) - sum(v d), both mod
    65521 (L checked bytes), check = B * 65536 + A; MODE says what becomes of it: stored in
    ``out`` (VALUE), compared there with the little-endian u32 at ``check_at`` (HOLDS), or written
    there (SEAL)."""
    end = tl.load(end_ptr) if HAS_END else size
    a = tl.zeros((), dtype=tl.int64)
    c = tl.zeros((), dtype=tl.int64)
    for k in range(0, n_parts, CHUNK):
        j = k + tl.arange(0, CHUNK)
        m = j < n_parts
        a += tl.sum(tl.load(part_ptr + 2 * j, mask=m, other=0), axis=0) % 65521
        c += tl.sum(tl.load(part_ptr + 2 * j + 1, mask=m, other=0), axis=0)
    check = _adler_check(a, c, end - skip_len)
    byte = tl.arange(0, 4)
    if MODE == 0:
        tl.store(out_ptr, check)
    if MODE == 1:
        stored = tl.sum(tl.load(data_ptr + check_at + byte).to(tl.int64) << (8 * byte), axis=0)
        tl.store(out_ptr, (stored == check).to(tl.int64))
    if MODE == 2:
        tl.store(data_ptr + check_at + byte, ((check >> (8 * byte)) & 255).to(tl.uint8))


def adler32(
    data: torch.Tensor,
    end: torch.Tensor | None,
    size: int,
    skip_at: int,
    skip_len: int,
    check_at: int,
    mode: int,
    block: int = ADLER_BLOCK,
) -> torch.Tensor:
    """Kernel version of :func:`reference.adler32`: two launches, the first over the whole buffer
    but with every program past the end exiting at once."""
    parts = torch.empty(2 * max(triton.cdiv(data.numel(), block), 1), dtype=torch.int64, device=data.device)
    out = torch.empty((), dtype=torch.int64, device=data.device)
    end_t = parts if end is None else end.reshape(1).to(torch.int64)  # (unread without an end)
    n = parts.numel() // 2
    has = end is not None
    adler_partials_kernel[(n,)](data, end_t, size, skip_at, skip_len, parts, HAS_END=has, BLOCK=block, **_LAUNCH)
    adler_finish_kernel[(1,)](
        parts, n, end_t, size, skip_len, check_at, data, out, HAS_END=has, MODE=mode, CHUNK=1024, **_LAUNCH
    )
    return out


FRAME_TILE = 4096  # payload bytes per program of frame_copy_kernel


@triton.jit
def _last_at_or_before(starts_ptr, n, x, STEPS: tl.constexpr):
    """Per element of ``x``: the last index b < ``n`` with ``starts[b] <= x`` (0 where none), by
    ``STEPS`` halvings of [0, n) (``starts`` ascending)."""
    lo = tl.zeros(x.shape, dtype=tl.int64)
    hi = tl.zeros(x.shape, dtype=tl.int64) + n
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = (mid < hi) & (tl.load(starts_ptr + mid, mask=mid < n, other=0) <= x)
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where(go, hi, mid)
    return tl.maximum(lo - 1, 0)


@triton.jit
def frame_layout_kernel(
    src_ptr, table_ptr, n_pieces, n_sections, head_len, align, meta_ptr, PIECES: tl.constexpr
):  # fmt: skip
    """One program: each piece's length (the host's, else its device length, an int64 stored in
    the joined source at the offset the table gives), each section's length, the payload's
    total and each piece's place; ``meta`` = [section lengths, total, piece starts, piece
    lengths]. Sections start ``align``-aligned after the header; a section's pieces are joined."""
    p = tl.arange(0, PIECES)
    m = p < n_pieces
    sec = tl.load(table_ptr + p, mask=m, other=0)
    host = tl.load(table_ptr + 2 * n_pieces + p, mask=m, other=0)
    at = tl.load(table_ptr + 3 * n_pieces + p, mask=m, other=0)  # where a device length lies in src
    byte = tl.arange(0, 8)
    dev = tl.sum(tl.load(src_ptr + at[:, None] + byte[None, :], mask=m[:, None] & (host[:, None] < 0), other=0)
                 .to(tl.int64) << (8 * byte[None, :]), axis=1)  # fmt: skip
    length = tl.where(host >= 0, host, dev)
    length = tl.where(m, length, 0)
    start = tl.zeros((), dtype=tl.int64) + head_len
    for s in range(0, n_sections):
        mine = m & (sec == s)
        inside = tl.cumsum(tl.where(mine, length, 0), axis=0) - tl.where(mine, length, 0)
        tl.store(meta_ptr + n_sections + 1 + p, start + inside, mask=mine)
        total = tl.sum(tl.where(mine, length, 0), axis=0)
        tl.store(meta_ptr + s, total)
        start += total + (align - total % align) % align
    tl.store(meta_ptr + n_sections, start)
    tl.store(meta_ptr + n_sections + 1 + n_pieces + p, length, mask=m)


@triton.jit
def frame_copy_kernel(
    table_ptr, head_at, head_len, n_patches, lengths_at, total_at, meta_ptr, n_sections, src_ptr, n_pieces,
    out_ptr, TILE: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    """Each payload byte from its source: the header (the host's bytes in the table, the device's
    patches over them, its section-length and total fields from ``meta``), else the piece whose
    place it falls in (zero past the piece: section padding). Programs past the end exit at once."""
    total = tl.load(meta_ptr + n_sections)
    o = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    if tl.program_id(0).to(tl.int64) * TILE < total:
        live = o < total
        in_head = live & (o < head_len)
        word = tl.load(table_ptr + head_at + o // 8, mask=in_head, other=0)
        hb = ((word >> (8 * (o % 8))) & 255).to(tl.uint8)
        for q in range(0, n_patches):
            p_at = tl.load(table_ptr + head_at - 3 * n_patches + q)
            p_len = tl.load(table_ptr + head_at - 2 * n_patches + q)
            p_src = tl.load(table_ptr + head_at - n_patches + q)
            mine = in_head & (o >= p_at) & (o < p_at + p_len)
            hb = tl.where(mine, tl.load(src_ptr + p_src + (o - p_at), mask=mine, other=0), hb)
        meta_b = meta_ptr.to(tl.pointer_type(tl.uint8))
        in_len = (lengths_at >= 0) & (o >= lengths_at) & (o < lengths_at + 8 * n_sections)
        in_tot = (total_at >= 0) & (o >= total_at) & (o < total_at + 8)
        hb = tl.where(in_len, tl.load(meta_b + (o - lengths_at), mask=live & in_len, other=0), hb)
        hb = tl.where(in_tot, tl.load(meta_b + 8 * n_sections + (o - total_at), mask=live & in_tot, other=0), hb)
        # body bytes: the last piece starting at or before o (binary search over the starts)
        piece = _last_at_or_before(meta_ptr + n_sections + 1, n_pieces, o, STEPS)
        at = o - tl.load(meta_ptr + n_sections + 1 + piece)
        inside = live & (o >= head_len) & (at < tl.load(meta_ptr + n_sections + 1 + n_pieces + piece))
        src = tl.load(table_ptr + n_pieces + piece) + at  # the piece's place in the joined source
        bb = tl.load(src_ptr + src, mask=inside, other=0)
        tl.store(out_ptr + o, tl.where(o < head_len, hb, bb), mask=live)


def frame(
    head: torch.Tensor, patches: list[torch.Tensor], patch_at: list[int], pieces: list[torch.Tensor],
    lengths: list[torch.Tensor], host_lengths: list[int], section_of: list[int], n_sections: int, align: int,
    lengths_at: int, total_at: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Kernel version of :func:`reference.frame`: five launches (the device lengths stacked, the
    pieces, patches and lengths joined, the host's table up, the layout, the copy), the copy's
    programs past the payload's end exit at once."""
    device = pieces[0].device if pieces else patches[0].device
    dev = torch.stack([n.reshape(()).to(torch.int64) for n in lengths]).view(torch.uint8) if lengths else None
    parts = [*pieces, *patches, *([] if dev is None else [dev])]
    src = torch.cat(parts)
    starts = [0]
    for t in parts[:-1]:
        starts.append(starts[-1] + t.numel())
    n, q = len(pieces), len(patches)
    dev_at, k = [], 0  # where each piece's device length lies in src
    for h in host_lengths:
        dev_at.append(starts[n + q] + 8 * k if h < 0 else 0)
        k += h < 0
    head_words = torch.nn.functional.pad(head, (0, -head.numel() % 8)).view(torch.int64).tolist()
    patch_table = list(patch_at) + [t.numel() for t in patches] + starts[n : n + q]
    table = section_of + starts[:n] + list(host_lengths) + dev_at + patch_table + head_words
    up = torch.tensor(table, dtype=torch.int64).to(device, non_blocking=True)
    meta = torch.empty(n_sections + 1 + 2 * n, dtype=torch.int64, device=device)
    frame_layout_kernel[(1,)](
        src, up, n, n_sections, head.numel(), align, meta, PIECES=max(triton.next_power_of_2(n), 2)
    )
    capacity = head.numel() + sum(p.numel() for p in pieces) + align * n_sections
    out = torch.empty(capacity, dtype=torch.uint8, device=device)
    frame_copy_kernel[(triton.cdiv(capacity, FRAME_TILE),)](
        up, 4 * n + 3 * q, head.numel(), q, lengths_at, total_at, meta, n_sections, src, n, out,
        TILE=FRAME_TILE, STEPS=max(n, 1).bit_length(), **_LAUNCH,
    )  # fmt: skip
    return out, meta[n_sections]


RANGE_ROWS = 64  # rows per program of the block ranges
RANGE_COLS = 128  # columns per program (blocks wider take several)


@triton.jit
def range_partials_kernel(
    x_ptr, stride, rows, table_ptr, n_blocks, part_ptr, n_row_tiles, n_col_tiles,
    ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Program (block b, row tile, column tile): the smallest and largest finite value of its part
    of block b (columns ``table[b]`` to ``table[b] + table[n_blocks + b]``), as float32 partials;
    a part with none gives +inf / -inf."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    start = tl.load(table_ptr + b)
    width = tl.load(table_ptr + n_blocks + b)
    r = (t // n_col_tiles).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = (t % n_col_tiles).to(tl.int64) * COLS + tl.arange(0, COLS)
    m = (r[:, None] < rows) & (c[None, :] < width)
    v = tl.load(x_ptr + r[:, None] * stride + start + c[None, :], mask=m, other=0.0).to(tl.float32)
    finite = m & (v == v) & (tl.abs(v) != float("inf"))
    lo = tl.min(tl.min(tl.where(finite, v, float("inf")), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(finite, v, -float("inf")), axis=1), axis=0)
    at = (b * n_row_tiles * n_col_tiles + t) * 2
    tl.store(part_ptr + at, lo)
    tl.store(part_ptr + at + 1, hi)


@triton.jit
def range_bounds_kernel(part_ptr, n_parts, rel_ptr, out_ptr, CHUNK: tl.constexpr):
    """Program b: block b's range from its partials (float32, widened to float64 before the
    subtraction; no finite value: 0) times its relative bound."""
    b = tl.program_id(0)
    lo = tl.full((), float("inf"), tl.float32)
    hi = tl.full((), -float("inf"), tl.float32)
    for k in range(0, n_parts, CHUNK):
        j = k + tl.arange(0, CHUNK)
        m = j < n_parts
        at = (b * n_parts + j) * 2
        lo = tl.minimum(lo, tl.min(tl.load(part_ptr + at, mask=m, other=float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.load(part_ptr + at + 1, mask=m, other=-float("inf")), axis=0))
    span = tl.where(hi >= lo, hi.to(tl.float64) - lo.to(tl.float64), 0.0)
    tl.store(out_ptr + b, tl.load(rel_ptr + b) * span)


def relative_bounds(x: torch.Tensor, rel: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Kernel version of :func:`reference.relative_bounds`: the host's table up, partial ranges
    per (block, tile), then one program per block."""
    nb = len(widths)
    starts = [0]
    for w in widths[:-1]:
        starts.append(starts[-1] + w)
    table = torch.tensor(starts + widths, dtype=torch.int64).to(x.device, non_blocking=True)
    row_tiles = max(triton.cdiv(x.shape[0], RANGE_ROWS), 1)
    col_tiles = max(triton.cdiv(max(widths, default=1), RANGE_COLS), 1)
    parts = torch.empty(nb * row_tiles * col_tiles * 2, dtype=torch.float32, device=x.device)
    out = torch.empty(nb, dtype=torch.float64, device=x.device)
    if nb:
        range_partials_kernel[(nb, row_tiles * col_tiles)](
            x, x.stride(0), x.shape[0], table, nb, parts, row_tiles, col_tiles, ROWS=RANGE_ROWS, COLS=RANGE_COLS,
            **_LAUNCH,
        )  # fmt: skip
        range_bounds_kernel[(nb,)](parts, row_tiles * col_tiles, rel, out, CHUNK=256, **_LAUNCH)
    return out


RUNS_CHUNK = 1024  # sorted ids per step of id_runs_kernel


@triton.jit
def id_runs_kernel(
    sorted_ptr, perm_ptr, rows, keys_ptr, key_stride0, key_stride1, n_blocks, shared,
    counts_ptr, first_ptr, inverse_ptr, acc_ptr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program b, over row b of the sorted ids (and its permutation): the runs of equal ids, in
    order: their number, each run's first row (its first in sorted order: the stable sort's
    smallest), each row's run; slots past the runs get row 0. Also b's term of the ids'
    fingerprint, added to ``acc[0]`` (wrapping int64; ``shared``: one column for every block);
    the last program to add writes its low 32 bits to ``acc[2]``."""
    b = tl.program_id(0).to(tl.int64)
    carry = tl.zeros((), dtype=tl.int64)
    term = tl.zeros((), dtype=tl.int64)
    for k in range(0, rows, CHUNK):
        i = (k + tl.arange(0, CHUNK)).to(tl.int64)
        m = i < rows
        key = tl.load(sorted_ptr + b * rows + i, mask=m, other=0)
        prev = tl.load(sorted_ptr + b * rows + tl.maximum(i - 1, 0), mask=m, other=0)
        new = m & ((i == 0) | (key != prev))
        local = carry + tl.cumsum(new.to(tl.int64), axis=0) - 1
        row = tl.load(perm_ptr + b * rows + i, mask=m, other=0)
        tl.store(inverse_ptr + b * rows + row, local, mask=m)
        tl.store(first_ptr + b * rows + local, row, mask=new)
        carry += tl.sum(new.to(tl.int64), axis=0)
        ids = tl.load(keys_ptr + i * key_stride0 + b * key_stride1, mask=m, other=0)
        term += tl.sum(ids * ((i * -7046029254386353131 + 0x2545F491) | 1), axis=0)
    for k in range(0, rows, CHUNK):  # the slots past the runs
        i = k + tl.arange(0, CHUNK)
        tl.store(first_ptr + b * rows + i, tl.zeros((CHUNK,), dtype=tl.int64), mask=(i >= carry) & (i < rows))
    tl.store(counts_ptr + b, carry)
    j = tl.arange(0, 1024)
    weight = tl.zeros((), dtype=tl.int64)
    if shared:  # one column stands for every block: its term times every block's weight
        for k in range(0, n_blocks, 1024):
            blk = (k + j).to(tl.int64)
            weight += tl.sum(tl.where(blk < n_blocks, (blk * 0x5851F42D4C957F2D + 0x14057B7EF767814F) | 1, 0), axis=0)
    else:
        weight = (b * 0x5851F42D4C957F2D + 0x14057B7EF767814F) | 1
    tl.atomic_add(acc_ptr, term * weight)
    if tl.atomic_add(acc_ptr + 1, 1) == tl.num_programs(0) - 1:  # the last: every term is in
        tl.store(acc_ptr + 2, tl.atomic_add(acc_ptr, 0) & 0xFFFFFFFF)


def id_runs(
    sorted_ids: torch.Tensor, perm: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`reference.id_runs`: the accumulator zeroed, one program per row."""
    n, rows = sorted_ids.shape
    counts = torch.empty(n, dtype=torch.int64, device=keys.device)
    first = torch.empty(n, rows, dtype=torch.int64, device=keys.device)
    inverse = torch.empty(n, rows, dtype=torch.int64, device=keys.device)
    acc = torch.zeros(3, dtype=torch.int64, device=keys.device)
    shared = n == 1 and keys.shape[1] != 1
    id_runs_kernel[(n,)](
        sorted_ids.contiguous(), perm.contiguous(), rows, keys, keys.stride(0), keys.stride(1), keys.shape[1],
        int(shared), counts, first, inverse, acc, CHUNK=RUNS_CHUNK, **_LAUNCH,
    )  # fmt: skip
    return counts, first, inverse, acc[2]


LOSSY_GROUPS = 8  # groups of 32 values per program of the lossy pack kernels (the pack tile is [G, 32, 32])


@triton.jit
def _block_steps(eb):
    """float32 bin width ``2 eb`` and margin ``ed`` (the largest float32 <= eb) of float64 bounds,
    as :func:`reference.step_of` and :func:`reference.float32_at_most` round them."""
    e = eb.to(tl.float32)
    down = (e.to(tl.float64) > eb) & (e > 0)  # rounded up: one float32 step down
    e = tl.where(down, (e.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), e)
    return (2.0 * eb).to(tl.float32), e


@triton.jit
def lossy_offsets_kernel(counts_ptr, table_ptr, bounds_ptr, n_blocks, off_ptr, step_ptr, ed_ptr, CHUNK: tl.constexpr):
    """One program: each block's first value in the flat order (the unique rows' values block
    after block, ``off[n_blocks]`` their number), and its float32 bin width ``2 eb`` and margin
    ``ed`` (the largest float32 <= eb), as the reference rounds them."""
    carry = tl.zeros((), dtype=tl.int64)
    for k in range(0, n_blocks, CHUNK):
        b = k + tl.arange(0, CHUNK)
        m = b < n_blocks
        size = tl.load(counts_ptr + b, mask=m, other=0) * tl.load(table_ptr + n_blocks + b, mask=m, other=0)
        tl.store(off_ptr + b, carry + tl.cumsum(size, axis=0) - size, mask=m)
        carry += tl.sum(size, axis=0)
        step, ed = _block_steps(tl.load(bounds_ptr + b, mask=m, other=0.0))
        tl.store(step_ptr + b, step, mask=m)
        tl.store(ed_ptr + b, ed, mask=m)
    tl.store(off_ptr + n_blocks, carry)


@triton.jit
def block_steps_kernel(bounds_ptr, n_blocks, step_ptr, ed_ptr, CHUNK: tl.constexpr):
    """One program: every block's float32 bin width and margin (:func:`_block_steps`)."""
    for k in range(0, n_blocks, CHUNK):
        b = k + tl.arange(0, CHUNK)
        m = b < n_blocks
        step, ed = _block_steps(tl.load(bounds_ptr + b, mask=m, other=0.0))
        tl.store(step_ptr + b, step, mask=m)
        tl.store(ed_ptr + b, ed, mask=m)


@triton.jit
def roundtrip_kernel(
    x_ptr, x_stride, out_ptr, out_stride, rows, cols, table_ptr, n_blocks, step_ptr, ed_ptr,
    ROWS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    """Program (row tile, column tile): each float32 value quantised under its block's step and
    margin and rebuilt (``q * step``), or kept where that misses (:func:`reference.lossy_roundtrip`)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
    b = _last_at_or_before(table_ptr, n_blocks, c, STEPS)  # the block of a column: the last b with start[b] <= c
    m = (r[:, None] < rows) & (c[None, :] < cols)
    v = tl.load(x_ptr + r[:, None] * x_stride + c[None, :], mask=m, other=0.0)
    step = tl.load(step_ptr + b, mask=c < cols, other=1.0)[None, :]
    q, ok = _quantized(v, step, tl.load(ed_ptr + b, mask=c < cols, other=0.0)[None, :], 0)
    tl.store(out_ptr + r[:, None] * out_stride + c[None, :], tl.where(ok, q.to(tl.float32) * step, v), mask=m)


@triton.jit
def _lossy_values(
    pid, x_ptr, x_stride, rows_ptr, rows, table_ptr, n_blocks, off_ptr, step_ptr, ed_ptr,
    G: tl.constexpr, STEPS: tl.constexpr, IDENTITY: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    """The ``G`` groups of 32 flat values of program ``pid``: (their flat positions [G, 32], live
    (before the end), the zig-zag codes (0 for a miss or past the end), misses, raw values)."""
    p = (pid.to(tl.int64) * G + tl.arange(0, G)[:, None]) * 32 + tl.arange(0, 32)[None, :]
    n = tl.load(off_ptr + n_blocks)
    live = p < n
    b = _last_at_or_before(off_ptr, n_blocks, p, STEPS)  # the block: the last b with off[b] <= p
    w = tl.maximum(tl.load(table_ptr + n_blocks + b), 1)
    at = p - tl.load(off_ptr + b)
    u = at // w
    col = tl.load(table_ptr + b) + at - u * w
    if IDENTITY:  # noqa: SIM108  (Triton JIT code: the branch on the constexpr stays a statement)
        row = u
    else:
        row = tl.load(rows_ptr + b * rows + u, mask=live, other=0)
    raw = tl.load(x_ptr + row * x_stride + col, mask=live)
    v = raw.to(tl.float32)
    q, ok = _quantized(v, tl.load(step_ptr + b), tl.load(ed_ptr + b), OUT)
    q = tl.where(live, q, 0)
    z = ((q << 1) ^ (q >> 31)).to(tl.uint32, bitcast=True)
    return p, live, z, live & ~ok, raw


@triton.jit
def lossy_groups_kernel(
    x_ptr, x_stride, rows_ptr, rows, table_ptr, n_blocks, off_ptr, step_ptr, ed_ptr, n_groups, widths_ptr, scan_ptr,
    G: tl.constexpr, STEPS: tl.constexpr, IDENTITY: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    """Each group's bit width (u8, 0 past the end) and its misses: ``scan[0]`` and ``scan[1]``."""
    pid = tl.program_id(0)
    _, _, z, miss, _ = _lossy_values(
        pid, x_ptr, x_stride, rows_ptr, rows, table_ptr, n_blocks, off_ptr, step_ptr, ed_ptr, G, STEPS, IDENTITY, OUT
    )
    g = pid.to(tl.int64) * G + tl.arange(0, G)
    width = _bit_length(tl.max(z, axis=1).to(tl.int32, bitcast=True))
    gm = g < n_groups
    tl.store(widths_ptr + g, width.to(tl.uint8), mask=gm)
    tl.store(scan_ptr + g, width, mask=gm)
    tl.store(scan_ptr + n_groups + g, tl.sum(miss.to(tl.int32), axis=1), mask=gm)
    if pid == 0:  # the 4 bytes past the groups: zeros (the section's padding to 4)
        tl.store(widths_ptr + n_groups + tl.arange(0, 4), tl.zeros((4,), dtype=tl.uint8))


@triton.jit
def lossy_pack_kernel(
    x_ptr, x_stride, rows_ptr, rows, table_ptr, n_blocks, off_ptr, step_ptr, ed_ptr, n_groups, widths_ptr, ends_ptr,
    words_ptr, pos_ptr, raw_ptr, lengths_ptr, item,
    G: tl.constexpr, STEPS: tl.constexpr, IDENTITY: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    """Each group's codes packed at its words' place (word i of group g = the bits of its codes in
    [32 i, 32 i + 32)), each miss's flat position and raw value at its place among the
    exceptions; program 0 writes the lengths (bytes of the widths padded to 4, of the words, of
    the positions, of the values)."""
    pid = tl.program_id(0)
    p, _, z, miss, raw = _lossy_values(
        pid, x_ptr, x_stride, rows_ptr, rows, table_ptr, n_blocks, off_ptr, step_ptr, ed_ptr, G, STEPS, IDENTITY, OUT
    )
    g = pid.to(tl.int64) * G + tl.arange(0, G)
    gm = g < n_groups
    w = tl.load(widths_ptr + g, mask=gm, other=0).to(tl.int32)
    w_end = tl.load(ends_ptr + g, mask=gm, other=0)
    m_end = tl.load(ends_ptr + n_groups + g, mask=gm, other=0)
    i = tl.arange(0, 32)
    j = tl.arange(0, 32)
    z3 = z[:, None, :]
    bit = j[None, None, :] * w[:, None, None] - 32 * i[None, :, None]  # [G, word i, code j]
    lo_part = tl.where((bit >= 0) & (bit < 32), z3 << tl.minimum(tl.maximum(bit, 0), 31).to(tl.uint32), 0)
    hi_part = tl.where(
        (bit < 0) & (bit > -w[:, None, None]), z3 >> tl.minimum(tl.maximum(-bit, 0), 31).to(tl.uint32), 0
    )
    word = tl.sum(lo_part | hi_part, axis=2)  # bits are disjoint: the sum is the or
    dst = (w_end - w)[:, None] + i[None, :]
    tl.store(words_ptr + dst, word.to(tl.int32, bitcast=True), mask=gm[:, None] & (i[None, :] < w[:, None]))
    slot = (m_end - tl.sum(miss.to(tl.int64), axis=1))[:, None] + tl.cumsum(miss.to(tl.int64), axis=1) - 1
    tl.store(pos_ptr + slot, p.to(tl.int32), mask=miss)
    tl.store(raw_ptr + slot, raw, mask=miss)
    if pid == 0:
        n = tl.load(off_ptr + n_blocks)
        used = (n + 31) // 32
        k = tl.load(ends_ptr + 2 * n_groups - 1)
        tl.store(lengths_ptr, used + (4 - used % 4) % 4)
        tl.store(lengths_ptr + 1, 4 * tl.load(ends_ptr + n_groups - 1))
        tl.store(lengths_ptr + 2, 4 * k)
        tl.store(lengths_ptr + 3, item * k)


def _table(widths: list[int], extra: list[int], device: torch.device) -> torch.Tensor:
    """Column start and width of every block (then ``extra``), as one int64 tensor up."""
    starts = [0]
    for w in widths[:-1]:
        starts.append(starts[-1] + w)
    return torch.tensor(starts + list(widths) + extra, dtype=torch.int64).to(device, non_blocking=True)


def lossy_pack(
    x: torch.Tensor, src: torch.Tensor, counts: torch.Tensor, bounds: torch.Tensor, widths: list[int], summed: bool,
    groups: int = LOSSY_GROUPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Kernel version of :func:`reference.lossy_pack`: the block table up, the offsets and steps,
    each group's width and misses, their scan, the packing (``summed``: the rows first summed by
    id with an atomic scatter, whose order a device does not fix)."""
    rows = x.shape[0]
    nb, n_cap = len(widths), x.numel()
    n_groups = max(-(-n_cap // 32), 1)
    device = x.device
    table = _table(widths, [], device)
    off = torch.empty(nb + 1, dtype=torch.int64, device=device)
    step = torch.empty(max(nb, 1), dtype=torch.float32, device=device)
    ed = torch.empty(max(nb, 1), dtype=torch.float32, device=device)
    lossy_offsets_kernel[(1,)](counts, table, bounds, nb, off, step, ed, CHUNK=1024, **_LAUNCH)
    if summed:  # slot u of a block: the sum of the rows whose id is its u-th
        block_of = torch.tensor([b for b, w in enumerate(widths) for _ in range(w)]).to(device, non_blocking=True)
        x = torch.zeros_like(x).scatter_add_(0, src.index_select(0, block_of).t(), x)
    widths_out = torch.empty(n_groups + 4, dtype=torch.uint8, device=device)  # (the groups kernel zeroes the tail)
    scan = torch.empty(2, n_groups, dtype=torch.int32, device=device)
    words = torch.empty(32 * n_groups, dtype=torch.int32, device=device)
    positions = torch.empty(max(n_cap, 1), dtype=torch.int32, device=device)
    raw = torch.empty(max(n_cap, 1), dtype=x.dtype, device=device)
    lengths = torch.empty(4, dtype=torch.int64, device=device)
    grid = (triton.cdiv(n_groups, groups),)
    args = (x, x.stride(0), src, rows, table, nb, off, step, ed, n_groups, widths_out)
    meta = {"G": groups, "STEPS": max(nb, 1).bit_length(), "IDENTITY": summed, "OUT": _OUT_CODE[x.dtype]}
    lossy_groups_kernel[grid](*args, scan, **meta, **_LAUNCH)
    ends = scan.cumsum(1, dtype=torch.int64)
    lossy_pack_kernel[grid](*args, ends, words, positions, raw, lengths, x.element_size(), **meta, **_LAUNCH)
    return widths_out, words, positions, raw, lengths


TRIP_ROWS = 32  # rows per program of roundtrip_kernel
TRIP_COLS = 128  # columns per program


def lossy_roundtrip(
    x: torch.Tensor, bounds: torch.Tensor, widths: list[int], rows_tile: int = TRIP_ROWS, cols_tile: int = TRIP_COLS
) -> torch.Tensor:
    """Kernel version of :func:`reference.lossy_roundtrip`: the block table up, the blocks' steps,
    then every value in one pass (float32)."""
    if x.dtype != torch.float32:
        raise TypeError(f"lossy_roundtrip: float32 values, got {x.dtype}")
    x = x.contiguous()
    rows, cols = x.shape
    nb = len(widths)
    out = torch.empty_like(x)
    step = torch.empty(max(nb, 1), dtype=torch.float32, device=x.device)
    ed = torch.empty(max(nb, 1), dtype=torch.float32, device=x.device)
    table = _table(widths, [], x.device)
    block_steps_kernel[(1,)](bounds, nb, step, ed, CHUNK=1024, **_LAUNCH)
    if rows and cols:
        grid = (triton.cdiv(rows, rows_tile), triton.cdiv(cols, cols_tile))
        roundtrip_kernel[grid](
            x, x.stride(0), out, out.stride(0), rows, cols, table, nb, step, ed,
            ROWS=rows_tile, COLS=cols_tile, STEPS=max(nb, 1).bit_length(), **_LAUNCH,
        )  # fmt: skip
    return out


ROWS_TILE = 32  # output rows per program of lossy_rows_kernel
COLS_TILE = 128  # output columns per program


@triton.jit
def lossy_unpack_kernel(
    widths_ptr, ends_ptr, n_groups, words_ptr, n_words, table_ptr, n_blocks, n, vals_ptr,
    G: tl.constexpr, STEPS: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    """Each flat value from its group's words, dequantised with its block's step (float32, then
    the output dtype's bits). Widths that disagree with the words (an encoder bug or a forged
    check) decode as zero-width groups: nothing is read past the words."""
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * G + tl.arange(0, G)
    gm = g < n_groups
    trusted = tl.load(ends_ptr + n_groups - 1) == n_words
    raw_w = tl.load(widths_ptr + g, mask=gm, other=0).to(tl.int64)
    w = tl.where(trusted, tl.minimum(raw_w, 31), 0).to(tl.int32)[:, None]
    off = (tl.load(ends_ptr + g, mask=gm, other=0) - raw_w)[:, None]
    j = tl.arange(0, 32)[None, :]
    bit = j * w
    wi = bit >> 5
    sh = bit & 31
    has = gm[:, None] & (w > 0)
    lo = tl.load(words_ptr + off + wi, mask=has & (off + wi < n_words), other=0).to(tl.uint32, bitcast=True)
    spill = has & (sh + w > 32)
    hi = tl.load(words_ptr + off + wi + 1, mask=spill & (off + wi + 1 < n_words), other=0).to(tl.uint32, bitcast=True)
    v = (lo >> sh.to(tl.uint32)) | tl.where(spill, hi << tl.maximum(32 - sh, 1).to(tl.uint32), 0)
    v = v & ((tl.full(v.shape, 1, tl.uint32) << w.to(tl.uint32)) - 1)  # w <= 31
    z = v.to(tl.int32, bitcast=True)
    q = (z >> 1) ^ (0 - (z & 1))
    p = g[:, None] * 32 + j
    live = p < n
    b = _last_at_or_before(table_ptr + 2 * n_blocks, n_blocks, p, STEPS)  # the block: the last b with off[b] <= p
    step = tl.load(table_ptr + 3 * n_blocks + 1 + b).to(tl.int32).to(tl.float32, bitcast=True)
    val = q.to(tl.float32) * step
    if OUT == 0:
        tl.store(vals_ptr + p, val.to(tl.int32, bitcast=True), mask=live)
    if OUT == 1:
        tl.store(vals_ptr + p, val.to(tl.float16).to(tl.int16, bitcast=True), mask=live)
    if OUT == 2:  # round to bfloat16 by hand: the interpreter's cast truncates
        bits = val.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(vals_ptr + p, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=live)


@triton.jit
def lossy_exceptions_kernel(pos_ptr, raw_ptr, k, n, vals_ptr, BLOCK: tl.constexpr):
    """The exceptions' bits over their values (positions kept inside the values)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < k
    at = tl.minimum(tl.maximum(tl.load(pos_ptr + i, mask=m, other=0).to(tl.int64), 0), n - 1)
    tl.store(vals_ptr + at, tl.load(raw_ptr + i, mask=m, other=0), mask=m)


@triton.jit
def lossy_rows_kernel(
    vals_ptr, table_ptr, n_blocks, rows, cols, inv_ptr, first_ptr, out_ptr, out_s0, out_s1,
    ROWS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr, INVERSE: tl.constexpr, FIRST: tl.constexpr,
):  # fmt: skip
    """Each output value: its column's block, its row's unique row there (``inverse``; else the
    row itself), that value; with ``first``, zero unless the row is its id's first."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)[None, :]
    m = (r < rows) & (c < cols)
    b = _last_at_or_before(table_ptr, n_blocks, c, STEPS)  # the block: the last b with start[b] <= c
    w = tl.load(table_ptr + n_blocks + b)
    if INVERSE:  # noqa: SIM108  (Triton JIT code: the branch on the constexpr stays a statement)
        u = tl.load(inv_ptr + b * rows + r, mask=m, other=0)
    else:
        u = r + tl.zeros(c.shape, dtype=tl.int64)
    at = tl.load(table_ptr + 2 * n_blocks + b) + u * w + c - tl.load(table_ptr + b)
    val = tl.load(vals_ptr + at, mask=m, other=0)
    if FIRST:
        keep = tl.load(first_ptr + b * rows + u, mask=m, other=0) == r
        val = tl.where(keep, val, 0)
    tl.store(out_ptr + r * out_s0 + c * out_s1, val, mask=m)


_BITS = {4: torch.int32, 2: torch.int16}


def lossy_unpack(
    group_widths: torch.Tensor, words: torch.Tensor, positions: torch.Tensor, raw: torch.Tensor, counts: list[int],
    bounds: list[float], widths: list[int], inverse: torch.Tensor | None, first: torch.Tensor | None,
    out: torch.Tensor, groups: int = LOSSY_GROUPS,
) -> None:  # fmt: skip
    """Kernel version of :func:`reference.lossy_unpack`: the host's table up, the word offsets,
    the values unpacked and dequantised, the exceptions, the rows."""
    from .reference import step_of

    device, nb = out.device, len(widths)
    rows, cols = out.shape
    offsets, n = [], 0
    for u, w in zip(counts, widths, strict=True):
        offsets.append(n)
        n += u * w
    steps = torch.tensor([step_of(eb) for eb in bounds], dtype=torch.float32).view(torch.int32).tolist()
    table = _table(widths, [*offsets, n, *steps], device)  # starts, widths, offsets, n, step bits
    if rows == 0 or cols == 0:
        return
    bits = _BITS[out.element_size()]
    vals = torch.empty(max(n, 1), dtype=bits, device=device)
    n_groups = group_widths.numel()
    if n_groups:
        ends = group_widths.cumsum(0, dtype=torch.int64)
        lossy_unpack_kernel[(triton.cdiv(n_groups, groups),)](
            group_widths, ends, n_groups, words, words.numel(), table, nb, n, vals,
            G=groups, STEPS=max(nb, 1).bit_length(), OUT=_OUT_CODE[out.dtype], **_LAUNCH,
        )  # fmt: skip
    k = positions.numel()
    if k:
        lossy_exceptions_kernel[(triton.cdiv(k, 1024),)](positions, raw.view(bits), k, n, vals, BLOCK=1024, **_LAUNCH)
    rows_inv = inverse if inverse is not None else table
    rows_first = first if first is not None else table
    lossy_rows_kernel[(triton.cdiv(rows, ROWS_TILE), triton.cdiv(cols, COLS_TILE))](
        vals, table, nb, rows, cols, rows_inv, rows_first, out.view(bits), out.stride(0), out.stride(1),
        ROWS=ROWS_TILE, COLS=COLS_TILE, STEPS=max(nb, 1).bit_length(), INVERSE=inverse is not None,
        FIRST=first is not None, **_LAUNCH,
    )  # fmt: skip


CAST_BLOCK = 4096  # values per program of the cast kernels


@triton.jit
def _byte_sums(bits, at, live, ITEM: tl.constexpr):
    """Adler's partial sums (sum d, sum v d) of the ``ITEM`` little-endian bytes of each of ``bits``
    (int32) lying at bytes ``at`` of a payload, the check field (bytes 20-23) skipped: v = at - 4."""
    a = tl.zeros((), dtype=tl.int64)
    c = tl.zeros((), dtype=tl.int64)
    for k in tl.static_range(ITEM):
        d = tl.where(live, (bits >> (8 * k)) & 255, 0).to(tl.int64)
        a += tl.sum(d, axis=0)
        c += tl.sum(d * (at + k - 4), axis=0)
    return a, c


@triton.jit
def _head_sums(src_ptr, h, total, out_ptr, copy: tl.constexpr, CHUNK: tl.constexpr):
    """The header's and the padding's partial sums (bytes [0, h) and [end of values, total) are
    the last program's); ``copy``: also writes the header and zero padding to ``out``."""
    a = tl.zeros((), dtype=tl.int64)
    c = tl.zeros((), dtype=tl.int64)
    for k in range(0, h, CHUNK):
        j = (k + tl.arange(0, CHUNK)).to(tl.int64)
        m = j < h
        d = tl.load(src_ptr + j, mask=m, other=0)
        if copy:
            tl.store(out_ptr + j, d, mask=m)
        d = tl.where(m & ((j < 20) | (j >= 24)), d, 0).to(tl.int64)
        a += tl.sum(d, axis=0)
        c += tl.sum(d * tl.where(j >= 24, j - 4, j), axis=0)
    return a, c


@triton.jit
def _head_written(head_ptr, h, n, total, out_ptr, ITEM: tl.constexpr):
    """A pack's last program: the header and the zero padding after the ``n`` values written to
    ``out``, their partial sums."""
    a, c = _head_sums(head_ptr, h, total, out_ptr, True, 1024)
    p = h + n * ITEM + tl.arange(0, 8)
    tl.store(out_ptr + p, tl.zeros((8,), dtype=tl.uint8), mask=p < total)
    return a, c


@triton.jit
def _head_checked(pay_ptr, h, n, total, head_ptr, verdict_ptr, ITEM: tl.constexpr):
    """An unpack's last program: the header's and padding's partial sums, and whether the header
    is the expected one ``head`` but its check (``verdict[1]``)."""
    a, c = _head_sums(pay_ptr, h, total, pay_ptr, False, 1024)
    p = h + n * ITEM + tl.arange(0, 8)  # the padding after the values: checked bytes too
    d = tl.load(pay_ptr + p, mask=p < total, other=0).to(tl.int64)
    a += tl.sum(d, axis=0)
    c += tl.sum(d * (p - 4), axis=0)
    wrong = tl.zeros((), dtype=tl.int64)
    for k in range(0, h, 1024):
        j = (k + tl.arange(0, 1024)).to(tl.int64)
        m = (j < h) & ((j < 20) | (j >= 24))
        got = tl.load(pay_ptr + j, mask=m, other=0)
        want = tl.load(head_ptr + j, mask=m, other=0)
        wrong += tl.sum((got != want).to(tl.int64), axis=0)
    tl.store(verdict_ptr + 1, (wrong == 0).to(tl.int64))
    return a, c


@triton.jit
def _cast_program():
    """A cast kernel's program, its last one (the header's) and zero partial sums (a, c)."""
    pid = tl.program_id(0)
    return pid, tl.num_programs(0) - 1, tl.zeros((), dtype=tl.int64), tl.zeros((), dtype=tl.int64)


@triton.jit
def cast_pack_kernel(
    x_ptr, n, head_ptr, h, total, out_ptr, part_ptr,
    ITEM: tl.constexpr, WIRE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Programs 0..: a tile of values cast to the wire dtype at their place after the header, and
    the Adler partial sums of their bytes; the last: the header, the zero padding, their sums."""
    pid, last, a, c = _cast_program()
    if pid < last:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        v = tl.load(x_ptr + i, mask=live, other=0)
        if WIRE == 0:
            if ITEM == 4:  # noqa: SIM108  (Triton JIT code: the branch on the constexpr stays a statement)
                bits = v.to(tl.int32, bitcast=True)
            else:
                bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        if WIRE == 1:
            bits = v.to(tl.float32).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        if WIRE == 2:  # round to bfloat16 by hand (the interpreter's cast truncates); NaN: the quiet one
            u = v.to(tl.float32).to(tl.uint32, bitcast=True)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
            bits = tl.where(v != v, 0x7FC0, r)
        if ITEM == 4:
            tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + h // 4 + i, bits, mask=live)
        else:
            tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + h // 2 + i, bits.to(tl.int16), mask=live)
        a, c = _byte_sums(bits, h + i * ITEM, live, ITEM)
    else:
        a, c = _head_written(head_ptr, h, n, total, out_ptr, ITEM)
    tl.store(part_ptr + 2 * pid, a)
    tl.store(part_ptr + 2 * pid + 1, c % 65521)


@triton.jit
def cast_unpack_kernel(
    pay_ptr, n, h, total, head_ptr, out_ptr, s0, s1, cols, part_ptr, verdict_ptr,
    ITEM: tl.constexpr, WIRE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Programs 0..: a tile of wire values to the output (float32 from fp16/bf16, else the bits as
    they are) and their bytes' Adler partial sums; the last: the header's and padding's sums and
    whether the header is the expected one (``verdict[1]``)."""
    pid, last, a, c = _cast_program()
    if pid < last:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        if ITEM == 4:
            bits = tl.load(pay_ptr.to(tl.pointer_type(tl.int32)) + h // 4 + i, mask=live, other=0)
        else:
            bits = tl.load(pay_ptr.to(tl.pointer_type(tl.int16)) + h // 2 + i, mask=live, other=0).to(tl.int32) & 0xFFFF
        a, c = _byte_sums(bits, h + i * ITEM, live, ITEM)
        dst = out_ptr + (i // cols) * s0 + (i % cols) * s1
        if WIRE == 0:
            if ITEM == 4:
                tl.store(dst.to(tl.pointer_type(tl.int32)), bits, mask=live)
            else:
                tl.store(dst.to(tl.pointer_type(tl.int16)), bits.to(tl.int16), mask=live)
        if WIRE == 1:
            tl.store(dst, bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32), mask=live)
        if WIRE == 2:
            tl.store(dst, (bits << 16).to(tl.float32, bitcast=True), mask=live)
    else:
        a, c = _head_checked(pay_ptr, h, n, total, head_ptr, verdict_ptr, ITEM)
    tl.store(part_ptr + 2 * pid, a)
    tl.store(part_ptr + 2 * pid + 1, c % 65521)


def _cast_payload(x: torch.Tensor, head: torch.Tensor, wire: int) -> tuple[int, int, int, torch.Tensor]:
    """A cast pack's wire item size, header length, payload length (8-aligned) and its buffer."""
    from .reference import WIRE_DTYPES

    item = (WIRE_DTYPES[wire] or x.dtype).itemsize
    h = head.numel()
    total = h + x.numel() * item
    total += -total % 8
    return item, h, total, torch.empty(total, dtype=torch.uint8, device=x.device)


def _cast_verdict(out: torch.Tensor, wire: int, programs: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A cast unpack's wire item size, its ``programs``' partial sums and its verdict, on the device."""
    from .reference import WIRE_DTYPES

    item = (WIRE_DTYPES[wire] or out.dtype).itemsize
    parts = torch.empty(2 * programs, dtype=torch.int64, device=out.device)
    return item, parts, torch.empty(2, dtype=torch.int64, device=out.device)


def cast_pack(x: torch.Tensor, head: torch.Tensor, wire: int, block: int = CAST_BLOCK) -> torch.Tensor:
    """Kernel version of :func:`reference.cast_pack`: the values cast, framed and summed by one
    kernel, the check finished by a second."""
    item, h, total, out = _cast_payload(x, head, wire)
    n = x.numel()
    programs = triton.cdiv(n, block) + 1
    parts = torch.empty(2 * programs, dtype=torch.int64, device=x.device)
    cast_pack_kernel[(programs,)](
        x.contiguous(), n, head, h, total, out, parts, ITEM=item, WIRE=wire, BLOCK=block, **_LAUNCH
    )
    adler_finish_kernel[(1,)](
        parts, programs, parts, total, 4, 20, out, parts, HAS_END=False, MODE=ADLER_SEAL, CHUNK=1024, **_LAUNCH
    )
    return out


def cast_unpack(
    payload: torch.Tensor, head: torch.Tensor, wire: int, out: torch.Tensor, block: int = CAST_BLOCK
) -> torch.Tensor:
    """Kernel version of :func:`reference.cast_unpack`: values, sums and the header's verdict in
    one kernel, the check's verdict in a second."""
    n, h = out.numel(), head.numel()
    programs = triton.cdiv(n, block) + 1
    item, parts, verdict = _cast_verdict(out, wire, programs)
    cast_unpack_kernel[(programs,)](
        payload, n, h, payload.numel(), head, out, out.stride(0), out.stride(1), max(out.shape[1], 1), parts, verdict,
        ITEM=item, WIRE=wire, BLOCK=block, **_LAUNCH,
    )  # fmt: skip
    adler_finish_kernel[(1,)](
        parts, programs, parts, payload.numel(), 4, 20, payload, verdict,
        HAS_END=False, MODE=ADLER_HOLDS, CHUNK=1024, **_LAUNCH,
    )  # fmt: skip
    return verdict


SUM_SEGS = 32  # sorted positions of one block per program of the casts' kernels with ids
SUM_COLS = 64  # columns per step


@triton.jit
def _id_runs(sorted_ptr, k_s0, k_s1, b, s, rows, steps):
    """Of sorted positions ``s`` of block b's stably sorted ids: whether each starts a run of equal
    ids, and the run's length there (0 elsewhere), by a binary search of ``steps`` halvings."""
    live = s < rows
    base = sorted_ptr + b * k_s1
    key = tl.load(base + s * k_s0, mask=live, other=0)
    prev = tl.load(base + (s - 1) * k_s0, mask=live & (s > 0), other=0)
    new = live & ((s == 0) | (key != prev))
    lo = s + 1  # the run's end: the first position past s whose id is larger
    hi = tl.zeros_like(s) + rows
    for _ in range(0, steps):
        go = new & (lo < hi)
        mid = (lo + hi) // 2
        le = tl.load(base + mid * k_s0, mask=go, other=0) <= key
        lo = tl.where(go & le, mid + 1, lo)
        hi = tl.where(go & ~le, mid, hi)
    return new, tl.where(new, lo - s, 0)


@triton.jit
def _load_f32(x_ptr, i, m, SRC: tl.constexpr):
    """x's values at ``i`` as float32 (exactly): float32, or the bits of float16/bfloat16."""
    if SRC == 0:
        v = tl.load(x_ptr + i, mask=m, other=0.0)
    else:
        bits = tl.load(x_ptr.to(tl.pointer_type(tl.int16)) + i, mask=m, other=0).to(tl.int32) & 0xFFFF
        if SRC == 1:
            v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            v = (bits << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _bits_of(v, TO: tl.constexpr):
    """The bits (int32; the low 16 of a 16-bit dtype) of float32 ``v`` rounded to nearest even into
    float32 (0), float16 (1) or bfloat16 (2, by hand: the interpreter's cast truncates; NaN: the
    quiet one)."""
    if TO == 0:
        bits = v.to(tl.int32, bitcast=True)
    if TO == 1:
        bits = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    if TO == 2:
        u = v.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
        bits = tl.where(v != v, 0x7FC0, r)
    return bits


@triton.jit
def _tile_byte_sums(bits, at, live, ITEM: tl.constexpr):
    """:func:`_byte_sums` of a 2-D tile: (sum d, sum v d mod 65521) of its live values' bytes."""
    a = tl.zeros((), dtype=tl.int64)
    c = tl.zeros((), dtype=tl.int64)
    for k in tl.static_range(ITEM):
        d = tl.where(live, (bits >> (8 * k)) & 255, 0).to(tl.int64)
        a += tl.sum(tl.sum(d, axis=1), axis=0)
        c += tl.sum(tl.sum(d * (at + k - 4), axis=1), axis=0) % 65521
    return a, c


@triton.jit
def _finish_last(part_ptr, n_parts, count_ptr, size, data_ptr, out_ptr, MODE: tl.constexpr, CHUNK: tl.constexpr):
    """:func:`adler_finish_kernel` (no end, the check at bytes 20-23), done by the launch's last
    program to store its partial sums: each adds one to ``count`` (zero before the launch) after
    its stores, and the one that brings it to ``n_parts`` reads every partial (atomically: none
    stale), finishes the check and resets ``count`` to zero for the next launch. No second launch."""
    if tl.atomic_add(count_ptr, 1) == n_parts - 1:  # every program's partial sums are in
        a = tl.zeros((), dtype=tl.int64)
        c = tl.zeros((), dtype=tl.int64)
        for k in range(0, n_parts, CHUNK):
            j = k + tl.arange(0, CHUNK)
            m = j < n_parts
            a += tl.sum(tl.where(m, tl.atomic_add(part_ptr + 2 * j, 0, mask=m), 0), axis=0) % 65521
            c += tl.sum(tl.where(m, tl.atomic_add(part_ptr + 2 * j + 1, 0, mask=m), 0), axis=0)
        check = _adler_check(a, c, size - 4)
        byte = tl.arange(0, 4)
        if MODE == 1:
            stored = tl.sum(tl.load(data_ptr + 20 + byte).to(tl.int64) << (8 * byte), axis=0)
            tl.store(out_ptr, (stored == check).to(tl.int64))
        if MODE == 2:
            tl.store(data_ptr + 20 + byte, ((check >> (8 * byte)) & 255).to(tl.uint8))
        tl.atomic_xchg(count_ptr, 0)


@triton.jit
def _block_segs(pid, rows, SEGS: tl.constexpr):
    """Program ``pid``'s block and its ``SEGS`` sorted positions there (``tl.cdiv(rows, SEGS)``
    programs a block)."""
    tiles = tl.cdiv(rows, SEGS)
    return pid // tiles, (pid % tiles).to(tl.int64) * SEGS + tl.arange(0, SEGS)


@triton.jit
def cast_sum_pack_kernel(
    x_ptr, rows, cols, n, sorted_ptr, perm_ptr, k_s0, k_s1, table_ptr, n_blocks, steps, head_ptr, h, total, out_ptr,
    part_ptr, count_ptr, SRC: tl.constexpr, TO: tl.constexpr, ITEM: tl.constexpr, SEGS: tl.constexpr,
    COLS: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """Programs 0..: ``SEGS`` sorted positions of one block; each that starts a run of equal ids
    adds the run's rows in row order (float32, from a zero), rounds the sum to x's dtype, then to
    the wire's (``TO``), and writes it to every row of the run at its place after the header,
    with the Adler partial sums of those bytes; the last: the header, the padding, their sums.
    (The run loops go to the tile's longest run, a scalar bound: no branch on block values.)"""
    pid, last, a, c = _cast_program()
    if pid < last:
        b, s = _block_segs(pid, rows, SEGS)
        _, length = _id_runs(sorted_ptr, k_s0, k_s1, b, s, rows, steps)
        n_steps = tl.max(length, axis=0)
        start = tl.load(table_ptr + b)
        width = tl.load(table_ptr + n_blocks + b)
        for c0 in range(0, width, COLS):
            j = c0 + tl.arange(0, COLS)
            col = start + j
            cm = j < width
            acc = tl.zeros((SEGS, COLS), dtype=tl.float32)
            for k in range(0, n_steps):
                on = k < length
                row = tl.load(perm_ptr + (s + k) * k_s0 + b * k_s1, mask=on, other=0)
                m = on[:, None] & cm[None, :]
                v = _load_f32(x_ptr, row[:, None] * cols + col[None, :], m, SRC)
                acc = tl.where(m, acc + v, acc)
            if SRC == 1:  # the sum in x's dtype (the transport's sum_duplicates rounds it once)
                acc = acc.to(tl.float16).to(tl.float32)
            if SRC == 2:
                acc = (_bits_of(acc, 2) << 16).to(tl.float32, bitcast=True)
            bits = _bits_of(acc, TO)
            for k in range(0, n_steps):
                on = k < length
                row = tl.load(perm_ptr + (s + k) * k_s0 + b * k_s1, mask=on, other=0)
                m = on[:, None] & cm[None, :]
                i = row[:, None] * cols + col[None, :]
                if ITEM == 4:
                    tl.store(out_ptr.to(tl.pointer_type(tl.int32)) + h // 4 + i, bits, mask=m)
                else:
                    tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + h // 2 + i, bits.to(tl.int16), mask=m)
                da, dc = _tile_byte_sums(bits, h + i * ITEM, m, ITEM)
                a += da
                c = (c + dc) % 65521
    else:
        a, c = _head_written(head_ptr, h, n, total, out_ptr, ITEM)
    tl.atomic_xchg(part_ptr + 2 * pid, a)  # (atomics, as the count after them: none left in a cache)
    tl.atomic_xchg(part_ptr + 2 * pid + 1, c % 65521)
    _finish_last(part_ptr, last + 1, count_ptr, total, out_ptr, part_ptr, 2, FINISH)


@triton.jit
def cast_first_unpack_kernel(
    pay_ptr, rows, cols, n, sorted_ptr, perm_ptr, k_s0, k_s1, table_ptr, n_blocks, h, total, head_ptr, out_ptr, s0, s1,
    part_ptr, verdict_ptr, count_ptr, ITEM: tl.constexpr, WIRE: tl.constexpr, SEGS: tl.constexpr,
    COLS: tl.constexpr, FINISH: tl.constexpr,
):  # fmt: skip
    """Programs 0..: ``SEGS`` sorted positions of one block: their rows' wire values to the output
    where the row is its id's first in the block (the run's start), zeros elsewhere, and the
    Adler partial sums of their bytes; the last: :func:`cast_unpack_kernel`'s."""
    pid, last, a, c = _cast_program()
    if pid < last:
        b, s = _block_segs(pid, rows, SEGS)
        live = s < rows
        new, _ = _id_runs(sorted_ptr, k_s0, k_s1, b, s, rows, 0)
        row = tl.load(perm_ptr + s * k_s0 + b * k_s1, mask=live, other=0)
        start = tl.load(table_ptr + b)
        width = tl.load(table_ptr + n_blocks + b)
        for c0 in range(0, width, COLS):
            j = c0 + tl.arange(0, COLS)
            col = start + j
            m = live[:, None] & (j < width)[None, :]
            i = row[:, None] * cols + col[None, :]
            if ITEM == 4:
                bits = tl.load(pay_ptr.to(tl.pointer_type(tl.int32)) + h // 4 + i, mask=m, other=0)
            else:
                bits = tl.load(pay_ptr.to(tl.pointer_type(tl.int16)) + h // 2 + i, mask=m, other=0).to(tl.int32)
                bits = bits & 0xFFFF
            da, dc = _tile_byte_sums(bits, h + i * ITEM, m, ITEM)
            a += da
            c = (c + dc) % 65521
            keep = new[:, None]
            dst = out_ptr + row[:, None] * s0 + col[None, :] * s1
            if WIRE == 0:
                if ITEM == 4:
                    tl.store(dst.to(tl.pointer_type(tl.int32)), tl.where(keep, bits, 0), mask=m)
                else:
                    tl.store(dst.to(tl.pointer_type(tl.int16)), tl.where(keep, bits, 0).to(tl.int16), mask=m)
            if WIRE == 1:
                v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                tl.store(dst, tl.where(keep, v, 0.0), mask=m)
            if WIRE == 2:
                tl.store(dst, tl.where(keep, (bits << 16).to(tl.float32, bitcast=True), 0.0), mask=m)
    else:
        a, c = _head_checked(pay_ptr, h, n, total, head_ptr, verdict_ptr, ITEM)
    tl.atomic_xchg(part_ptr + 2 * pid, a)  # (atomics, as the count after them: none left in a cache)
    tl.atomic_xchg(part_ptr + 2 * pid + 1, c % 65521)
    _finish_last(part_ptr, last + 1, count_ptr, total, pay_ptr, verdict_ptr, 1, FINISH)


_TABLES: dict[tuple, torch.Tensor] = {}  # block tables (and a launch counter) already on a device, per stream


def _block_table(widths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_table` of ``widths`` and a zero launch counter after it (:func:`_finish_last`: each
    launch leaves it zero), uploaded once per distinct widths, device and stream (a run's
    collectives send the same few layouts every iteration, like the casts' headers; launches on
    one stream run one after another, so they share the counter in turn)."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (tuple(widths), device, stream)
    if key not in _TABLES:
        if len(_TABLES) >= 256:
            _TABLES.clear()
        _TABLES[key] = _table(widths, [0], device)
    table = _TABLES[key]
    return table, table[2 * len(widths) :]


def _id_strides(sorted_ids: torch.Tensor, perm: torch.Tensor) -> tuple[int, int]:
    """Element strides of the sorted ids (and of ``perm``, laid out alike) along the rows and
    across blocks (0 where every block has the same ids: one column)."""
    if sorted_ids.shape != perm.shape or sorted_ids.stride() != perm.stride():
        raise ValueError(f"sorted ids {tuple(sorted_ids.shape)} and permutation {tuple(perm.shape)} differ in layout")
    return sorted_ids.stride(0), 0 if sorted_ids.shape[1] == 1 else sorted_ids.stride(1)


def cast_pack_summed(
    x: torch.Tensor, head: torch.Tensor, wire: int, sorted_ids: torch.Tensor, perm: torch.Tensor, widths: list[int],
    segs: int = SUM_SEGS, cols: int = SUM_COLS, finish: int = 1024,
) -> torch.Tensor:  # fmt: skip
    """Kernel version of :func:`reference.cast_pack_summed`: one launch, the sums, their casts, the
    header and the partial sums, the check finished and written by its last program to finish."""
    item, h, total, out = _cast_payload(x, head, wire)
    rows, n_cols = x.shape
    programs = len(widths) * triton.cdiv(rows, segs) + 1
    parts = torch.empty(2 * programs, dtype=torch.int64, device=x.device)
    k_s0, k_s1 = _id_strides(sorted_ids, perm)
    table, count = _block_table(widths, x.device)
    to = wire if wire else _OUT_CODE[x.dtype]  # the wire's dtype: x's own where it is sent as it is
    cast_sum_pack_kernel[(programs,)](
        x.contiguous(), rows, n_cols, x.numel(), sorted_ids, perm, k_s0, k_s1, table, len(widths),
        max(rows, 1).bit_length(), head, h, total, out, parts, count,
        SRC=_OUT_CODE[x.dtype], TO=to, ITEM=item, SEGS=segs, COLS=cols, FINISH=finish, **_LAUNCH,
    )  # fmt: skip
    return out


def cast_unpack_first(
    payload: torch.Tensor, head: torch.Tensor, wire: int, out: torch.Tensor, sorted_ids: torch.Tensor,
    perm: torch.Tensor, widths: list[int], segs: int = SUM_SEGS, cols: int = SUM_COLS, finish: int = 1024,
) -> torch.Tensor:  # fmt: skip
    """Kernel version of :func:`reference.cast_unpack_first`: one launch, the first rows' values
    (zeros on the others), the sums and the header's verdict, the check's verdict by its last
    program to finish."""
    rows, n_cols = out.shape
    programs = len(widths) * triton.cdiv(rows, segs) + 1
    item, parts, verdict = _cast_verdict(out, wire, programs)
    k_s0, k_s1 = _id_strides(sorted_ids, perm)
    table, count = _block_table(widths, out.device)
    cast_first_unpack_kernel[(programs,)](
        payload, rows, n_cols, out.numel(), sorted_ids, perm, k_s0, k_s1, table, len(widths),
        head.numel(), payload.numel(), head, out, out.stride(0), out.stride(1), parts, verdict, count,
        ITEM=item, WIRE=wire, SEGS=segs, COLS=cols, FINISH=finish, **_LAUNCH,
    )  # fmt: skip
    return verdict


# -- bit streams and several payloads' checks (the ids codec) ---------------------------------------

BITS_BLOCK = 1024  # values per program of the bit-stream kernels


@triton.jit
def _word_and_bit(starts_ptr, s_stride, i, live):
    """The int64 word and the bit in it (0..63) where each live field ``i`` starts."""
    s = tl.load(starts_ptr + i * s_stride, mask=live, other=0).to(tl.int64)
    return s >> 6, s & 63


@triton.jit
def bits_pack_kernel(values_ptr, v_stride, starts_ptr, s_stride, n, words_ptr, n_words, BLOCK: tl.constexpr):
    """Each value ORed into the word its start falls in and, past its end, the next (two atomic
    ORs: fields never overlap, so the order does not matter); zeros are not written. Shifts stay
    in [0, 63]."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    v = tl.load(values_ptr + i * v_stride, mask=live, other=0).to(tl.int64)
    w, b = _word_and_bit(starts_ptr, s_stride, i, live)
    low = v << b
    spill = tl.where(b > 0, ((v >> 1) & 0x7FFFFFFFFFFFFFFF) >> tl.where(b > 0, 63 - b, 0), 0)  # logical shift
    tl.atomic_or(words_ptr + w, low, mask=live & (low != 0) & (w < n_words))
    tl.atomic_or(words_ptr + w + 1, spill, mask=live & (spill != 0) & (w + 1 < n_words))


@triton.jit
def bits_unpack_kernel(
    words_ptr, n_words, starts_ptr, s_stride, widths_ptr, w_stride, n, out_ptr, BLOCK: tl.constexpr
):  # fmt: skip
    """Each value's bits from its word and the next, masked to its width (0..64); words past the
    end read as zeros. Shifts stay in [0, 63]."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    w, b = _word_and_bit(starts_ptr, s_stride, i, live)
    width = tl.load(widths_ptr + i * w_stride, mask=live, other=0).to(tl.int64)
    x = tl.load(words_ptr + w, mask=live & (w < n_words), other=0)
    y = tl.load(words_ptr + w + 1, mask=live & (b > 0) & (w + 1 < n_words), other=0)
    one = tl.full((BLOCK,), 1, dtype=tl.int64)
    up = tl.where(b > 0, 64 - b, 1)  # (b = 0: unused)
    low = tl.where(b > 0, (x >> b) & ((one << up) - 1), x)
    high = tl.where(b > 0, y << up, 0)
    v = low | high
    keep = tl.where(width >= 64, -1, (one << tl.where(width >= 64, 0, width)) - 1)
    tl.store(out_ptr + i, v & keep, mask=live)


def bits_pack(values: torch.Tensor, starts: torch.Tensor, n_words: int, block: int = BITS_BLOCK) -> torch.Tensor:
    """Kernel version of :func:`reference.bits_pack`: the words zeroed, then one kernel."""
    words = torch.zeros(n_words, dtype=torch.int64, device=values.device)
    n = values.numel()
    if n:
        bits_pack_kernel[(triton.cdiv(n, block),)](
            values, values.stride(0), starts, starts.stride(0), n, words, n_words, BLOCK=block, **_LAUNCH
        )
    return words


def bits_unpack(
    words: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor, block: int = BITS_BLOCK
) -> torch.Tensor:
    """Kernel version of :func:`reference.bits_unpack`: one kernel."""
    n = starts.numel()
    out = torch.empty(n, dtype=torch.int64, device=starts.device)
    if n:
        bits_unpack_kernel[(triton.cdiv(n, block),)](
            words, words.numel(), starts, starts.stride(0), widths, widths.stride(0), n, out, BLOCK=block, **_LAUNCH
        )
    return out


@triton.jit
def adler_segments_partials_kernel(
    data_ptr, table_ptr, n_segments, skip_at, skip_len, part_ptr, max_parts, BLOCK: tl.constexpr
):  # fmt: skip
    """Program (block, segment): :func:`adler_partials_kernel` over the segment's block (its own
    offsets); programs past their segment's end write zeros at once."""
    blk = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1).to(tl.int64)
    base = tl.load(table_ptr + seg)
    size = tl.load(table_ptr + n_segments + seg)
    a = tl.zeros((), dtype=tl.int64)
    c = tl.zeros((), dtype=tl.int64)
    if blk * BLOCK < size:
        i = blk * BLOCK + tl.arange(0, BLOCK)
        keep = (i < size) & ((i < skip_at) | (i >= skip_at + skip_len))
        d = tl.load(data_ptr + base + i, mask=keep, other=0).to(tl.int64)
        v = tl.where(i >= skip_at + skip_len, i - skip_len, i)
        a = tl.sum(d, axis=0)
        c = tl.sum(v * d, axis=0) % 65521
    at = 2 * (seg * max_parts + blk)
    tl.store(part_ptr + at, a)
    tl.store(part_ptr + at + 1, c)


@triton.jit
def adler_segments_finish_kernel(
    part_ptr, max_parts, table_ptr, n_segments, skip_len, check_at, data_ptr, out_ptr,
    MODE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program per segment: :func:`adler_finish_kernel` over its partial sums."""
    seg = tl.program_id(0).to(tl.int64)
    base = tl.load(table_ptr + seg)
    size = tl.load(table_ptr + n_segments + seg)
    n_parts = (size + BLOCK - 1) // BLOCK
    a = tl.zeros((), dtype=tl.int64)
    c = tl.zeros((), dtype=tl.int64)
    for k in range(0, max_parts, CHUNK):
        j = k + tl.arange(0, CHUNK)
        m = j < n_parts
        at = 2 * (seg * max_parts + j)
        a += tl.sum(tl.load(part_ptr + at, mask=m, other=0), axis=0) % 65521
        c += tl.sum(tl.load(part_ptr + at + 1, mask=m, other=0), axis=0)
    check = _adler_check(a, c, size - skip_len)
    byte = tl.arange(0, 4)
    if MODE == 0:
        tl.store(out_ptr + seg, check)
    if MODE == 1:
        stored = tl.sum(tl.load(data_ptr + base + check_at + byte).to(tl.int64) << (8 * byte), axis=0)
        tl.store(out_ptr + seg, (stored == check).to(tl.int64))
    if MODE == 2:
        tl.store(data_ptr + base + check_at + byte, ((check >> (8 * byte)) & 255).to(tl.uint8))
        tl.store(out_ptr + seg, check)


def adler32_segments(
    data: torch.Tensor, starts: list[int], sizes: list[int], skip_at: int, skip_len: int, check_at: int, mode: int,
    block: int = ADLER_BLOCK,
) -> torch.Tensor:  # fmt: skip
    """Kernel version of :func:`reference.adler32_segments`: the segments' table up, then two
    launches for every segment at once."""
    n = len(starts)
    out = torch.empty(n, dtype=torch.int64, device=data.device)
    if not n:
        return out
    table = torch.tensor([*starts, *sizes], dtype=torch.int64).to(data.device, non_blocking=True)
    max_parts = max(triton.cdiv(max(sizes), block), 1)
    parts = torch.empty(2 * n * max_parts, dtype=torch.int64, device=data.device)
    adler_segments_partials_kernel[(max_parts, n)](
        data, table, n, skip_at, skip_len, parts, max_parts, BLOCK=block, **_LAUNCH
    )
    adler_segments_finish_kernel[(n,)](
        parts, max_parts, table, n, skip_len, check_at, data, out, MODE=mode, BLOCK=block, CHUNK=1024, **_LAUNCH
    )
    return out


if QMAX != 1073741823:  # quantize_kernel spells the clamp as a literal
    raise ImportError("compression.kernels: QMAX changed in reference.py; update quantize_kernel")
