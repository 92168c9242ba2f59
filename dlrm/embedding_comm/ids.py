"""Row ids for the codec: which chunks are single-valued, their ids, and duplicate-id gradients.

A chunk's block (one feature) can travel deduplicated by id when every bag in it holds at most
one id and no weight: its pooled row is then the table row of that id, so equal ids mean equal
rows; an empty bag (e.g. a hot id served by a local replica, dlrm/placement/hot_rows.py) pools to zero and
takes the id :data:`EMPTY_BAG`, shared by every empty bag. Sender and receiver decide this
independently from the same bags (the receiver sent them in the input all-to-all), so they always
agree and no flag travels. A chunk is sent by id only
when all its blocks qualify (one payload per peer); otherwise the codec dedups by value.

Where the coded input all-to-all (``compression.input=ids``) already sorted a key's ids, it
leaves its result on the very KJT it coded or rebuilt (:func:`attach_plans`, per key and run of
bags), and the ids of a region made entirely of such runs carry it to the codec
(:func:`dlrm_compression.dedup.with_known_plan`): dedup, duplicate-id sums and the receiver's
mapping then sort nothing. Any other region (other bags, an empty or multi-id bag, another KJT
object) is sorted as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_compression.backend import upload
from dlrm_compression.dedup import first_at_capacity, id_plan, known_plan, with_known_plan
from dlrm_compression.ids_codec import KeyPlans

EMPTY_BAG = -1  # the id of an empty bag: its pooled row is zero, like every other empty bag's


class Region(NamedTuple):
    """Keys ``key_start:key_start+n_keys`` and bags ``bag_start:bag_start+count`` of a KJT."""

    key_start: int
    n_keys: int
    bag_start: int
    count: int  # type: ignore[assignment]  # shadows tuple.count (a public field name, kept)


REUSE_INPUT_PLANS = True  # take the input codec's sorted ids where they fit (tests switch it off)
_PLANS = "_dlrm_id_plans"  # the KJT attribute holding them: {(key, bag_start, bags): (distinct, index)}

IdPlans = dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]]


def attach_plans(kjt: KeyedJaggedTensor, plans: KeyPlans, key_start: int, bag_starts: Sequence[int]) -> None:
    """Record on ``kjt`` what the ids codec computed for its keys ``key_start:key_start+n``:
    key ``key_start + k``'s bags from ``bag_starts[k]`` on, one per lookup of ``plans``'s key k.
    Only keys with exactly one id in every bag (lookup i is bag i)."""
    known: IdPlans = getattr(kjt, _PLANS, {})
    for k, (n, single) in enumerate(zip(plans.ids_per_key, plans.single, strict=True)):
        if single:
            known[(key_start + k, bag_starts[k], n)] = (plans.distinct[k : k + 1], plans.key_index(k))
    setattr(kjt, _PLANS, known)


def _region_plan(kjt: KeyedJaggedTensor, r: Region) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(counts [n_keys], inverse [n_keys, count]) of a region whose every key has a plan for exactly
    its bags, else None."""
    known: IdPlans = getattr(kjt, _PLANS, {})
    parts = [known.get((k, r.bag_start, r.count)) for k in range(r.key_start, r.key_start + r.n_keys)]
    if not REUSE_INPUT_PLANS or not parts or any(p is None for p in parts):
        return None
    return torch.cat([p[0] for p in parts if p]), torch.stack([p[1] for p in parts if p])


def chunk_ids(kjt: KeyedJaggedTensor | None, regions: Sequence[Region]) -> list[torch.Tensor | None]:
    """Per region: int64 ids ``[count, n_keys]`` (:data:`EMPTY_BAG` for an empty bag), or None
    unless every bag of the region holds at most one unweighted id (one host sync for all regions).

    ``kjt`` is feature-major with a fixed stride (TorchRec's layout for non-VBE batches).
    """
    return chunk_ids_of([(kjt, regions)])[0]


def chunk_ids_of(
    requests: Sequence[tuple[KeyedJaggedTensor | None, Sequence[Region]]],
) -> list[list[torch.Tensor | None]]:
    """:func:`chunk_ids` of several KJTs' regions (a collective's send and receive sides), with one
    host sync for all of them."""
    pending = pending_ids(requests)
    return pending.settle(pending.single.tolist())


@dataclass
class PendingIds:
    """:func:`chunk_ids_of`'s answer before its host read: each region's ids as if it were
    single-valued (None where it cannot be: weights, variable strides, no keys), and a device
    flag per candidate saying whether it is, so that a collective reads them with its own numbers."""

    candidates: list[list[torch.Tensor | None]]  # per request, per region
    single: torch.Tensor  # bool, one per candidate in order, on the device
    reused: int = 0  # candidates that carry the input codec's plan

    def flags(self) -> list[list[torch.Tensor | None]]:
        """Each candidate's flag (a 0-d view of ``single``), laid out as ``candidates``."""
        single = iter(self.single)
        return [[None if c is None else next(single) for c in row] for row in self.candidates]

    def settle(self, single: Sequence[bool]) -> list[list[torch.Tensor | None]]:
        """:func:`chunk_ids_of`'s answer, given the flags as read."""
        flags = iter(single)
        return [[c if c is not None and next(flags) else None for c in row] for row in self.candidates]


def pending_ids(requests: Sequence[tuple[KeyedJaggedTensor | None, Sequence[Region]]]) -> PendingIds:
    """:func:`chunk_ids_of` without its host read (:class:`PendingIds`)."""
    candidates: list[list[torch.Tensor | None]] = []
    checks, reused = [], 0
    for kjt, regions in requests:
        if kjt is None or kjt.weights_or_none() is not None or kjt.variable_stride_per_key() or not regions:
            candidates.append([None] * len(regions))
            continue
        lengths = kjt.lengths().view(-1, kjt.stride())
        row: list[torch.Tensor | None] = []
        for r in regions:
            if r.n_keys:
                checks.append(
                    (lengths[r.key_start : r.key_start + r.n_keys, r.bag_start : r.bag_start + r.count] <= 1).all()
                )
            if not r.n_keys:
                row.append(None)
                continue
            ids, plan = _ids(kjt, r), _region_plan(kjt, r)
            if plan is not None:  # the input codec sorted exactly these ids
                with_known_plan(ids, *plan)
                reused += 1
            row.append(ids)
        candidates.append(row)
    single = torch.stack(checks) if checks else torch.zeros(0, dtype=torch.bool)
    return PendingIds(candidates, single, reused)


def _ids(kjt: KeyedJaggedTensor, r: Region) -> torch.Tensor:
    """The ids of a single-valued region, ``[count, n_keys]`` (:data:`EMPTY_BAG` for an empty bag)."""
    stride, offsets, values = kjt.stride(), kjt.offsets(), kjt.values()
    lengths = kjt.lengths()
    dev = lengths.device
    keys = torch.arange(r.key_start, r.key_start + r.n_keys, device=dev)
    bags = keys[None, :] * stride + r.bag_start + torch.arange(r.count, device=dev)[:, None]
    first = offsets[bags].clamp(max=max(values.numel() - 1, 0))
    ids = values[first].long() if values.numel() else torch.zeros_like(first)
    return torch.where(lengths[bags] == 1, ids, EMPTY_BAG)


def sum_duplicates(g: torch.Tensor, ids: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """Give every row of each block the sum of its block's rows with the same id (a new tensor).

    The codec (deduplicating by id) then sends each sum once; the owner keeps it on one row. Each
    id's rows are summed in row order, from the ids' plan (:func:`dlrm_compression.dedup.id_plan`:
    one sort for every block, shared with the codec), by one scatter and one gather for every
    block: no unique ids (no host wait), no loop over the tables.
    """
    if not any(widths):
        return g.clone()
    slot = _per_column(id_plan(ids).inverse, widths)  # [rows, cols]: each value's id slot
    return torch.zeros_like(g).scatter_add_(0, slot, g).gather(0, slot)


def first_rows(ids: torch.Tensor) -> torch.Tensor:
    """``[n_blocks, rows]``: for each block and row, the first row holding the same id.

    One stable sort of every block's ids at once, then segment starts by boundary flags and a
    running maximum: no output whose size depends on the data (``torch.unique`` has one, a host
    wait per call on an accelerator). Ids with a known plan need no sort.
    """
    known = known_plan(ids)
    if known is not None:
        return first_at_capacity(known[1]).gather(1, known[1])
    ids = ids.t()
    rows = ids.shape[1]
    sorted_ids, perm = torch.sort(ids, dim=1, stable=True)  # equal ids keep their row order
    new = torch.ones_like(sorted_ids, dtype=torch.bool)
    new[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    pos = torch.arange(rows, device=ids.device).expand_as(perm)
    start = torch.where(new, pos, 0).cummax(dim=1).values  # sorted position where each id's run starts
    return torch.empty_like(perm).scatter_(1, perm, perm.gather(1, start))


def keep_first_duplicates(g: torch.Tensor, ids: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """Zero, per block, every row whose id appeared on an earlier row (in place; returns ``g``).

    Under sum pooling the table-batched kernel adds the gradients of all bags of an id, so one
    row holding the per-id sum and zeros elsewhere gives the same per-id gradient.
    """
    if not any(widths):
        return g
    plan = id_plan(ids)
    first = plan.first.gather(1, plan.inverse) == torch.arange(ids.shape[0], device=ids.device)  # [n_blocks, rows]
    return g.masked_fill_(~_per_column(first, widths), 0.0)  # (not `*= mask`: inf * 0 is nan)


def _per_column(per_block: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """``per_block`` [n_blocks, rows] spread to every column of its block: [rows, cols] (a view of
    one gather by a table of each column's block)."""
    block_of = torch.tensor([b for b, w in enumerate(widths) for _ in range(w)])
    return per_block.index_select(0, upload(block_of, per_block.device)).t()
