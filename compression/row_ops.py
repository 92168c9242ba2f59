"""The row cache's device operations (``compression.forward.cache``), each one dispatcher op as
:mod:`compression.ops`' are: a torch reference for CPU tensors (:mod:`compression.row_reference`)
and Triton kernels for CUDA ones (:mod:`compression.row_kernels`), their launches in
:data:`compression.ops.LAUNCHES`. A chunk's lookup, classification, payload layout and rows,
bits and merge, every block at once."""

from __future__ import annotations

import torch
from torch.library import custom_op

from . import row_reference
from .ops import LAUNCHES, _cpu


def _row_kernels():
    from . import row_kernels  # imports triton: only where a CUDA tensor needs it

    return row_kernels


@custom_op("dlrm_compression::row_layout", mutates_args=())
@_cpu
def row_layout(
    valid: torch.Tensor, held: torch.Tensor, moved: torch.Tensor, uid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_reference.row_layout`: every block's fresh rows, payload order, places and ids, no
    host wait."""
    return row_reference.row_layout(valid, held, moved, uid)


@row_layout.register_kernel("cuda")
def _(valid, held, moved, uid):
    return _row_kernels().row_layout(valid, held, moved, uid)


@row_layout.register_fake
def _(valid, held, moved, uid):
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


LAUNCHES["row_layout"] = lambda valid, held, moved, uid: 1 if valid.shape[0] else 0  # one program per block


@custom_op("dlrm_compression::row_merge", mutates_args=())
@_cpu
def row_merge(
    decoded: torch.Tensor,
    place: torch.Tensor,
    fresh: torch.Tensor,
    moved: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    delta: torch.Tensor,
    inverse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_reference.row_merge`: a chunk's unique rows as both ends hold them, and its rows."""
    return row_reference.row_merge(decoded, place, fresh, moved, table, rows, delta, inverse)


@row_merge.register_kernel("cuda")
def _(decoded, place, fresh, moved, table, rows, delta, inverse):
    return _row_kernels().row_merge(decoded, place, fresh, moved, table, rows, delta, inverse)


@row_merge.register_fake
def _(decoded, place, fresh, moved, table, rows, delta, inverse):
    n_blocks, q = place.shape
    width = table.shape[1]
    return table.new_empty(n_blocks, q, width), table.new_empty(inverse.shape[1], n_blocks, width)


LAUNCHES["row_merge"] = lambda decoded, place, *rest: 1 if place.numel() else 0  # the unique rows and the chunk's


@custom_op("dlrm_compression::row_find", mutates_args=())
@_cpu
def row_find(
    index: torch.Tensor, ids: torch.Tensor, first: torch.Tensor, counts: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_reference.row_find`: every block's unique ids looked up in a row cache's index."""
    return row_reference.row_find(index, ids, first, counts, bits)


@row_find.register_kernel("cuda")
def _(index, ids, first, counts, bits):
    return _row_kernels().row_find(index, ids, first, counts, bits)


@row_find.register_fake
def _(index, ids, first, counts, bits):
    rows = torch.empty_like(first)
    held = first.new_empty(first.shape, dtype=torch.bool)
    return first.new_empty(first.shape, dtype=ids.dtype), torch.empty_like(held), rows, held, torch.empty_like(rows)


LAUNCHES["row_find"] = lambda index, ids, first, *rest: 1 if first.numel() else 0  # a binary search per id


@custom_op("dlrm_compression::row_classify", mutates_args=())
@_cpu
def row_classify(
    xp: torch.Tensor,
    first: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    held: torch.Tensor,
    bounds: torch.Tensor,
    deltas: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_reference.row_classify`: a chunk's held rows classified, every block's counts and bound."""
    return row_reference.row_classify(xp, first, table, rows, held, bounds, deltas)


@row_classify.register_kernel("cuda")
def _(xp, first, table, rows, held, bounds, deltas):
    return _row_kernels().row_classify(xp, first, table, rows, held, bounds, deltas)


@row_classify.register_fake
def _(xp, first, table, rows, held, bounds, deltas):
    n = first.shape[0]
    counts = first.new_empty(n)
    return torch.empty_like(held), counts, torch.empty_like(counts), held.new_empty(n), bounds.new_empty(n)


LAUNCHES["row_classify"] = lambda xp, first, *rest: 2 if first.shape[0] else 0  # per tile of ids, per block


@custom_op("dlrm_compression::row_sent", mutates_args=())
@_cpu
def row_sent(
    xp: torch.Tensor,
    first: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    moved: torch.Tensor,
    delta: torch.Tensor,
    order: torch.Tensor,
    empty: torch.Tensor,
    uid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_reference.row_sent`: a row cache sender's payload rows and their ids."""
    return row_reference.row_sent(xp, first, table, rows, moved, delta, order, empty, uid)


@row_sent.register_kernel("cuda")
def _(xp, first, table, rows, moved, delta, order, empty, uid):
    return _row_kernels().row_sent(xp, first, table, rows, moved, delta, order, empty, uid)


@row_sent.register_fake
def _(xp, first, table, rows, moved, delta, order, empty, uid):
    n, q = first.shape
    return table.new_empty(q, n, table.shape[1]), torch.empty_like(uid)


LAUNCHES["row_sent"] = lambda xp, first, *rest: 1 if first.numel() else 0


@custom_op("dlrm_compression::row_moved", mutates_args=())
@_cpu
def row_moved(payload: torch.Tensor, held: torch.Tensor, lengths_at: int, head: int, skip: int) -> torch.Tensor:
    """:func:`row_reference.row_moved`: a row cache receiver's moved ids from its payload's bits."""
    return row_reference.row_moved(payload, held, lengths_at, head, skip)


@row_moved.register_kernel("cuda")
def _(payload, held, lengths_at, head, skip):
    return _row_kernels().row_moved(payload, held, lengths_at, head, skip)


@row_moved.register_fake
def _(payload, held, lengths_at, head, skip):
    return torch.empty_like(held)


LAUNCHES["row_moved"] = lambda payload, held, *rest: 2 if held.numel() else 0  # held per tile; ranks and bits


@custom_op("dlrm_compression::row_bits", mutates_args=())
@_cpu
def row_bits(held: torch.Tensor, moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_reference.row_bits`: a row cache sender's moved bits of its held ids, packed."""
    return row_reference.row_bits(held, moved)


@row_bits.register_kernel("cuda")
def _(held, moved):
    return _row_kernels().row_bits(held, moved)


@row_bits.register_fake
def _(held, moved):
    n = held.numel()
    return held.new_empty((n + -n % 8) // 8, dtype=torch.uint8), held.new_empty((), dtype=torch.int64)


LAUNCHES["row_bits"] = lambda held, moved: 3 if held.numel() else 1  # held per tile; bits at ranks; pack
