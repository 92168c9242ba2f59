"""Triton kernels of the row cache's device operations (:mod:`compression.row_ops`), bit for
bit their torch references (:mod:`compression.row_reference`; checked in the interpreter by
``tests/compression/test_triton.py``). Launched as :mod:`compression.kernels`' are (no FMA
contraction)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernels import _LAUNCH

LAYOUT_CHUNK = 1024  # unique ids per step of row_layout_kernel


@triton.jit
def _row_flags(valid_ptr, held_ptr, moved_ptr, at, m):
    """Unique ids' flags at ``at`` (where ``m``): held, moved, fresh (valid and not held)."""
    v = tl.load(valid_ptr + at, mask=m, other=0) != 0
    h = tl.load(held_ptr + at, mask=m, other=0) != 0
    mv = m & (tl.load(moved_ptr + at, mask=m, other=0) != 0)
    return h, mv, m & v & (h == 0)


@triton.jit
def row_layout_kernel(
    valid_ptr, held_ptr, moved_ptr, uid_ptr, rows, fresh_ptr, order_ptr, place_ptr, sending_ptr, empty_ptr,
    n_held_ptr, ids_ptr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program b, over block b's unique ids (:func:`row_reference.row_layout`): a first pass counts
    its fresh and moved ids and finds the first of each; the second places every id (fresh, then
    moved, then the rest, each ascending: the stable sort's order) and writes the payload order,
    its first row past the sent ones."""
    b = tl.program_id(0).to(tl.int64)
    base = b * rows
    n_fresh = tl.zeros((), dtype=tl.int64)
    n_moved = tl.zeros((), dtype=tl.int64)
    n_held = tl.zeros((), dtype=tl.int64)
    first_fresh = tl.zeros((), dtype=tl.int64) + rows
    first_moved = tl.zeros((), dtype=tl.int64) + rows
    for k in range(0, rows, CHUNK):
        i = (k + tl.arange(0, CHUNK)).to(tl.int64)
        m = i < rows
        h, mv, f = _row_flags(valid_ptr, held_ptr, moved_ptr, base + i, m)
        tl.store(fresh_ptr + base + i, f, mask=m)
        n_fresh += tl.sum(f.to(tl.int64), axis=0)
        n_moved += tl.sum(mv.to(tl.int64), axis=0)
        n_held += tl.sum((m & h).to(tl.int64), axis=0)
        first_fresh = tl.minimum(first_fresh, tl.min(tl.where(f, i, rows), axis=0))
        first_moved = tl.minimum(first_moved, tl.min(tl.where(mv, i, rows), axis=0))
    n_sent = n_fresh + n_moved
    first = tl.where(n_fresh > 0, first_fresh, tl.where(n_moved > 0, first_moved, 0))
    first_id = tl.load(uid_ptr + base + first, mask=rows > 0, other=0)
    seen_fresh = tl.zeros((), dtype=tl.int64)
    seen_moved = tl.zeros((), dtype=tl.int64)
    seen_rest = tl.zeros((), dtype=tl.int64)
    for k in range(0, rows, CHUNK):
        i = (k + tl.arange(0, CHUNK)).to(tl.int64)
        m = i < rows
        h, mv, f = _row_flags(valid_ptr, held_ptr, moved_ptr, base + i, m)
        rest = m & (f == 0) & (mv == 0)
        f64, mv64, rest64 = f.to(tl.int64), mv.to(tl.int64), rest.to(tl.int64)
        at_fresh = seen_fresh + tl.cumsum(f64, axis=0) - 1
        at_moved = n_fresh + seen_moved + tl.cumsum(mv64, axis=0) - 1
        at_rest = n_sent + seen_rest + tl.cumsum(rest64, axis=0) - 1
        pos = tl.where(f, at_fresh, tl.where(mv, at_moved, at_rest))
        sent = f | mv
        tl.store(place_ptr + base + i, pos, mask=m)
        tl.store(order_ptr + base + pos, tl.where(sent, i, first), mask=m)
        tl.store(sending_ptr + base + pos, sent, mask=m)
        uid = tl.load(uid_ptr + base + i, mask=m, other=0)
        tl.store(ids_ptr + base + pos, tl.where(n_sent == 0, -1, tl.where(sent, uid, first_id)), mask=m)
        seen_fresh += tl.sum(f64, axis=0)
        seen_moved += tl.sum(mv64, axis=0)
        seen_rest += tl.sum(rest64, axis=0)
    tl.store(empty_ptr + b, n_sent == 0)
    tl.store(n_held_ptr + b, n_held)


def row_layout(
    valid: torch.Tensor, held: torch.Tensor, moved: torch.Tensor, uid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`row_reference.row_layout`: one program per block."""
    n, rows = valid.shape
    fresh, sending = torch.empty_like(valid), torch.empty_like(valid)
    order = torch.empty(n, rows, dtype=torch.int64, device=valid.device)
    place = torch.empty_like(order)
    empty = torch.empty(n, dtype=torch.bool, device=valid.device)
    n_held = torch.empty(n, dtype=torch.int64, device=valid.device)
    ids = torch.empty_like(uid)
    if n:
        row_layout_kernel[(n,)](
            valid.contiguous(), held.contiguous(), moved.contiguous(), uid.contiguous(), rows, fresh, order, place,
            sending, empty, n_held, ids, CHUNK=LAYOUT_CHUNK, **_LAUNCH,
        )  # fmt: skip
    return fresh, order, place, sending, empty, n_held, ids


MERGE_ROWS = 32  # unique ids (and chunk rows) per program of row_merge_kernel
MERGE_COLS = 64  # columns per step


@triton.jit
def row_merge_kernel(
    dec_ptr, dec_s0, dec_s1, place_ptr, fresh_ptr, moved_ptr, table_ptr, rows_ptr, delta_ptr, inv_ptr,
    unique_ptr, spread_ptr, n_blocks, q, n_rows, width, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Program (k, t), block k (:func:`row_reference.row_merge`): unique ids ``t * ROWS ..`` merged
    into ``unique``, and chunk rows ``t * ROWS ..`` (each its unique id's row, merged again: the
    same bits) into ``spread``."""
    k = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    d = tl.load(delta_ptr + k) != 0
    for role in tl.static_range(2):
        if role == 0:
            rm = r < q
            u = r
        else:
            rm = r < n_rows
            u = tl.load(inv_ptr + k * n_rows + r, mask=rm, other=0)
        p = tl.load(place_ptr + k * q + u, mask=rm, other=0)
        f = tl.load(fresh_ptr + k * q + u, mask=rm, other=0) != 0
        mv = tl.load(moved_ptr + k * q + u, mask=rm, other=0) != 0
        row = tl.load(rows_ptr + k * q + u, mask=rm, other=0)
        for c0 in range(0, width, COLS):
            c = c0 + tl.arange(0, COLS).to(tl.int64)
            m2 = rm[:, None] & (c < width)[None, :]
            got = tl.load(dec_ptr + p[:, None] * dec_s0 + k * dec_s1 + c[None, :], mask=m2, other=0.0)
            cached = tl.load(table_ptr + row[:, None] * width + c[None, :], mask=m2, other=0.0)
            moved_row = tl.where(d, cached + got, got)
            val = tl.where(f[:, None], got, tl.where(mv[:, None], moved_row, cached))
            if role == 0:
                tl.store(unique_ptr + (k * q + r)[:, None] * width + c[None, :], val, mask=m2)
            else:
                tl.store(spread_ptr + (r * n_blocks + k)[:, None] * width + c[None, :], val, mask=m2)


def row_merge(
    decoded: torch.Tensor, place: torch.Tensor, fresh: torch.Tensor, moved: torch.Tensor, table: torch.Tensor,
    rows: torch.Tensor, delta: torch.Tensor, inverse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Kernel version of :func:`row_reference.row_merge`: one launch, programs per block and tile of rows."""
    n_blocks, q = place.shape
    n_rows, width = inverse.shape[1], table.shape[1]
    unique = table.new_empty(n_blocks, q, width)
    spread = table.new_empty(n_rows, n_blocks, width)
    if decoded.stride(2) != 1:
        decoded = decoded.contiguous()
    tiles = triton.cdiv(max(q, n_rows), MERGE_ROWS)
    if n_blocks and tiles and width:
        row_merge_kernel[(n_blocks, tiles)](
            decoded, decoded.stride(0), decoded.stride(1), place.contiguous(), fresh.contiguous(), moved.contiguous(),
            table.contiguous(), rows.contiguous(), delta.contiguous(), inverse.contiguous(), unique, spread, n_blocks,
            q, n_rows, width, ROWS=MERGE_ROWS, COLS=MERGE_COLS, **_LAUNCH,
        )  # fmt: skip
    return unique, spread


FIND_BLOCK = 1024  # ids per program of row_find_kernel


@triton.jit
def row_find_kernel(
    index_ptr, index_s0, m, steps, ids_ptr, ids_s0, ids_s1, first_ptr, counts_ptr, n, q, bits,
    uid_ptr, valid_ptr, rows_ptr, held_ptr, keys_ptr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Unique ids ``pid * BLOCK ..`` of every block's [n_blocks, q] (:func:`row_reference.row_find`):
    each key's lower bound in the index's ascending keys (``steps`` halvings: its last key is
    past every key), and whether it is the key."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < n
    k, u = i // q, i % q
    row_of = tl.load(first_ptr + i, mask=mask, other=0)
    uid = tl.load(ids_ptr + row_of * ids_s0 + k * ids_s1, mask=mask, other=0)
    valid = u < tl.load(counts_ptr + k, mask=mask, other=0)
    key = uid.to(tl.int64) | (k << bits)
    lo = tl.zeros((BLOCK,), dtype=tl.int64)
    hi = tl.zeros((BLOCK,), dtype=tl.int64) + (m - 1)
    for _ in range(steps):
        mid = (lo + hi) >> 1
        below = tl.load(index_ptr + mid, mask=mask, other=0) < key
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    got = tl.load(index_ptr + lo, mask=mask, other=0)
    row = tl.load(index_ptr + index_s0 + lo, mask=mask, other=0)
    held = (got == key) & valid
    tl.store(uid_ptr + i, uid, mask=mask)
    tl.store(valid_ptr + i, valid, mask=mask)
    tl.store(rows_ptr + i, tl.where(held, row, 0), mask=mask)
    tl.store(held_ptr + i, held, mask=mask)
    tl.store(keys_ptr + i, key, mask=mask)


def row_find(
    index: torch.Tensor, ids: torch.Tensor, first: torch.Tensor, counts: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`row_reference.row_find`: one launch."""
    uid = torch.empty(first.shape, dtype=ids.dtype, device=first.device)
    rows, keys = torch.empty_like(first), torch.empty_like(first)
    valid = torch.empty(first.shape, dtype=torch.bool, device=first.device)
    held = torch.empty_like(valid)
    n, m = first.numel(), index.shape[1]
    if n:
        assert index.stride(1) == 1
        row_find_kernel[(triton.cdiv(n, FIND_BLOCK),)](
            index, index.stride(0), m, max(m - 1, 0).bit_length() + 1, ids, ids.stride(0), ids.stride(1),
            first.contiguous(), counts.contiguous(), n, first.shape[1], bits, uid, valid, rows, held, keys,
            BLOCK=FIND_BLOCK, **_LAUNCH,
        )  # fmt: skip
    return uid, valid, rows, held, keys


CLASSIFY_ROWS = 32  # unique ids per program of row_classify_kernel
CLASSIFY_COLS = 64  # columns per step


@triton.jit
def _chunk_rows(x_ptr, xs0, xs1, first_ptr, table_ptr, rows_ptr, k, q, u, um, c, width):
    """Block k's unique ids ``u``: their chunk rows' columns ``c`` (exact) and their held rows'."""
    m2 = um[:, None] & (c < width)[None, :]
    fi = tl.load(first_ptr + k * q + u, mask=um, other=0)
    ri = tl.load(rows_ptr + k * q + u, mask=um, other=0)
    exact = tl.load(x_ptr + fi[:, None] * xs0 + k * xs1 + c[None, :], mask=m2, other=0.0)
    cached = tl.load(table_ptr + ri[:, None] * width + c[None, :], mask=m2, other=0.0)
    return exact, cached, m2


@triton.jit
def row_classify_kernel(
    x_ptr, xs0, xs1, first_ptr, table_ptr, rows_ptr, held_ptr, bounds_ptr, q, width, n_tiles,
    moved_ptr, part_ptr, big_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Program (k, t): block k's unique ids ``t * ROWS ..`` (:func:`row_reference.row_classify`):
    which held ones moved, and the tile's held and hit counts and largest moved magnitude (NaN
    where one is NaN: maxima here drop NaN, so it is carried apart)."""
    k = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    u = t * ROWS + tl.arange(0, ROWS).to(tl.int64)
    um = u < q
    bound = tl.load(bounds_ptr + k).to(tl.float32)
    within = um
    big = tl.full((ROWS,), float("-inf"), tl.float32)
    nan = tl.zeros((ROWS,), dtype=tl.int1)
    for c0 in range(0, width, COLS):
        c = c0 + tl.arange(0, COLS).to(tl.int64)
        exact, cached, m2 = _chunk_rows(x_ptr, xs0, xs1, first_ptr, table_ptr, rows_ptr, k, q, u, um, c, width)
        ok = (tl.abs(exact - cached) <= bound) | ~m2
        within = within & (tl.min(ok.to(tl.int32), axis=1) == 1)
        a = tl.maximum(tl.abs(exact), tl.abs(cached))
        is_nan = (exact != exact) | (cached != cached)
        nan = nan | (tl.max((is_nan & m2).to(tl.int32), axis=1) == 1)
        big = tl.maximum(big, tl.max(tl.where(m2 & ~is_nan, a, float("-inf")), axis=1))
    held = um & (tl.load(held_ptr + k * q + u, mask=um, other=0) != 0)
    hit = held & within
    moved = held & ~within
    tl.store(moved_ptr + k * q + u, moved, mask=um)
    tl.store(part_ptr + (k * n_tiles + t) * 2, tl.sum(held.to(tl.int64), axis=0))
    tl.store(part_ptr + (k * n_tiles + t) * 2 + 1, tl.sum(hit.to(tl.int64), axis=0))
    any_nan = tl.max((moved & nan).to(tl.int32), axis=0) == 1
    largest = tl.max(tl.where(moved, big, float("-inf")), axis=0)
    tl.store(big_ptr + k * n_tiles + t, tl.where(any_nan, float("nan"), largest))


@triton.jit
def row_bounds_kernel(
    part_ptr, big_ptr, n_tiles, bounds_ptr, deltas, scale, held_ptr, hit_ptr, delta_ptr, coded_ptr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Program k: block k's counts from its tiles, and its payload's bound (its room where its
    moved rows travel as differences)."""
    k = tl.program_id(0).to(tl.int64)
    n_held = tl.zeros((), dtype=tl.int64)
    n_hit = tl.zeros((), dtype=tl.int64)
    big = tl.full((), float("-inf"), tl.float32)
    nan = tl.zeros((), dtype=tl.int32)
    for t0 in range(0, n_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK).to(tl.int64)
        m = t < n_tiles
        n_held += tl.sum(tl.load(part_ptr + (k * n_tiles + t) * 2, mask=m, other=0), axis=0)
        n_hit += tl.sum(tl.load(part_ptr + (k * n_tiles + t) * 2 + 1, mask=m, other=0), axis=0)
        b = tl.load(big_ptr + k * n_tiles + t, mask=m, other=float("-inf"))
        nan = tl.maximum(nan, tl.max((b != b).to(tl.int32), axis=0))
        big = tl.maximum(big, tl.max(tl.where(b != b, float("-inf"), b), axis=0))
    largest = tl.where(nan == 1, float("nan"), big).to(tl.float64)
    bound = tl.load(bounds_ptr + k)
    room = bound + scale * largest  # scale * largest is exact (a power of two), one rounding
    delta = (deltas != 0) & (room > 0) & (room < float("inf"))
    tl.store(held_ptr + k, n_held)
    tl.store(hit_ptr + k, n_hit)
    tl.store(delta_ptr + k, delta)
    tl.store(coded_ptr + k, tl.where(delta, room, bound))


def row_classify(
    xp: torch.Tensor, first: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, held: torch.Tensor,
    bounds: torch.Tensor, deltas: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Kernel version of :func:`row_reference.row_classify`: per tile of every block's ids, then per block."""
    from .row_reference import ROOM_SCALE

    n_blocks, q = first.shape
    width = table.shape[1]
    if xp.stride(2) != 1:
        xp = xp.contiguous()
    moved = torch.empty_like(held)
    n_held = torch.empty(n_blocks, dtype=torch.int64, device=held.device)
    n_hit, coded = torch.empty_like(n_held), torch.empty_like(bounds)
    delta = torch.empty(n_blocks, dtype=torch.bool, device=held.device)
    tiles = triton.cdiv(q, CLASSIFY_ROWS)
    part = torch.empty(n_blocks, max(tiles, 1), 2, dtype=torch.int64, device=held.device)
    big = torch.empty(n_blocks, max(tiles, 1), dtype=torch.float32, device=held.device)
    if n_blocks and tiles:
        row_classify_kernel[(n_blocks, tiles)](
            xp, xp.stride(0), xp.stride(1), first.contiguous(), table.contiguous(), rows.contiguous(),
            held.contiguous(), bounds.contiguous(), q, width, tiles, moved, part, big,
            ROWS=CLASSIFY_ROWS, COLS=CLASSIFY_COLS, **_LAUNCH,
        )  # fmt: skip
    if n_blocks:
        row_bounds_kernel[(n_blocks,)](
            part, big, tiles, bounds.contiguous(), int(deltas), ROOM_SCALE, n_held, n_hit, delta, coded,
            CHUNK=1024, **_LAUNCH,
        )  # fmt: skip
    return moved, n_held, n_hit, delta, coded


SENT_ROWS = 32  # payload rows per program of row_sent_kernel
SENT_COLS = 64  # columns per step


@triton.jit
def row_sent_kernel(
    x_ptr, xs0, xs1, first_ptr, table_ptr, rows_ptr, moved_ptr, delta_ptr, order_ptr, empty_ptr, uid_ptr,
    out_ptr, ids_ptr, n_blocks, q, width, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """Program (k, t): block k's payload rows ``t * ROWS ..`` (:func:`row_reference.row_sent`)."""
    k = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    pm = p < q
    empty = tl.load(empty_ptr + k) != 0
    diff = tl.load(delta_ptr + k) != 0
    u = tl.load(order_ptr + k * q + p, mask=pm, other=0)
    as_diff = diff & (tl.load(moved_ptr + k * q + u, mask=pm, other=0) != 0)
    uid = tl.load(uid_ptr + k * q + u, mask=pm, other=0)
    tl.store(ids_ptr + k * q + p, tl.where(empty, -1, uid), mask=pm)
    for c0 in range(0, width, COLS):
        c = c0 + tl.arange(0, COLS).to(tl.int64)
        exact, cached, m2 = _chunk_rows(x_ptr, xs0, xs1, first_ptr, table_ptr, rows_ptr, k, q, u, pm, c, width)
        val = tl.where(as_diff[:, None], exact - cached, exact)
        val = tl.where(empty, 0.0, val)
        tl.store(out_ptr + (p * n_blocks + k)[:, None] * width + c[None, :], val, mask=m2)


def row_sent(
    xp: torch.Tensor, first: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, moved: torch.Tensor,
    delta: torch.Tensor, order: torch.Tensor, empty: torch.Tensor, uid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Kernel version of :func:`row_reference.row_sent`: one launch."""
    n_blocks, q = first.shape
    width = table.shape[1]
    if xp.stride(2) != 1:
        xp = xp.contiguous()
    out = table.new_empty(q, n_blocks, width)
    ids = torch.empty(n_blocks, q, dtype=torch.int64, device=uid.device)
    tiles = triton.cdiv(q, SENT_ROWS)
    if n_blocks and tiles:
        row_sent_kernel[(n_blocks, tiles)](
            xp, xp.stride(0), xp.stride(1), first.contiguous(), table.contiguous(), rows.contiguous(),
            moved.contiguous(), delta.contiguous(), order.contiguous(), empty.contiguous(), uid.contiguous(), out, ids,
            n_blocks, q, width, ROWS=SENT_ROWS, COLS=SENT_COLS, **_LAUNCH,
        )  # fmt: skip
    return out, ids


MOVED_BLOCK = 1024  # held flags per program of the row_moved kernels


@triton.jit
def held_counts_kernel(held_ptr, n, counts_ptr, BLOCK: tl.constexpr):
    """Program t: the held ids among ``t * BLOCK ..``."""
    t = tl.program_id(0).to(tl.int64)
    i = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    h = tl.load(held_ptr + i, mask=i < n, other=0) != 0
    tl.store(counts_ptr + t, tl.sum(h.to(tl.int64), axis=0))


@triton.jit
def row_moved_kernel(
    held_ptr, n, counts_ptr, pay_ptr, pay_n, lengths_at, head, skip, out_ptr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program t (:func:`row_reference.row_moved`): the held ids before its tile counted, each held
    id's rank and its bit in the payload."""
    t = tl.program_id(0).to(tl.int64)
    before = tl.zeros((), dtype=tl.int64)
    for t0 in range(0, t, BLOCK):
        j = t0 + tl.arange(0, BLOCK).to(tl.int64)
        before += tl.sum(tl.load(counts_ptr + j, mask=j < t, other=0), axis=0)
    b = tl.arange(0, 8).to(tl.int64)
    raw = tl.load(pay_ptr + lengths_at + b, mask=lengths_at + b < pay_n, other=0).to(tl.int64)
    length = tl.sum(raw << (8 * b), axis=0)
    start = head + ((length + 7) & -8)
    i = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < n
    h = m & (tl.load(held_ptr + i, mask=m, other=0) != 0)
    rank = before + tl.cumsum(h.to(tl.int64), axis=0) - 1
    at = tl.minimum(tl.maximum(start + skip + (rank >> 3), 0), tl.maximum(pay_n - 1, 0))
    byte = tl.load(pay_ptr + at, mask=h, other=0).to(tl.int64)
    bit = (byte >> (7 - (rank & 7))) & 1
    tl.store(out_ptr + i, h & (bit != 0), mask=m)


def row_moved(payload: torch.Tensor, held: torch.Tensor, lengths_at: int, head: int, skip: int) -> torch.Tensor:
    """Kernel version of :func:`row_reference.row_moved`: held counts per tile, then ranks and bits."""
    out = torch.empty_like(held)
    n = held.numel()
    tiles = triton.cdiv(n, MOVED_BLOCK)
    if n:
        held = held.contiguous()
        counts = torch.empty(tiles, dtype=torch.int64, device=held.device)
        held_counts_kernel[(tiles,)](held, n, counts, BLOCK=MOVED_BLOCK, **_LAUNCH)
        row_moved_kernel[(tiles,)](
            held, n, counts, payload, payload.numel(), lengths_at, head, skip, out, BLOCK=MOVED_BLOCK, **_LAUNCH
        )
    return out


@triton.jit
def row_bits_kernel(
    held_ptr, moved_ptr, n, n_pad, counts_ptr, tiles, bits_ptr, bytes_ptr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program t (:func:`row_reference.row_bits`): its held ids' moved flags at their ranks, and zeros
    past the last rank over its part of the bits; program 0 also the bytes they take."""
    t = tl.program_id(0).to(tl.int64)
    before = tl.zeros((), dtype=tl.int64)
    total = tl.zeros((), dtype=tl.int64)
    for t0 in range(0, tiles, BLOCK):
        j = t0 + tl.arange(0, BLOCK).to(tl.int64)
        c = tl.load(counts_ptr + j, mask=j < tiles, other=0)
        before += tl.sum(tl.where(j < t, c, 0), axis=0)
        total += tl.sum(c, axis=0)
    i = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < n
    h = m & (tl.load(held_ptr + i, mask=m, other=0) != 0)
    rank = before + tl.cumsum(h.to(tl.int64), axis=0) - 1
    mv = tl.load(moved_ptr + i, mask=h, other=0) != 0
    tl.store(bits_ptr + rank, mv.to(tl.uint8), mask=h)
    tl.store(bits_ptr + i, tl.zeros((BLOCK,), dtype=tl.uint8), mask=(i >= total) & (i < n_pad))
    if t == 0:
        tl.store(bytes_ptr, (total + 7) // 8)


@triton.jit
def bits_pack8_kernel(bits_ptr, n_bytes, out_ptr, BLOCK: tl.constexpr):
    """Program t: bytes ``t * BLOCK ..`` of 0/1 ``bits``, most significant first."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = j < n_bytes
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for b in tl.static_range(8):
        acc = acc | (tl.load(bits_ptr + j * 8 + b, mask=m, other=0).to(tl.int32) << (7 - b))
    tl.store(out_ptr + j, acc.to(tl.uint8), mask=m)


def row_bits(held: torch.Tensor, moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel version of :func:`row_reference.row_bits`: held per tile, the bits at their ranks, packed."""
    n = held.numel()
    n_pad = n + -n % 8
    packed = torch.empty(n_pad // 8, dtype=torch.uint8, device=held.device)
    if not n:
        return packed, torch.zeros((), dtype=torch.int64, device=held.device)
    held, moved = held.contiguous(), moved.contiguous()
    tiles = triton.cdiv(n, MOVED_BLOCK)
    counts = torch.empty(tiles, dtype=torch.int64, device=held.device)
    bits = torch.empty(n_pad, dtype=torch.uint8, device=held.device)
    n_bytes = torch.empty((), dtype=torch.int64, device=held.device)
    held_counts_kernel[(tiles,)](held, n, counts, BLOCK=MOVED_BLOCK, **_LAUNCH)
    row_bits_kernel[(tiles,)](held, moved, n, n_pad, counts, tiles, bits, n_bytes, BLOCK=MOVED_BLOCK, **_LAUNCH)
    bits_pack8_kernel[(triton.cdiv(n_pad // 8, 1024),)](bits, n_pad // 8, packed, BLOCK=1024, **_LAUNCH)
    return packed, n_bytes
