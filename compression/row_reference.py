"""Torch references of the row cache's device operations (:mod:`compression.row_ops`): what
``compression.forward.cache`` computed op by op before they were fused, bit for bit the same
(their CPU implementations, and the kernels' tests' expectation)."""

from __future__ import annotations

import math

import torch


def row_layout(
    valid: torch.Tensor, held: torch.Tensor, moved: torch.Tensor, uid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row cache's payload layout of every block's unique ids (bool ``valid``, ``held``,
    ``moved`` [n_blocks, q], moved ones held, held ones valid): (fresh: valid and not held; order:
    each payload row's unique id, fresh ones then moved ones, each ascending, then past the sent
    rows the block's first; place: each unique id's payload row, hits and padding past the sent
    rows in ascending order; sending: the payload rows that are sent; empty [n_blocks]: blocks that
    send none; n_held [n_blocks]; ids: ``uid`` in payload order, -1 for an empty block). One
    stable sort of the kinds (fresh 2, moved 1, else 0), descending."""
    fresh = valid ^ held
    kind, order = torch.sort(moved.to(torch.int8).add_(fresh, alpha=2), dim=1, descending=True, stable=True)
    column = torch.arange(order.shape[1], device=order.device).expand_as(order)
    place = torch.empty_like(order).scatter_(1, order, column)
    sending = kind > 0
    order = torch.where(sending, order, order[:, :1])
    empty = kind[:, 0] == 0 if kind.shape[1] else torch.ones(kind.shape[0], dtype=torch.bool, device=kind.device)
    ids = uid.gather(1, order).masked_fill_(empty[:, None], -1)
    return fresh, order, place, sending, empty, held.sum(1), ids


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
    """Every block's unique rows as both ends of a row cache hold them after a chunk, and the
    chunk's rows: (unique [n_blocks, q, width]: ``decoded`` [n, n_blocks, width]'s payload row
    at ``place`` for fresh ids, the held row (``table``'s at ``rows``) plus it for moved ones
    (the row itself where the block's ``delta`` is 0), the held row for the rest; each chunk row
    r of block k, ``unique[k, inverse[k, r]]``, as [chunk rows, n_blocks, width])."""
    n_blocks, q = place.shape
    width = table.shape[1]
    cached = table.index_select(0, rows.reshape(-1)).view(n_blocks, q, width)
    got = decoded.transpose(0, 1).gather(1, place[..., None].expand(-1, -1, width))
    moved_rows = torch.where(delta[:, None, None], cached + got, got)
    unique = torch.where(fresh[..., None], got, torch.where(moved[..., None], moved_rows, cached))
    spread = unique[torch.arange(n_blocks, device=unique.device)[None, :], inverse.t()].contiguous()
    return unique, spread


ROOM_SCALE = -4 * float(torch.finfo(torch.float32).eps)  # a moved block's room: its bound less 4 eps x its largest


def row_find(
    index: torch.Tensor, ids: torch.Tensor, first: torch.Tensor, counts: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row cache's lookup of every block's unique ids, at capacity: block k's u-th is the id
    of ``ids`` [rows, n_blocks] at row ``first[k, u]``, valid for u below ``counts[k]``; its key
    (the block's index in the ``bits`` above it) is searched in ``index`` [2, m] (keys ascending,
    then a key past every key; each key's row): (uid [n_blocks, q], valid, rows: the row holding
    each, 0 where not held or valid, held, keys)."""
    uid = ids.t().gather(1, first)
    valid = torch.arange(first.shape[1], device=first.device) < counts[:, None]
    key = uid | (torch.arange(first.shape[0], dtype=torch.int64, device=uid.device) << bits)[:, None]
    got = index.index_select(1, torch.searchsorted(index[0], key.reshape(-1))).view(2, *key.shape)
    held = (got[0] == key) & valid
    return uid, valid, got[1] * held, held, key


def row_classify(
    xp: torch.Tensor,
    first: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    held: torch.Tensor,
    bounds: torch.Tensor,
    deltas: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row cache sender's view of a chunk ``xp`` [chunk rows, n_blocks, width] at every block's
    unique ids (each at its chunk row ``first`` [n_blocks, q], held at ``table``'s ``rows`` where
    ``held``): (moved: held, and past the block's float64 ``bounds`` (compared in fp32) of the
    held row, NaN never within; n_held, n_hit [n_blocks]; delta: whether the block's moved rows
    travel as differences (``deltas``, some moved, and room left: its bound less ``4 eps`` times
    the largest magnitude of its moved rows, exact or held, positive and finite); coded: the
    block's bound in its payload (its room where delta))."""
    n_blocks, q = first.shape
    exact = xp[first, torch.arange(n_blocks, device=xp.device)[:, None]]
    cached = table.index_select(0, rows.reshape(-1)).view(n_blocks, q, table.shape[1])
    diff = exact - cached
    hit = held & (diff.abs() <= bounds.float()[:, None, None]).all(2)
    moved = held ^ hit
    if q:  # the largest magnitude of each block's moved rows, exact or held (NaN kept; -inf: none)
        both = torch.where(moved[..., None, None], torch.stack([exact, cached], 2).abs_(), -math.inf)
        largest = both.amax((1, 2, 3)).double()
    else:
        largest = bounds.new_full(bounds.shape, -math.inf)
    room = torch.add(bounds, largest, alpha=ROOM_SCALE)  # (no moved rows: inf)
    delta = room.nan_to_num(0.0, -1.0) > 0 if deltas else torch.zeros(n_blocks, dtype=torch.bool, device=xp.device)
    return moved, held.sum(1), hit.sum(1), delta, torch.where(delta, room, bounds)


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
    """A row cache sender's payload rows and their ids: (rows [q, n_blocks, width]: block k's
    unique id ``order[k, p]``'s row of ``xp`` at p (:func:`row_classify`'s), less its held row
    where it moved and the block's ``delta``; 0 for an ``empty`` block; ids [n_blocks, q]: the
    ids ``uid`` in that order, -1 for an empty block)."""
    n_blocks, q = first.shape
    exact = xp[first, torch.arange(n_blocks, device=xp.device)[:, None]]
    cached = table.index_select(0, rows.reshape(-1)).view(n_blocks, q, table.shape[1])
    values = torch.where((moved & delta[:, None])[..., None], exact - cached, exact)
    values = values.gather(1, order[..., None].expand(-1, -1, values.shape[2])).masked_fill_(empty[:, None, None], 0.0)
    return values.transpose(0, 1).contiguous(), uid.gather(1, order).masked_fill_(empty[:, None], -1)


def row_moved(payload: torch.Tensor, held: torch.Tensor, lengths_at: int, head: int, skip: int) -> torch.Tensor:
    """A row cache receiver's moved ids (bool, ``held``'s shape): each held id's bit (1: moved),
    the held ids in order one bit each, most significant first, ``skip`` bytes into the second
    section of a format ``payload`` (its first section's length the int64 at ``lengths_at``, its
    sections aligned to 8 bytes after ``head`` bytes; reads past the end repeat the last byte)."""
    n = held.numel()
    lengths = payload[lengths_at : lengths_at + 8].clone().view(torch.int64)
    start = head + ((lengths + 7) & -8)
    where = (start + torch.arange(skip + (n + 7) // 8, device=payload.device)).clamp(0, max(payload.numel() - 1, 0))
    tail = payload.index_select(0, where)[skip:]
    masks = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=payload.device)
    bits = ((tail.unsqueeze(1) & masks) != 0).reshape(-1)[:n]
    at = held.reshape(-1).cumsum(0)  # a held id's rank (1-based): its bit after a leading 0
    return torch.nn.functional.pad(bits, (1, 0)).index_select(0, at).view_as(held) & held


def row_bits(held: torch.Tensor, moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row cache sender's bits: each ``held`` id's ``moved`` flag, the held ids in order, packed
    most significant bit first at capacity (``held.numel()`` bits, rounded up to bytes), and the
    bytes they take (int64 0-d)."""
    n = held.numel()
    at = held.reshape(-1).cumsum(0)  # a held id's bit at its rank (1-based); the rest add nothing
    bits = torch.zeros(n + 8, dtype=torch.uint8, device=held.device)
    bits.scatter_add_(0, at, moved.reshape(-1).view(torch.uint8))
    shifts = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device=held.device)
    packed = (bits[1 : 1 + n + -n % 8].view(-1, 8) << shifts).sum(1, dtype=torch.uint8)
    return packed, (at[-1] + 7) // 8 if n else at.new_zeros(())
