"""Dedup stage: the unique rows of each column block, by id (exact by contract) or by value.

Unique rows of a block are listed in canonical key order (ascending id, or ascending row hash),
blocks one after another. A receiver that knows the ids rebuilds the row -> unique mapping
itself, so only the per-block counts travel; in value mode the mapping (the index) travels too.

A caller that already sorted the ids (e.g. the ids codec of the same batch) attaches its result
to the ids tensor (:func:`with_known_plan`); every plan of those ids is then taken from it with
no sort (a slice or copy of the tensor carries none: it is sorted again). Rows laid out at a
capacity, each block's distinct rows first and the rest repeating its first, take their
positions as ids (:func:`position_ids`), whose plan both ends know from the counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple, overload

import numpy as np
import torch

from . import ops, reference

NONE, IDS, VALUE = 0, 1, 2
_HASH_SEED = 0x5EED


@dataclass
class Plan:
    """Where each unique row comes from and where each (block, row) goes back to."""

    mode: int
    counts: torch.Tensor  # int64 [n_blocks]: unique rows per block
    first: torch.Tensor  # int64 [U]: a source row of each unique row, block-major
    inverse: torch.Tensor | None  # int64 [n_blocks, rows]: index within the block; None = identity


_KNOWN = "_dedup_known_plan"  # the attribute of an ids tensor that holds its known plan


def with_known_plan(keys: torch.Tensor, counts: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Attach to ``keys`` [rows, n_blocks] (and return it) what a caller already computed for
    exactly these keys: per block the number of distinct keys ``counts`` [n_blocks] and each
    row's index among them in ascending order, ``inverse`` [n_blocks, rows]."""
    rows, nb = keys.shape
    if tuple(counts.shape) != (nb,) or tuple(inverse.shape) != (nb, rows):
        shapes = f"counts {tuple(counts.shape)} and inverse {tuple(inverse.shape)}"
        raise ValueError(f"known plan of {shapes} for keys {tuple(keys.shape)}")
    setattr(keys, _KNOWN, (counts, inverse))
    return keys


def known_plan(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (counts, inverse) attached to this very tensor by :func:`with_known_plan`, if any."""
    return getattr(keys, _KNOWN, None)


def first_at_capacity(inverse: torch.Tensor) -> torch.Tensor:
    """[n_blocks, rows]: in slot u of block b, the first row whose index is u (``rows`` in the
    slots past the block's distinct keys), from the inverse alone: no sort, no host wait."""
    nb, rows = inverse.shape
    every = torch.arange(rows, device=inverse.device).expand(nb, rows)
    return torch.full_like(inverse, rows).scatter_reduce_(1, inverse, every, "amin")


@overload
def unique_per_block(
    keys: torch.Tensor, want_first: Literal[True] = ..., numpy: bool = ...
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def unique_per_block(
    keys: torch.Tensor, want_first: bool = ..., numpy: bool = ...
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...
def unique_per_block(
    keys: torch.Tensor, want_first: bool = True, numpy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per column of ``keys`` [rows, n_blocks]: (counts, a source row of each unique key in
    block-major canonical order, inverse [n_blocks, rows] index within the block). ``numpy``:
    the host backend's shortcut, numpy's sorts for CPU tensors (``Backend.numpy_sorts``)."""
    rows, nb = keys.shape
    known = known_plan(keys)
    if known is not None:  # the first row of each distinct key as its source
        counts, inverse = known
        first = None
        if want_first:
            cap = first_at_capacity(inverse)
            first = cap[torch.arange(rows, device=keys.device) < counts[:, None]]
        return counts, first, inverse
    shared = nb == 1 or keys.stride(1) == 0
    host = numpy and keys.device.type == "cpu"
    if shared and not want_first and not host:  # the receiver: a sort, not torch.unique (no host wait)
        counts, _, inverse = _sorted_unique(keys[:, :1].t().contiguous(), False)
        return counts.expand(nb), None, inverse.expand(nb, rows)
    if shared:  # one key column shared by every block: one unique
        uniq, inv = _unique(keys[:, 0], host)
        first = None
        if want_first:
            first = torch.empty_like(uniq).scatter_(0, inv, torch.arange(rows, device=keys.device))
            first = first.repeat(nb) if nb > 1 else first
        counts = torch.full((nb,), uniq.numel(), dtype=torch.int64, device=keys.device)
        return counts, first, inv.expand(nb, rows)
    return _sorted_unique(keys.t().contiguous(), want_first, host)


def _sorted_unique(
    k: torch.Tensor, want_first: bool, host: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`unique_per_block` of ``k`` [n_blocks, rows] by one vectorised sort for every block."""
    perm, new = _sorted_runs(k, host)
    local = new.cumsum(1)
    local -= 1
    inverse = torch.empty_like(local).scatter_(1, perm, local)
    return new.sum(1), perm[new] if want_first else None, inverse


def _sorted_runs(k: torch.Tensor, host: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``k`` sorted: the permutation, and where each new key starts (bool)."""
    s, perm = _sort_rows(k, host)
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return perm, new


def _unique(k: torch.Tensor, host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique values and the inverse index (``host``: numpy's, ~3x torch's on a CPU)."""
    if host:
        uniq, inv = np.unique(k.numpy(), return_inverse=True)
        return torch.from_numpy(uniq), torch.from_numpy(inv.reshape(-1)).long()
    return torch.unique(k, sorted=True, return_inverse=True)


def _sort_rows(k: torch.Tensor, host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row sorted, and the permutation (order among equal keys is unspecified; ``host``:
    numpy's sort)."""
    if host:
        perm = np.argsort(k.numpy(), axis=1)
        return torch.from_numpy(np.take_along_axis(k.numpy(), perm, axis=1)), torch.from_numpy(perm)
    return torch.sort(k, dim=1)


_ID_PLAN = "_dedup_id_plan"  # the attribute of an ids tensor that holds its plan (id_plan)


class IdPlan(NamedTuple):
    """Dedup by id of ``keys`` [rows, n_blocks], at capacity, on their device."""

    counts: torch.Tensor  # int64 [n_blocks]: distinct ids per block
    first: torch.Tensor  # int64 [n_blocks, rows]: slot u's first row (ascending id order; past counts: 0)
    inverse: torch.Tensor  # int64 [n_blocks, rows]: each row's slot
    fingerprint: torch.Tensor  # int64 0-d: the ids' 32-bit weighted sum (reference.fingerprint)


def id_plan(keys: torch.Tensor) -> IdPlan:
    """The plan of ``keys``, made once per ids tensor (a collective's sender and receiver, forward
    and backward, ask for the same ids): one sort (stable: each slot's first row is its id's
    smallest) and one op for the runs (:func:`compression.ops.id_runs`), no host wait; or the
    input codec's plan where it left one (:func:`with_known_plan`). The ids must not change in
    place afterwards."""
    plan = getattr(keys, _ID_PLAN, None)
    if plan is not None:
        return plan
    rows, nb = keys.shape
    known = known_plan(keys)
    if known is not None:
        counts, inverse = known
        cap = first_at_capacity(inverse)
        plan = IdPlan(counts, torch.where(cap < rows, cap, 0), inverse, reference.fingerprint(keys))
    else:
        shared = nb == 1 or keys.stride(1) == 0
        sorted_ids, perm = torch.sort(keys[:, :1].t().contiguous() if shared else keys.t().contiguous(), stable=True)
        counts, first, inverse, fingerprint = ops.id_runs(sorted_ids, perm, keys)
        if shared:
            counts, first, inverse = counts.expand(nb), first.expand(nb, rows), inverse.expand(nb, rows)
        plan = IdPlan(counts, first, inverse, fingerprint)
    setattr(keys, _ID_PLAN, plan)
    return plan


_HOST_PLAN = "_dedup_host_plan"  # the attribute of position ids whose plan the host knows (host_plan)


def position_ids(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """The ids [capacity, n_blocks] of rows laid out block by block at ``capacity``, where block
    b's first ``counts[b]`` rows (int64 [n_blocks] on the rows' device) are distinct rows, each
    with its position as its id; the rest are padding, never read back, with id 0 (the codec
    codes each id's first row: not for gradients whose duplicate ids are summed). Their plan is
    attached (:func:`id_plan` returns it): known from the counts, without a sort, in a few ops
    whatever the number of blocks."""
    counts = counts.long()
    column, prefix = _position_sums(capacity, counts.device)
    w_blk = _block_weights(counts.numel(), counts.device)
    inverse = column * (column < counts[:, None])  # [n_blocks, capacity]: each row's id, its slot
    fingerprint = (prefix[counts] * w_blk).sum() & 0xFFFFFFFF  # (reference.fingerprint of the ids)
    keys = inverse.t()
    setattr(keys, _ID_PLAN, IdPlan(counts.clamp(min=1), inverse, inverse, fingerprint))
    return keys


def host_position_ids(counts: list[int], capacity: int, device: torch.device) -> torch.Tensor:
    """:func:`position_ids` of counts the host knows (a receiver's, read with a payload's head),
    on ``device``, with what a decoder reads of their plan known on the host too
    (:func:`host_plan`): nothing read back, no op on the device but the counts' copy and two."""
    n = len(counts)
    past = [b for b, c in enumerate(counts) if not 0 <= c <= capacity]
    if past:
        raise ValueError(f"block {past[0]}'s row count {counts[past[0]]} is not within the capacity of {capacity} rows")
    cpu = torch.device("cpu")
    prefix, w_blk = (t.numpy().view(np.uint64) for t in (_position_sums(capacity, cpu)[1], _block_weights(n, cpu)))
    fingerprint = int((prefix[counts] * w_blk).sum()) & 0xFFFFFFFF  # (uint64 arrays wrap as int64 does)
    known = [*(max(c, 1) for c in counts), fingerprint]
    host = torch.tensor([*counts, *known])
    on = host if device.type == "cpu" else host.to(device, non_blocking=True)
    column = _position_sums(capacity, device)[0]
    inverse = column * (column < on[:n, None])
    keys = inverse.t()
    setattr(keys, _ID_PLAN, IdPlan(on[n : 2 * n], inverse, inverse, on[2 * n]))
    setattr(keys, _HOST_PLAN, known)
    return keys


def host_plan(keys: torch.Tensor) -> list[int] | None:
    """What a decoder reads of the plan of ``keys``, known on the host (:func:`host_position_ids`):
    each block's distinct ids, then their fingerprint; None where the device holds it."""
    return getattr(keys, _HOST_PLAN, None)


@functools.lru_cache(maxsize=16)
def _position_sums(capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`position_ids`' column 0 .. capacity - 1 on ``device``, and for c = 0 .. capacity the
    fingerprint's weighted sum of the ids 0 .. c - 1 (int64, wrapping), made once."""
    w_row, _ = reference.fingerprint_weights(capacity, 0)
    column = torch.arange(capacity)
    prefix = torch.cat([column.new_zeros(1), (column * w_row).cumsum(0)])
    return column.to(device), prefix.to(device)


@functools.lru_cache(maxsize=16)
def _block_weights(n_blocks: int, device: torch.device) -> torch.Tensor:
    """The fingerprint's weights of ``n_blocks`` blocks on ``device``, made once."""
    return reference.fingerprint_weights(0, n_blocks)[1].to(device)


def id_sort(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` [rows, n_blocks] sorted stably along the rows (each id's rows in row order), and
    the permutation, each [rows, n] (n = 1 where every block has the same ids): one sort, no copy,
    no host wait; what the casts' fused ops sum and keep duplicate ids by
    (:func:`compression.ops.cast_pack_summed`, :func:`compression.ops.cast_unpack_first`)."""
    shared = keys.shape[1] == 1 or keys.stride(1) == 0
    sorted_ids, perm = torch.sort(keys[:, :1] if shared else keys, dim=0, stable=True)
    return sorted_ids, perm


def first_capacity(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`unique_per_block`'s counts and source rows, without a host wait: the source rows as
    [n_blocks, rows], block b's first ``counts[b]`` in canonical order, the rest 0."""
    counts, first, _ = plan_capacity(keys)
    return counts, first


def plan_capacity(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`first_capacity`'s counts and source rows, and :func:`unique_per_block`'s inverse
    [n_blocks, rows], from one sort and without a host wait (:func:`id_plan`'s)."""
    plan = id_plan(keys)
    return plan.counts, plan.first, plan.inverse


def _capacity_runs(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_sorted_unique` of ``k`` [n_blocks, rows] with the source rows at capacity (block
    b's first ``counts[b]`` in canonical order, the rest 0): no host wait."""
    rows = k.shape[1]
    perm, new = _sorted_runs(k)
    local = new.cumsum(1) - 1
    inverse = torch.empty_like(local).scatter_(1, perm, local)
    slot = torch.where(new, local, rows)  # repeats go to a spare column
    first = torch.zeros(k.shape[0], rows + 1, dtype=torch.int64, device=k.device).scatter_(1, slot, perm)
    return new.sum(1), first[:, :rows], inverse


def value_capacity(x: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`plan_by_value`, then :func:`identity_plan` where :func:`index_pays_off` says no, with
    no host wait: (whether the value plan is kept, a 0-d bool; counts; source rows at capacity as
    :func:`first_capacity`'s; inverse [n_blocks, rows]). The same plan as those functions give
    with this device's hash."""
    rows, nb = x.shape[0], len(widths)
    counts, first, inverse = _capacity_runs(_row_hashes(x, widths).t().contiguous())
    every = torch.arange(rows, device=x.device).expand(nb, rows)
    # a block whose hash collides keeps every row: its row numbers as keys give the identity
    bad = _differs(x, widths, first.gather(1, inverse))
    counts = torch.where(bad, rows, counts)
    first, inverse = torch.where(bad[:, None], every, first), torch.where(bad[:, None], every, inverse)
    kept = _pays_off(counts, widths, rows)
    return kept, torch.where(kept, counts, rows), torch.where(kept, first, every), inverse


def gather_capacity(x: torch.Tensor, widths: list[int], first: torch.Tensor) -> torch.Tensor:
    """Flat values of ``first``'s rows ([n_blocks, rows]), block after block, each block
    ``rows x width`` row-major: :func:`gather`'s values with every block at its capacity."""
    rows = x.shape[0]
    if len(set(widths)) == 1 and widths[0] > 0:
        nb, d = len(widths), widths[0]
        return x.reshape(rows, nb, d)[first, torch.arange(nb, device=x.device)[:, None]].reshape(-1)
    parts, start = [], 0
    for b, w in enumerate(widths):
        parts.append(torch.index_select(x[:, start : start + w], 0, first[b]).reshape(-1))
        start += w
    return torch.cat(parts) if parts else x.new_zeros(0)


def valid_capacity(counts: torch.Tensor, widths: list[int], rows: int) -> torch.Tensor:
    """bool, in :func:`gather_capacity`'s layout: which values are unique rows' (not capacity)."""
    live = torch.arange(rows, device=counts.device)[None, :] < counts[:, None]  # [n_blocks, rows]
    if len(set(widths)) == 1 and widths[0] > 0:
        return live[:, :, None].expand(-1, -1, widths[0]).reshape(-1)
    parts = [live[b, :, None].expand(-1, w).reshape(-1) for b, w in enumerate(widths)]
    return torch.cat(parts) if parts else live.new_zeros(0)


def identity_plan(rows: int, n_blocks: int, device: torch.device) -> Plan:
    """No dedup: every row of every block is its own unique row."""
    counts = torch.full((n_blocks,), rows, dtype=torch.int64, device=device)
    first = torch.arange(rows, device=device).repeat(n_blocks)
    return Plan(NONE, counts, first, None)


def plan_by_ids(ids: torch.Tensor, numpy: bool = False) -> Plan:
    """Dedup by the caller's ids [rows, n_blocks] (equal id => equal row, by contract)."""
    counts, first, inverse = unique_per_block(ids, numpy=numpy)
    return Plan(IDS, counts, first, inverse)


def inverse_from_ids(ids: torch.Tensor, numpy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Receiver side of :func:`plan_by_ids`: (counts, inverse) from the same ids."""
    counts, _, inverse = unique_per_block(ids, want_first=False, numpy=numpy)
    return counts, inverse


def _words(x: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``x``'s bits as the widest integers that tile every block (fewer, wider compares), and the
    block widths in those words."""
    x = x.contiguous()
    item = x.element_size()
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if size >= item and all(w * item % size == 0 for w in widths) and x.data_ptr() % size == 0:
            try:
                return x.view(dtype), [w * item // size for w in widths]
            except RuntimeError:  # e.g. zero columns: a stride the wider view cannot express
                continue
    raise AssertionError(f"no integer view of {x.dtype}")  # int16/int32 always tile 2/4-byte values


_MULTIPLIERS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _multipliers(n: int, device: torch.device) -> torch.Tensor:
    """:func:`_row_hashes`' odd int32 multipliers [2, n] on ``device``, drawn from its seed once."""
    if (n, device) not in _MULTIPLIERS:
        gen = torch.Generator().manual_seed(_HASH_SEED)
        mult = torch.randint(-(1 << 30), 1 << 30, (2, n), generator=gen, dtype=torch.int32) * 2 + 1
        _MULTIPLIERS[n, device] = mult.to(device, non_blocking=True)
    return _MULTIPLIERS[n, device]


def _row_hashes(x: torch.Tensor, widths: list[int], host: bool = False) -> torch.Tensor:
    """int64 hash of each (row, block) from the value bits (collisions are checked later).

    ``host`` (a CPU tensor): one wrapping int64 multiply-sum over 8-byte words (numpy's integer
    matmul, one pass). Elsewhere: two wrapping int32 multiply-sums, joined.
    """
    if host:
        return _row_hashes_host(x, widths)
    bits = x.contiguous().view(torch.int32 if x.element_size() == 4 else torch.int16).int()
    mult = _multipliers(max([*widths, 1]), x.device)

    def hash64(block: torch.Tensor, w: int) -> torch.Tensor:
        h1 = (block * mult[0, :w]).sum(-1, dtype=torch.int32).long()
        h2 = (block * mult[1, :w]).sum(-1, dtype=torch.int32).long()
        return (h1 << 32) | (h2 & 0xFFFFFFFF)

    if len(set(widths)) == 1 and widths[0] > 0:
        d = widths[0]
        return hash64(bits.view(x.shape[0], len(widths), d), d)
    cols, start = [], 0
    for w in widths:
        cols.append(hash64(bits[:, start : start + w], w))
        start += w
    return torch.stack(cols, 1)


@functools.lru_cache(maxsize=8)
def _host_multipliers(n: int) -> np.ndarray:
    """Fixed odd 64-bit multipliers of the host hash."""
    return np.random.default_rng(_HASH_SEED).integers(-(1 << 62), 1 << 62, n, dtype=np.int64) | 1


def _row_hashes_host(x: torch.Tensor, widths: list[int]) -> torch.Tensor:
    bits, ww = _words(x, widths)
    a = bits.numpy().astype(np.int64, copy=False)
    mult = _host_multipliers(max([*ww, 1]))
    if len(set(ww)) == 1 and ww[0] > 0:  # integer matmul wraps silently: that is the hash
        return torch.from_numpy(a.reshape(x.shape[0], len(ww), ww[0]) @ mult[: ww[0]])
    cols, start = [], 0
    for w in ww:
        cols.append(a[:, start : start + w] @ mult[:w])
        start += w
    return torch.from_numpy(np.stack(cols, 1) if cols else np.zeros((x.shape[0], 0), np.int64))


def plan_by_value(x: torch.Tensor, widths: list[int], numpy: bool = False) -> Plan:
    """Dedup bit-identical rows per block; a block whose hash collides is left undeduplicated."""
    rows = x.shape[0]
    host = numpy and x.device.type == "cpu"
    keys = _row_hashes(x, widths, host)
    counts, first, inverse = unique_per_block(keys, numpy=numpy)
    bad = mismatched_blocks(x, widths, counts, first, inverse, numpy)
    if bad.any():  # astronomically rare: fall back to the row number as key for those blocks
        keys[:, bad] = torch.arange(rows, device=x.device)[:, None]
        counts, first, inverse = unique_per_block(keys, numpy=numpy)
    return Plan(VALUE, counts, first, inverse)


def distinct_rows(x: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Per block, how many distinct rows ``x`` holds, counted by their hashes on ``x``'s device
    without a host wait (for telemetry: a hash collision would count two rows as one)."""
    return first_capacity(_row_hashes(x, widths))[0]


def index_pays_off(plan: Plan, widths: list[int], rows: int) -> bool:
    """Whether value dedup saves more than its index costs: the removed values (about half a byte
    each at typical bounds) must outweigh the index (at most about 2 bytes per row and block)."""
    return bool(_pays_off(plan.counts, widths, rows))


def _pays_off(counts: torch.Tensor, widths: list[int], rows: int) -> torch.Tensor:
    """:func:`index_pays_off` as a 0-d bool tensor on the counts' device."""
    removed = ((rows - counts) * torch.tensor(widths).to(counts.device, non_blocking=True)).sum()
    return removed >= 4 * rows * len(widths)


def mismatched_blocks(
    x: torch.Tensor,
    widths: list[int],
    counts: torch.Tensor,
    first: torch.Tensor,
    inverse: torch.Tensor,
    numpy: bool = False,
) -> torch.Tensor:
    """bool [n_blocks]: blocks where some row differs (bitwise) from the unique row it maps to
    (``numpy``: the host's gather and compare for a CPU tensor, ~4x torch's there)."""
    offsets = counts.cumsum(0) - counts
    src = first[inverse + offsets[:, None]]  # [nb, rows]: the representative row
    if not (numpy and x.device.type == "cpu"):
        return _differs(x, widths, src)
    words, ww = _words(x, widths)  # numpy's gather + compare
    bits, rep = words.numpy(), src.numpy()
    out, start = [], 0
    for b, w in enumerate(ww):
        block = bits[:, start : start + w]
        out.append(not np.array_equal(np.take(block, rep[b], axis=0), block))
        start += w
    return torch.tensor(out, dtype=torch.bool, device=x.device)


def _differs(x: torch.Tensor, widths: list[int], src: torch.Tensor) -> torch.Tensor:
    """bool [n_blocks] on the device (no host wait): blocks where some row differs (bitwise) from
    its representative row ``src`` [n_blocks, rows]."""
    bits, ww = _words(x, widths)
    if len(set(ww)) == 1 and ww[0] > 0:  # one gather for every block
        nb, w = len(ww), ww[0]
        blocks = bits.view(x.shape[0], nb, w)
        return (blocks[src.t(), torch.arange(nb, device=x.device)] != blocks).any(2).any(0)
    out, start = [], 0
    for b, w in enumerate(ww):
        block = bits[:, start : start + w]
        out.append((torch.index_select(block, 0, src[b]) != block).any())
        start += w
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.bool, device=x.device)


def gather(x: torch.Tensor, widths: list[int], plan: Plan) -> torch.Tensor:
    """Flat values of the unique rows, block after block, each row's columns in order."""
    if not widths or x.numel() == 0:
        return x.new_zeros(
            int((plan.counts * torch.tensor(widths, dtype=torch.int64, device=plan.counts.device)).sum())
        )
    if len(set(widths)) == 1:
        d, nb = widths[0], len(widths)
        if nb == 1:
            return torch.index_select(x, 0, plan.first).view(-1)
        blk = torch.repeat_interleave(torch.arange(nb, device=x.device), plan.counts, output_size=plan.first.numel())
        return torch.index_select(x.reshape(-1, d), 0, plan.first * nb + blk).view(-1)
    parts, start, row0 = [], 0, 0
    for w, u in zip(widths, plan.counts.tolist(), strict=True):
        parts.append(torch.index_select(x[:, start : start + w], 0, plan.first[row0 : row0 + u]).reshape(-1))
        start, row0 = start + w, row0 + u
    return torch.cat(parts)


def scatter(
    values: torch.Tensor,
    widths: list[int],
    counts: torch.Tensor,
    inverse: torch.Tensor | None,
    rows: int,
    out: torch.Tensor | None = None,
    host_counts: list[int] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`gather`: the full [rows, cols] tensor from the unique rows' values,
    written into ``out`` (any strides) when given; ``host_counts``: ``counts`` as read already."""
    cols = sum(widths)
    if out is None:
        out = values.new_empty(rows, cols)
    if cols == 0 or rows == 0:
        return out
    nb = len(widths)
    if inverse is None:  # identity plan: blocks are stored [rows, w] one after another
        start, pos = 0, 0
        for w in widths:
            out[:, start : start + w] = values[pos : pos + rows * w].view(rows, w)
            start, pos = start + w, pos + rows * w
        return out
    if nb == 1:  # gathers straight into out (index_select accepts a strided out)
        return torch.index_select(values.view(-1, cols), 0, inverse[0], out=out)
    if len(set(widths)) == 1 and out.is_contiguous():  # one gather for every block
        d = widths[0]
        offsets = counts.cumsum(0) - counts
        g = (inverse + offsets[:, None]).t().reshape(-1)  # [rows * nb] index of the unique row
        torch.index_select(values.view(-1, d), 0, g, out=out.view(rows * nb, d))
        return out
    start, pos = 0, 0
    for b, w in enumerate(widths):
        u = int(counts[b]) if host_counts is None else host_counts[b]
        torch.index_select(values[pos : pos + u * w].view(u, w), 0, inverse[b], out=out[:, start : start + w])
        start, pos = start + w, pos + u * w
    return out
