"""The row cache's device operations (``compression.forward.cache``), each one dispatcher op as
:mod:`compression.ops`' are: a torch reference for CPU tensors (:mod:`compression.row_reference`)
and Triton kernels for CUDA ones (:mod:`compression.row_kernels`), their launches in
:data:`compression.ops.LAUNCHES`. A chunk's lookup, classification, payload layout and rows,
bits and merge, every block at once."""

from __future__ import annotations

import functools

import torch

from . import row_reference
from .ops import _fused


def _row_kernels():
    from . import row_kernels  # imports triton: only where a CUDA tensor needs it

    return row_kernels


_row_op = functools.partial(_fused, kernels=_row_kernels)


def _row_layout_fake(valid, held, moved, uid):
    n, q = valid.shape
    index = valid.new_empty((n, q), dtype=torch.int64)
    flags = torch.empty_like(valid)
    return (
        flags,
        index,
        torch.empty_like(index),
        torch.empty_like(valid),
        valid.new_empty(n),
        index.new_empty(n),
        torch.empty_like(uid),
    )


# :func:`row_reference.row_layout`: every block's fresh rows, payload order, places and ids, no host
# wait; one program per block.
row_layout = _row_op(
    row_reference.row_layout, lambda valid, held, moved, uid: 1 if valid.shape[0] else 0, _row_layout_fake
)


def _row_merge_fake(decoded, place, fresh, moved, table, rows, delta, inverse):
    n_blocks, q = place.shape
    width = table.shape[1]
    return table.new_empty(n_blocks, q, width), table.new_empty(inverse.shape[1], n_blocks, width)


# :func:`row_reference.row_merge`: a chunk's unique rows as both ends hold them, and its rows (one
# launch: the unique rows and the chunk's).
row_merge = _row_op(row_reference.row_merge, lambda decoded, place, *rest: 1 if place.numel() else 0, _row_merge_fake)


def _row_find_fake(index, ids, first, counts, bits):
    rows = torch.empty_like(first)
    held = first.new_empty(first.shape, dtype=torch.bool)
    return first.new_empty(first.shape, dtype=ids.dtype), torch.empty_like(held), rows, held, torch.empty_like(rows)


# :func:`row_reference.row_find`: every block's unique ids looked up in a row cache's index; a
# binary search per id.
row_find = _row_op(row_reference.row_find, lambda index, ids, first, *rest: 1 if first.numel() else 0, _row_find_fake)


def _row_classify_fake(xp, first, table, rows, held, bounds, deltas):
    n = first.shape[0]
    counts = first.new_empty(n)
    return torch.empty_like(held), counts, torch.empty_like(counts), held.new_empty(n), bounds.new_empty(n)


# :func:`row_reference.row_classify`: a chunk's held rows classified, every block's counts and bound;
# launches per tile of ids, per block.
row_classify = _row_op(
    row_reference.row_classify, lambda xp, first, *rest: 2 if first.shape[0] else 0, _row_classify_fake
)


def _row_sent_fake(xp, first, table, rows, moved, delta, order, empty, uid):
    n, q = first.shape
    return table.new_empty(q, n, table.shape[1]), torch.empty_like(uid)


# :func:`row_reference.row_sent`: a row cache sender's payload rows and their ids.
row_sent = _row_op(row_reference.row_sent, lambda xp, first, *rest: 1 if first.numel() else 0, _row_sent_fake)


def _row_moved_fake(payload, held, lengths_at, head, skip):
    return torch.empty_like(held)


# :func:`row_reference.row_moved`: a row cache receiver's moved ids from its payload's bits;
# launches: held per tile; ranks and bits.
row_moved = _row_op(row_reference.row_moved, lambda payload, held, *rest: 2 if held.numel() else 0, _row_moved_fake)


def _row_bits_fake(held, moved):
    n = held.numel()
    return held.new_empty((n + -n % 8) // 8, dtype=torch.uint8), held.new_empty((), dtype=torch.int64)


# :func:`row_reference.row_bits`: a row cache sender's moved bits of its held ids, packed; launches:
# held per tile; bits at ranks; pack.
row_bits = _row_op(row_reference.row_bits, lambda held, moved: 3 if held.numel() else 1, _row_bits_fake)
