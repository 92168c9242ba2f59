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

Over 500 lines because it is ``kernels.py``'s other half: one function per kernel of the same
name (the fused ops of :mod:`compression.ops` are registered from these functions' signatures),
so that the pairs a test compares bit for bit are read side by side in two files.
"""

from __future__ import annotations

import ctypes
import zlib

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


ADLER_VALUE, ADLER_HOLDS, ADLER_SEAL = 0, 1, 2  # what :func:`adler32` does with the check


def adler32(
    data: torch.Tensor, end: torch.Tensor | None, size: int, skip_at: int, skip_len: int, check_at: int, mode: int
) -> torch.Tensor:
    """zlib's Adler-32 of ``data``'s first ``end`` bytes (else ``size``) but the ``skip_len`` at
    ``skip_at`` (a payload's own check field, or a prefix that holds it): returned (VALUE),
    compared with the little-endian u32 stored at ``check_at`` (HOLDS: 1 or 0), or written there
    (SEAL); an int64 0-d tensor. The CPU's: zlib over the bytes where they lie (no copy)."""
    n = size if end is None else int(end)
    raw = _memory(data.contiguous(), n)
    check = zlib.adler32(raw[skip_at + skip_len :], zlib.adler32(raw[:skip_at]))
    if mode == ADLER_HOLDS:
        check = int(int.from_bytes(raw[check_at : check_at + 4], "little") == check)
    elif mode == ADLER_SEAL:
        data[check_at : check_at + 4] = torch.tensor(list(check.to_bytes(4, "little")), dtype=torch.uint8)
    return torch.tensor(check, dtype=torch.int64)


def _memory(t: torch.Tensor, n: int) -> memoryview:
    """The first ``n`` bytes of a contiguous uint8 CPU tensor, as a memoryview of its memory."""
    if n > t.numel() or t.device.type != "cpu":
        raise ValueError(f"{n} bytes of a {t.numel()}-byte tensor on {t.device}")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def frame(
    head: torch.Tensor,
    patches: list[torch.Tensor],
    patch_at: list[int],
    pieces: list[torch.Tensor],
    lengths: list[torch.Tensor],
    host_lengths: list[int],
    section_of: list[int],
    n_sections: int,
    align: int,
    lengths_at: int,
    total_at: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A payload from its header and its sections' pieces: the header's bytes ``head`` (the
    host's) with ``patches`` (the device's bytes) at ``patch_at``; each piece's first bytes (its
    ``host_lengths`` entry, or where that is -1 the next of the device's ``lengths``, int64 0-d),
    joined per section (``section_of``: each piece's, in order), sections ``align``-aligned
    after the header; the section lengths and the total written as u64 at ``lengths_at`` and
    ``total_at`` (-1: not written). Returns (the payload in a buffer of capacity ``head +
    pieces + align per section``, its length as an int64 0-d tensor)."""
    device = pieces[0].device if pieces else head.device
    out = head.to(device, copy=True)
    for at, p in zip(patch_at, patches, strict=True):
        out[at : at + p.numel()] = p
    found = iter(int(n) for n in lengths)
    lens = [n if n >= 0 else next(found) for n in host_lengths]
    sections: list[list[torch.Tensor]] = [[] for _ in range(n_sections)]
    for piece, n, s in zip(pieces, lens, section_of, strict=True):
        sections[s].append(piece[:n])
    parts, sizes = [out], []
    for sec in sections:
        size = sum(p.numel() for p in sec)
        sizes.append(size)
        parts += [*sec, out.new_zeros(-size % align)]
    total = sum(p.numel() for p in parts)
    if lengths_at >= 0:
        out[lengths_at : lengths_at + 8 * n_sections] = torch.tensor(sizes, dtype=torch.int64).view(torch.uint8)
    if total_at >= 0:
        out[total_at : total_at + 8] = torch.tensor([total], dtype=torch.int64).view(torch.uint8)
    capacity = head.numel() + sum(p.numel() for p in pieces) + align * n_sections
    buffer = out.new_empty(capacity)  # past the payload: capacity, never read
    torch.cat(parts, out=buffer[:total])
    return buffer, torch.tensor(total, dtype=torch.int64, device=device)


def _block_steps(bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's float32 bin width ``2 eb`` and strict margin ``ed``, as 0-d tensors."""
    return torch.tensor(step_of(bound), dtype=torch.float32), torch.tensor(float32_at_most(bound), dtype=torch.float32)


def lossy_pack(
    x: torch.Tensor, src: torch.Tensor, counts: torch.Tensor, bounds: torch.Tensor, widths: list[int], summed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lossy codec's codes and exceptions of a chunk ``x`` [rows, cols] of column blocks
    ``widths``: per block b its first ``counts[b]`` unique rows, the rows ``src[b, :counts[b]]``
    of x (or, ``summed``, the sums of x's rows by ``src[b]``, each row's unique index: a
    gradient's rows of one id), block after block, each row's columns in order (the flat value
    order); quantised under ``bounds[b]`` (:func:`quantize`), block-packed (:func:`block_pack`).

    Returns (group widths u8, packed words int32, exception positions int32, exception values in
    x's dtype, lengths): the first three at the capacity of a chunk with every row unique (the
    widths zero past the used groups), ``lengths`` = (bytes of the widths padded to 4, of the
    words, of the positions, of the values), int64. The payload's codes and exceptions sections,
    as the kernels write them on a device; here the counts are read on the host (a CPU's)."""
    rows, cols = x.shape
    n_cap = rows * cols
    groups = -(-n_cap // GROUP)
    codes, pos, raw, at, c = [], [], [], 0, 0
    for b, (w, u, eb) in enumerate(zip(widths, counts.tolist(), bounds.tolist(), strict=True)):
        block = x[:, c : c + w]
        if summed:
            vals = torch.zeros(u, w, dtype=x.dtype).index_add_(0, src[b], block)
        else:
            vals = block.index_select(0, src[b, :u])
        v = vals.reshape(-1)
        q, miss = quantize(v.float(), *_block_steps(eb), x.dtype)
        hit = miss.nonzero().view(-1)
        codes.append(q)
        pos.append((hit + at).to(torch.int32))
        raw.append(v.index_select(0, hit))
        at, c = at + v.numel(), c + w
    widths_g, words = block_pack(torch.cat(codes) if codes else torch.zeros(0, dtype=torch.int32))
    g, k = widths_g.numel(), sum(p.numel() for p in pos)
    out_widths = torch.zeros(groups + 4, dtype=torch.uint8)
    out_widths[:g] = widths_g
    out_words = torch.empty(GROUP * groups, dtype=torch.int32)
    out_words[: words.numel()] = words
    out_pos = torch.empty(n_cap, dtype=torch.int32)
    out_raw = torch.empty(n_cap, dtype=x.dtype)
    if k:
        out_pos[:k] = torch.cat(pos)
        out_raw[:k] = torch.cat(raw)
    lengths = torch.tensor([g + (-g % 4), 4 * words.numel(), 4 * k, x.element_size() * k], dtype=torch.int64)
    return out_widths, out_words, out_pos, out_raw, lengths


def lossy_roundtrip(x: torch.Tensor, bounds: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """What the lossy codec's decode returns for every value of ``x`` [rows, cols] (column blocks
    ``widths``, float32) coded under its block's bound ``bounds[b]`` (float64): ``q * step``
    where the reconstruction holds (:func:`quantize`), the value itself where it misses (an
    exception). Neither codes nor payload are made: a sender's view of what its peer decodes."""
    out = torch.empty_like(x)
    c = 0
    for w, eb in zip(widths, bounds.tolist(), strict=True):
        block = x[:, c : c + w]
        step, ed = _block_steps(eb)
        q, miss = quantize(block.float(), step, ed, x.dtype)
        out[:, c : c + w] = torch.where(miss, block, _dequantize(q, step).to(x.dtype))
        c += w
    return out


def lossy_unpack(
    group_widths: torch.Tensor,
    words: torch.Tensor,
    positions: torch.Tensor,
    raw: torch.Tensor,
    counts: list[int],
    bounds: list[float],
    widths: list[int],
    inverse: torch.Tensor | None,
    first: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Inverse of :func:`lossy_pack` into ``out`` [rows, cols] (any strides, x's dtype): the
    codes unpacked and dequantised per block, the exceptions' bits restored, and each row ``r``
    of block b given its unique row ``inverse[b, r]`` (None: row r itself); with ``first``
    (each unique row's first row, [n_blocks, rows]) the other rows of an id are zeros (a
    gradient's duplicate-id rows: the owner adds them). Positions are in range (the payload's
    check passed)."""
    n = sum(u * w for u, w in zip(counts, widths, strict=True))
    used = group_widths.long().clamp(max=31)  # widths that disagree with the words (an encoder bug or a
    used = used * (used.sum() == words.numel())  # forged check) decode as zero-width groups: no read past them
    codes = block_unpack(used, words, n)
    values = torch.empty(n, dtype=torch.float32)
    at = 0
    for u, w, eb in zip(counts, widths, bounds, strict=True):
        values[at : at + u * w] = dequantize(codes[at : at + u * w], _block_steps(eb)[0])
        at += u * w
    values = values.to(out.dtype)
    values[positions.long().clamp(0, max(n - 1, 0))] = raw[: positions.numel()] if n else raw[:0]
    at = c = 0
    for b, (u, w) in enumerate(zip(counts, widths, strict=True)):
        block = values[at : at + u * w].view(u, w)
        if inverse is not None:
            block = block.index_select(0, inverse[b])
        if first is not None and inverse is not None:  # rows that are not their id's first: zeros (not
            mine = first[b].gather(0, inverse[b]) == torch.arange(out.shape[0])  # `* mask`: inf * 0 is nan)
            block = torch.where(mine[:, None], block, 0.0)
        out[:, c : c + w] = block
        at, c = at + u * w, c + w


def relative_bounds(x: torch.Tensor, rel: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Per column block of ``x`` (``widths``): ``rel[b]`` (float64) times the block's finite value
    range, taken in float32 and widened to float64 before the subtraction (as Python floats of
    its max and min would be); no finite value (an empty block, or only NaN/inf): 0. Float64
    ``[n_blocks]``."""
    nb = len(widths)
    if x.numel() == 0:
        return torch.zeros(nb, dtype=torch.float64, device=x.device)
    xf = x.float()
    finite = torch.isfinite(xf)
    hi = torch.where(finite, xf, float("-inf")).amax(dim=0)  # per column
    lo = torch.where(finite, xf, float("inf")).amin(dim=0)
    if nb and min(widths) == max(widths) > 0:  # equal blocks: a view
        top, bottom = hi.view(nb, widths[0]).amax(1), lo.view(nb, widths[0]).amin(1)
    else:
        block = torch.tensor([b for b, w in enumerate(widths) for _ in range(w)], device=x.device)
        top = torch.full((nb,), float("-inf"), device=x.device).scatter_reduce(0, block, hi, "amax")
        bottom = torch.full((nb,), float("inf"), device=x.device).scatter_reduce(0, block, lo, "amin")
    top, bottom = top.double(), bottom.double()
    return rel * torch.where(top >= bottom, top - bottom, 0.0)  # no finite value: an empty range


def id_runs(
    sorted_ids: torch.Tensor, perm: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of ``sorted_ids`` [n, rows] (``keys``' columns sorted, ``perm`` their rows; one
    row for every block where ``keys`` [rows, n_blocks] repeats one column): the runs of equal
    ids, in order: their number (counts [n]), each run's row of first appearance in sorted order
    (first [n, rows], slots past the runs 0), each row's run (inverse [n, rows]); and the ids'
    fingerprint, a 32-bit weighted sum (int64 0-d) that tells other ids apart."""
    n, rows = sorted_ids.shape
    new = torch.ones_like(sorted_ids, dtype=torch.bool)
    new[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    local = new.cumsum(1) - 1
    inverse = torch.empty_like(local).scatter_(1, perm, local)
    slot = torch.where(new, local, rows)  # repeats go to a spare column
    first = torch.zeros(n, rows + 1, dtype=torch.int64).scatter_(1, slot, perm)[:, :rows]
    return new.sum(1), first.contiguous(), inverse, fingerprint(keys)


def fingerprint(keys: torch.Tensor) -> torch.Tensor:
    """32-bit weighted sum of ``keys`` [rows, n_blocks] (int64 0-d): odd weights, so any single
    change of an id changes it (wrapping int64 arithmetic, then its low 32 bits)."""
    rows, nb = keys.shape
    w_row, w_blk = fingerprint_weights(rows, nb, keys.device)
    if nb == 1 or keys.stride(1) == 0:
        total = (keys[:, 0] * w_row).sum() * w_blk.sum()  # not torch.dot: CUDA has no int64 dot
    else:
        total = ((keys * w_row[:, None]).sum(0) * w_blk).sum()
    return total & 0xFFFFFFFF


def fingerprint_weights(
    rows: int, n_blocks: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fingerprint`'s odd weights (int64): one per row, one per block."""
    w_row = torch.arange(rows, device=device) * -7046029254386353131 + 0x2545F491 | 1
    w_blk = torch.arange(n_blocks, device=device) * 0x5851F42D4C957F2D + 0x14057B7EF767814F | 1
    return w_row, w_blk


WIRE_DTYPES: dict[int, torch.dtype | None] = {0: None, 1: torch.float16, 2: torch.bfloat16}  # None: as they are


def cast_pack(x: torch.Tensor, head: torch.Tensor, wire: int) -> torch.Tensor:
    """A cast codec's payload: the header's bytes ``head`` (its check field zero), ``x``'s values
    in the wire dtype (:data:`WIRE_DTYPES`), zeros to 8 bytes, then its Adler-32 written in."""
    dtype = WIRE_DTYPES[wire]
    body = (x if dtype is None else x.to(dtype)).contiguous().view(-1).view(torch.uint8)
    out = torch.cat([head.to(x.device), body, body.new_zeros(-(head.numel() + body.numel()) % 8)])
    adler32(out, None, out.numel(), 20, 4, 20, ADLER_SEAL)
    return out


def cast_unpack(payload: torch.Tensor, head: torch.Tensor, wire: int, out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`cast_pack` into ``out`` (any strides), and the payload's verdict, int64
    [2]: whether its Adler-32 holds, and whether its header is ``head`` (the one the receiver
    expects, its check field aside). The values are written whatever the verdict."""
    dtype = WIRE_DTYPES[wire] or out.dtype
    h, n = head.numel(), out.numel() * dtype.itemsize
    body = payload[h : h + n]
    if body.data_ptr() % dtype.itemsize:
        body = body.clone()
    out.copy_(body.view(dtype).view(out.shape))
    holds = adler32(payload, None, payload.numel(), 20, 4, 20, ADLER_HOLDS)
    same = torch.equal(payload[:20], head[:20]) and torch.equal(payload[24:h], head[24:h])
    return torch.stack([holds, torch.tensor(int(same))])


def id_slots(sorted_ids: torch.Tensor, perm: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Each row's slot among its block's distinct ids (ascending id order), ``[n_blocks, rows]``,
    from the ids sorted stably along the rows (:func:`compression.dedup.id_sort`: ``sorted_ids``
    and ``perm`` [rows, n], n = n_blocks, or 1 where every block has the same ids)."""
    s, p = sorted_ids.t(), perm.t()
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    local = new.cumsum(1) - 1
    slots = torch.empty_like(local).scatter_(1, p, local)
    return slots.expand(n_blocks, -1) if slots.shape[0] != n_blocks else slots


def first_of_ids(sorted_ids: torch.Tensor, perm: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Whether each row is the first (smallest) row of its id in its block, bool ``[n_blocks, rows]``
    (:func:`id_slots`'s sort)."""
    s, p = sorted_ids.t(), perm.t()
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    first = torch.zeros_like(new).scatter_(1, p, new)
    return first.expand(n_blocks, -1) if first.shape[0] != n_blocks else first


def per_column(per_block: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """``per_block`` [n_blocks, rows] spread to every column of its block: [rows, cols]."""
    block_of = torch.tensor([b for b, w in enumerate(widths) for _ in range(w)], dtype=torch.int64)
    return per_block.index_select(0, block_of.to(per_block.device)).t()


def sum_runs(x: torch.Tensor, sorted_ids: torch.Tensor, perm: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Every row of each block (``widths``) given the sum of its block's rows with the same id (a
    new tensor): each id's rows added in row order into a zero of x's dtype (float32 partial sums
    for 16-bit x, rounded once), one scatter and one gather, as the transport's
    ``dlrm.embedding_comm.ids.sum_duplicates`` sums them (the same floats)."""
    if not any(widths):
        return x.clone()
    slot = per_column(id_slots(sorted_ids, perm, len(widths)), widths)
    return torch.zeros_like(x).scatter_add_(0, slot, x).gather(0, slot)


def keep_first_runs(out: torch.Tensor, sorted_ids: torch.Tensor, perm: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Zero, per block, every row of ``out`` (in place, any strides) whose id appeared on an earlier
    row: each id's value stays on its first row (``keep_first_duplicates``'s zeros)."""
    if any(widths):
        out.masked_fill_(~per_column(first_of_ids(sorted_ids, perm, len(widths)), widths), 0.0)
    return out


def cast_pack_summed(
    x: torch.Tensor, head: torch.Tensor, wire: int, sorted_ids: torch.Tensor, perm: torch.Tensor, widths: list[int]
) -> torch.Tensor:
    """:func:`cast_pack` of ``x`` with every row replaced by the sum of its block's rows of the same
    id (:func:`sum_runs`; a gradient's rows by id): the bytes of ``cast_pack(sum_runs(x))``."""
    return cast_pack(sum_runs(x, sorted_ids, perm, widths), head, wire)


def cast_unpack_first(
    payload: torch.Tensor,
    head: torch.Tensor,
    wire: int,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    perm: torch.Tensor,
    widths: list[int],
) -> torch.Tensor:
    """:func:`cast_unpack`, then each id's value kept on its block's first row of the id alone,
    zeros on the others (:func:`keep_first_runs`); the same verdict."""
    verdict = cast_unpack(payload, head, wire, out)
    keep_first_runs(out, sorted_ids, perm, widths)
    return verdict


# -- bit streams and several payloads' checks (the ids codec) -----------------------------------

_LOW63 = (1 << 63) - 1


def bits_pack(values: torch.Tensor, starts: torch.Tensor, n_words: int) -> torch.Tensor:
    """``n_words`` int64 words holding each int64 ``values[i]`` from bit ``starts[i]`` on (bit b
    of a stream is bit b % 64 of word b // 64, least significant first; a value crosses at most
    one word boundary). Each value already fits its field (no bits above its width) and fields
    never overlap, so placing is summing; a value with nothing to place may start at the end.
    The shifts in numpy's uint64 (logical, and vectorised where torch's int64 ones are not)."""
    v, s = _u64(values), _u64(starts)
    b = s & np.uint64(63)
    low = torch.from_numpy((v << b).view(np.int64))
    spill = torch.from_numpy(((v >> np.uint64(1)) >> (np.uint64(63) - b)).view(np.int64))  # none at b = 0
    w = torch.from_numpy((s >> np.uint64(6)).view(np.int64))
    words = torch.zeros(n_words + 2, dtype=torch.int64)
    words.index_add_(0, w, low).index_add_(0, w + 1, spill)
    return words[:n_words].to(values.device)


def bits_unpack(words: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`bits_pack`: the ``widths[i]`` (0..64) bits from bit ``starts[i]`` of
    ``words``, as int64 (64 bits: the pattern, wrapping); bits past the words read as zeros."""
    padded = _u64(torch.cat([words, words.new_zeros(2)]))
    s, width = _u64(starts), _u64(widths)
    w, b = (s >> np.uint64(6)).astype(np.int64), s & np.uint64(63)
    low = padded[w] >> b
    high = np.where(b > 0, padded[w + 1] << ((np.uint64(64) - b) & np.uint64(63)), np.uint64(0))
    keep = np.where(width >= 64, ~np.uint64(0), (np.uint64(1) << (width & np.uint64(63))) - np.uint64(1))
    return torch.from_numpy(((low | high) & keep).view(np.int64)).to(starts.device)


def _u64(t: torch.Tensor) -> np.ndarray:
    """An int64 tensor's values as a uint64 numpy array (the same bits; a copy where strided)."""
    return np.ascontiguousarray(t.detach().cpu().numpy()).view(np.uint64)


def adler32_segments(
    data: torch.Tensor, starts: list[int], sizes: list[int], skip_at: int, skip_len: int, check_at: int, mode: int
) -> torch.Tensor:
    """:func:`adler32` of each segment ``data[starts[s] : starts[s] + sizes[s]]`` (its own
    offsets ``skip_at``, ``check_at``), int64 [segments]: the values, the verdicts or the checks
    written in place."""
    out = [
        adler32(data[a : a + n], None, n, skip_at, skip_len, check_at, mode) for a, n in zip(starts, sizes, strict=True)
    ]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)
