"""Bounded row caches keyed by id, with deterministic least-recently-used eviction, in tensors.

Two copies driven by the same sequence of calls hold the same ids and rows: a sender can mirror
what a receiver holds without asking it. :class:`RowCaches` holds the caches of several blocks
(the tables of a chunk: one LRU of ``capacity_rows`` rows each) as one structure, so that a
chunk's lookups and stores take a fixed number of whole-tensor operations whatever its number
of blocks: one index of every block's held ids (a block's index in the bits above its id, so
that a block's ids are one run of the ascending keys, searched with ``searchsorted``), the row of
one row table that holds each, and one tick per row (the :meth:`RowCaches.store` call that last
used it; 0: the row is free). Everything lives on one device (the rows' own, CPU or an
accelerator): ``find``, ``peek`` and ``store`` make no host synchronisation (``store`` is told
the counts it needs, which its callers read with their collective's reads). :class:`RowCache`
is one block's cache with the same rules (its own API, for a caller with one table).

Eviction rule, per block: each :meth:`RowCaches.store` call is one tick; it makes all its ids the
most recent, and among ids of the same tick the larger id counts as more recent (as if they had
been touched one by one in ascending order). After a call, while more than ``capacity_rows``
ids are held, the least recent (smallest ``(tick, id)``) go, all chosen at once; if a call brings
more ids than the capacity, its own smallest ids are not kept. Nothing depends on hashing, timing
or row numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from . import row_ops
from .backend import Backend, backend_for

_INDEX = ("ids", "slots", "ticks", "free")  # one block's saved index tensors (int64)
INF = torch.iinfo(torch.int64).max  # past every key (the merge's sentinel)
_TICK_BITS = 40  # a store's tick, below a block's index in the eviction's sort key


def key_bits(n_blocks: int) -> int:
    """Bits of an id in :class:`RowCaches`' keys (the block's index above them): ids must be
    in ``[0, 2**bits - 1)``, 58 bits for up to 32 blocks, 56 for up to 128."""
    return 63 - max(n_blocks - 1, 1).bit_length()


class RowCaches:
    """Rows of ``len(widths)`` blocks by id (block k's rows of width ``widths[k]``, kept at the
    widest), ``capacity_rows`` per block (0: unlimited), on ``device``.

    ``find`` -> ``peek`` -> ``store``, on every block's ids at once, ``[n_blocks, q]`` (a block's
    ids ascending where ``valid``; what follows is padding): their rows (0: not held; row 0 is a
    spare no id holds), read the held rows, then write the call's rows back under its ids (which
    makes them the most recent and evicts past the capacity), told each block's counts.
    """

    def __init__(
        self,
        widths: Sequence[int],
        capacity_rows: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        backend: Backend | None = None,
    ) -> None:
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}")
        self.widths, self.capacity = [int(w) for w in widths], capacity_rows
        self.n_blocks, self.dim = len(self.widths), max(self.widths, default=0)
        self.bits = key_bits(self.n_blocks)
        empty = torch.empty(0, dtype=torch.int64, device=device)
        # held keys, ascending, over the row of _rows holding each; then a key past every key (a
        # search never runs off the end)
        self._index = torch.tensor([[INF], [0]], dtype=torch.int64, device=device)
        self._rows = torch.zeros(1, self.dim, dtype=dtype, device=device)  # row 0: the spare
        self._ticks = empty.new_zeros(1)  # per row: the store() call that last used it (0: free)
        self._free = empty  # free rows (tick 0), taken from the end
        self._clock = 0
        self._len = [0] * self.n_blocks  # ids held per block
        self._alloc = [0] * self.n_blocks  # rows per block as a one-block cache allocates them (growth, nbytes)
        self._consts: dict[torch.device, torch.Tensor] = {}
        # the host's compactions (nonzero), or the device's that never wait (default: the device's choice)
        self.host = (backend or backend_for(self._rows.device)).host_compaction

    def __len__(self) -> int:
        return sum(self._len)

    def lengths(self) -> list[int]:
        """Ids held per block."""
        return list(self._len)

    @property
    def device(self) -> torch.device:
        return self._rows.device

    @property
    def table(self) -> torch.Tensor:
        """The row table ([rows, widest], row 0 the spare): the rows :meth:`find`'s answers point at."""
        return self._rows

    def to_(self, device: torch.device) -> RowCaches:
        """Move the caches to ``device``, in place (a restored checkpoint's)."""
        self._index, self._ticks, self._free = (t.to(device) for t in (self._index, self._ticks, self._free))
        self._rows = self._rows.to(device)
        return self

    @property
    def nbytes(self) -> int:
        """Memory of the rows and index, as one-block caches hold them: per block its row table
        (capacity x width x dtype once full; grown by doubling while it fills) and its index (ids,
        rows, ticks, free rows). This structure holds the same, and a spare row (with narrower
        blocks, their rows at the widest)."""
        item = self._rows.element_size()
        return sum(a * w * item + 8 * (n + 2 * a) for a, w, n in zip(self._alloc, self.widths, self._len, strict=True))

    def keys(self, ids: torch.Tensor) -> torch.Tensor:
        """The index's keys of ``ids`` [n_blocks, q] (int64, each block's row its ids)."""
        return ids | self._block_keys(ids.device)

    def _block_keys(self, device: torch.device) -> torch.Tensor:
        if device not in self._consts:
            self._consts[device] = (torch.arange(self.n_blocks, dtype=torch.int64) << self.bits)[:, None].to(device)
        return self._consts[device]

    def find(
        self, ids: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows int64 [n_blocks, q]: the row holding each of ``ids`` [n_blocks, q] (in ``[0,
        2**key_bits - 1)``), 0 where not held or not ``valid``; held bool [n_blocks, q]; their
        keys, for :meth:`store`)."""
        key = self.keys(ids)
        got = self._index.index_select(1, torch.searchsorted(self._index[0], key.reshape(-1)))
        got = got.view(2, *key.shape)
        held = got[0] == key
        if valid is not None:
            held &= valid
        return got[1] * held, held, key

    def find_unique(
        self, ids: torch.Tensor, first: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`find` of every block's unique ids of a chunk, at capacity: block k's u-th the id
        of ``ids`` [rows, n_blocks] at row ``first[k, u]``, valid below ``counts[k]`` (an id plan's):
        (the ids, valid, rows, held, keys), one op (:func:`compression.row_ops.row_find`)."""
        return row_ops.row_find(self._index, ids, first, counts, self.bits)

    def peek(self, rows: torch.Tensor) -> torch.Tensor:
        """The held rows at ``rows`` (from :meth:`find`), ``[*rows.shape, width]``; unspecified
        where not held (row 0): for a caller that overwrites those."""
        return self._rows.index_select(0, rows.reshape(-1)).view(*rows.shape, self.dim)

    def store(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor,
        held: torch.Tensor,
        valid: torch.Tensor,
        counts: Sequence[int],
        n_held: Sequence[int],
        new: torch.Tensor | None = None,
    ) -> None:
        """Hold ``values`` [n_blocks, q, width] under the ids of ``keys`` [n_blocks, q] (block
        k's first ``counts[k]``, ascending, where ``valid``), making them the most recent, then
        evict past the capacity (module docstring). ``rows``, ``held``, ``keys``: :meth:`find`'s
        answer for these ids (nothing changed the caches since); ``n_held``: how many each block
        holds; ``new``: the ids not held (``valid ^ held``), where the caller has them. No host
        wait: a fixed number of operations whatever the number of blocks."""
        if not sum(counts):
            return
        self._clock += 1
        clock, cap = self._clock, self.capacity
        n_new = [n - h for n, h in zip(counts, n_held, strict=True)]
        after = [min(c + k, cap) if cap else c + k for c, k in zip(self._len, n_new, strict=True)]
        evicts = any(a < c + k for a, c, k in zip(after, self._len, n_new, strict=True))
        self._grow(after)
        new = valid ^ held if new is None else new  # (held ids are valid)
        index = self._index
        if evicts:
            # a call past a block's capacity does not keep its own smallest ids (its first):
            # their rows are freed (tick 0) and, as the least recent, they go first
            over = [max(n - cap, 0) for n in counts]
            if any(over):
                out = _columns(keys.shape[1], keys.device) < _on_int(over, keys.device)[:, None]
                dropped, new = held & out, new & ~out
                self._ticks.index_fill_(0, (rows * dropped).reshape(-1), 0)  # (the spare's too)
                rows = rows * ~out
            self._ticks.index_fill_(0, rows.reshape(-1), clock)  # the call's held ids: the most recent
            older = [max(min(c + n - h - cap, c - h), 0) for c, n, h in zip(self._len, counts, n_held, strict=True)]
            gone = _on_int(older, keys.device)
            index = self._evict(index[:, :-1], gone + dropped.sum(1) if any(over) else gone)
        if any(n_new):
            # free rows for the new ids (block after block, ascending): the free list's last first
            if evicts:  # rows freed by this call too: every free row, ascending (past the count: unread)
                free = self._ticks[1:] == 0
                take = torch.where(free, free.cumsum(0) - 1, free.numel())
                rows_of = _columns(free.numel(), free.device)[0] + 1
                take = self._ticks.new_empty(free.numel() + 1).index_copy_(0, take, rows_of)
                at = (new.reshape(-1).cumsum(0) - 1).clamp_(min=0)
            else:
                take, n_free = self._free, self._free.numel()
                at = (n_free - new.reshape(-1).cumsum(0)).clamp_(min=n_free - sum(n_new), max=n_free - 1)
                self._free = self._free[: n_free - sum(n_new)]
            rows = torch.where(new, take.index_select(0, at).view_as(rows), rows)  # (new ids' rows are 0)
            index = torch.cat([index, torch.stack([torch.where(new, keys, _inf(keys.device)), rows]).view(2, -1)], 1)
        if index.shape[1] != sum(after) + 1 or any(n_new):  # the keys ascending, the gone ones (INF) past the end
            index = index.index_select(1, torch.sort(index[0]).indices[: sum(after) + 1])
        self._ticks.index_fill_(0, rows.reshape(-1), clock)  # (and the spare's)
        self._rows.index_copy_(0, rows.reshape(-1), values.reshape(-1, self.dim).to(self._rows.dtype))
        self._index, self._len = index, after
        if evicts:
            self._free = self._free_rows()

    def _evict(self, index: torch.Tensor, gone: torch.Tensor) -> torch.Tensor:
        """``index`` with each block's ``gone`` least recent ids (smallest ``(tick, id)``; this
        call's dropped ids have tick 0) keyed past every key, their rows freed (tick 0)."""
        n = index.shape[1]
        block = index[0] >> self.bits
        ticks = self._ticks.index_select(0, index[1])
        # ascending (block, tick, id): index is in (block, id) order, the sort is stable
        order = torch.sort((block << _TICK_BITS) | ticks, stable=True).indices
        starts = torch.searchsorted(index[0], self._block_keys(index.device).reshape(-1))
        block = block.index_select(0, order)
        place = _columns(n, index.device)[0] - starts.index_select(0, block)  # within its block
        go = place < gone.index_select(0, block)
        index = index.index_select(1, order)
        self._ticks.index_fill_(0, index[1] * go, 0)  # (the spare's too: 0 is its row)
        return torch.stack([index[0].masked_fill(go, INF), index[1]])

    def _free_rows(self) -> torch.Tensor:
        """Every free row (tick 0, the spare aside), descending (taken from the end: the lowest
        first)."""
        n = sum(self._alloc) - sum(self._len)
        return positions(self._ticks[1:] == 0, n, self.host).flip(0) + 1

    def _grow(self, after: Sequence[int]) -> None:
        """Allocate rows for ``after`` ids per block, as a one-block cache grows its table."""
        alloc = []
        for a, n in zip(self._alloc, after, strict=True):
            if n > a:
                size = max(2 * a, n, 1024)
                if self.capacity:
                    size = max(min(size, self.capacity), n)
                a = size
            alloc.append(a)
        more = sum(alloc) - sum(self._alloc)
        self._alloc = alloc
        if more:
            n = self._rows.shape[0]
            self._rows = torch.nn.functional.pad(self._rows, (0, 0, 0, more))  # zeros
            self._ticks = torch.nn.functional.pad(self._ticks, (0, more))
            rows = torch.arange(n + more - 1, n - 1, -1, device=self.device)
            self._free = torch.cat([rows, self._free]) if self._free.numel() else rows

    def ids(self, block: int) -> list[int]:
        """Block ``block``'s held ids, least recent first (for comparing two copies)."""
        index = self._segment(block)
        order = torch.argsort(self._ticks.index_select(0, index[1]), stable=True)  # ids ascend within a tick
        return (index[0].index_select(0, order) & ((1 << self.bits) - 1)).tolist()

    def lookup(self, block: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [n]: held, rows [n, width]: block ``block``'s held rows of ``ids``, zeros where
        not held)."""
        q = torch.as_tensor(ids).reshape(-1).to(self.device, torch.int64)
        got = self._index.index_select(1, torch.searchsorted(self._index[0], q | (block << self.bits)))
        held = got[0] == q | (block << self.bits)
        rows = torch.where(held[:, None], self._rows.index_select(0, got[1] * held), 0)
        return held, rows[:, : self.widths[block]]

    def rows(self, block: int, ids: torch.Tensor) -> torch.Tensor:
        """Block ``block``'s rows of ``ids`` (zeros where not held), its width."""
        return self.lookup(block, ids)[1]

    def _segment(self, block: int) -> torch.Tensor:
        """Block ``block``'s part of the index (its keys, ascending, and rows)."""
        start = sum(self._len[:block])
        return self._index[:, start : start + self._len[block]]

    def block_state(self, block: int) -> dict[str, Any]:
        """Block ``block``'s cache as a one-block cache saves it (:meth:`RowCache.state_dict`):
        its ids ascending, each in the row of its rank, its ticks, the rest of its rows free."""
        index = self._segment(block)
        n, a, w = index.shape[1], self._alloc[block], self.widths[block]
        rows = self._rows.new_zeros(a, w)
        rows[:n] = self._rows.index_select(0, index[1])[:, :w]
        ticks = self._ticks.new_zeros(a)
        ticks[:n] = self._ticks.index_select(0, index[1])
        ids = index[0] & ((1 << self.bits) - 1)
        slots = torch.arange(n, device=self.device)
        free = torch.arange(a - 1, n - 1, -1, device=self.device)  # taken from the end: row n first
        state = {"dim": w, "capacity": self.capacity, "clock": self._clock, "rows": rows, "ids": ids.clone()}
        return {**state, "slots": slots, "ticks": ticks, "free": free}

    def load_blocks(self, states: Sequence[Mapping[str, Any] | None]) -> None:
        """Hold what each block's saved one-block state holds (:meth:`block_state`'s, or
        :meth:`RowCache.state_dict`'s of any version; None: empty). Each block's recency order
        is kept (its ticks shifted to this structure's clock)."""
        if len(states) != self.n_blocks:
            raise ValueError(f"{len(states)} saved row caches for {self.n_blocks} blocks")
        for k, s in enumerate(states):
            if s is not None and (int(s["dim"]), int(s["capacity"])) != (self.widths[k], self.capacity):
                raise ValueError(
                    f"the saved row cache holds rows of width {s['dim']} with capacity {s['capacity']}; this one "
                    f"has width {self.widths[k]} and capacity {self.capacity} "
                    "(compression.forward.cache.capacity_rows changed?)"
                )
        clock = max([int(s["clock"]) for s in states if s is not None], default=0)
        keys, rows, ticks, lens, alloc = [], [], [], [], []
        for k, s in enumerate(states):
            if s is None:
                lens.append(0)
                alloc.append(0)
                continue
            ids, slots, tick = (
                torch.as_tensor(s[name]).to(self.device, torch.int64) for name in ("ids", "slots", "ticks")
            )
            saved = torch.as_tensor(s["rows"]).to(self.device, self._rows.dtype)
            keys.append(ids | (k << self.bits))
            rows.append(torch.nn.functional.pad(saved.index_select(0, slots), (0, self.dim - saved.shape[1])))
            ticks.append(tick.index_select(0, slots) + (clock - int(s["clock"])))  # recency within the block kept
            lens.append(ids.numel())
            alloc.append(saved.shape[0])
        n = sum(lens)
        self._clock, self._len, self._alloc = clock, lens, alloc
        self._rows = self._rows.new_zeros(1 + sum(alloc), self.dim)
        self._ticks = self._ticks.new_zeros(1 + sum(alloc))
        held = torch.arange(1, n + 1, device=self.device)
        if n:
            self._rows[1 : n + 1] = torch.cat(rows)
            self._ticks[1 : n + 1] = torch.cat(ticks)
        key = torch.cat(keys) if keys else held
        order = torch.argsort(key)
        index = torch.stack([key.index_select(0, order), held.index_select(0, order)])
        self._index = torch.cat([index, torch.tensor([[INF], [0]], device=self.device)], 1)
        self._free = self._free_rows()


class RowCache:
    """Rows of one table (width ``dim``) by id; ``capacity_rows`` 0 means unlimited: one block
    of :class:`RowCaches`, with the same rules, on ids in any order.

    ``find`` -> ``gather`` -> ``store``: look a batch's unique ids up (row slots, held mask), read
    the held rows, then write the batch's rows back under its ids (which makes them the most
    recent and evicts past the capacity). Tensors on ``device`` (ids given elsewhere are moved).
    """

    def __init__(
        self,
        dim: int,
        capacity_rows: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.caches = RowCaches([dim], capacity_rows, dtype, device, backend)
        self.dim, self.capacity = dim, capacity_rows

    @property
    def host(self) -> bool:
        return self.caches.host

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def device(self) -> torch.device:
        return self.caches.device

    def to_(self, device: torch.device) -> RowCache:
        self.caches.to_(device)
        return self

    @property
    def nbytes(self) -> int:
        """Memory allocated: the row table (capacity x dim x dtype once full; grown by doubling
        while it fills) and the index tensors (ids, slots, ticks, free rows)."""
        return self.caches.nbytes

    def find(self, ids: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots int64 [n]: the row holding each id, -1 where not held; held bool [n])."""
        rows, held, _ = self.caches.find(self._index(ids).view(1, -1))
        return rows.view(-1) - 1, held.view(-1)

    def gather(self, slots: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows [n, dim] at ``slots`` (from :meth:`find`); zeros where a slot is -1."""
        s = self._index(slots)
        return torch.where((s < 0)[:, None], 0, self.peek(s))

    def peek(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows [n, dim] at ``slots`` (from :meth:`find`), unspecified where a slot is -1."""
        return self.caches.peek(self._index(slots).clamp(min=-1) + 1)

    def store(
        self,
        ids: torch.Tensor | np.ndarray,
        rows: torch.Tensor,
        slots: torch.Tensor | np.ndarray | None = None,
        n_held: int | None = None,
    ) -> None:
        """Hold ``rows`` [n, dim] under ``ids`` (unique), making them the most recent, then evict
        past the capacity (module docstring). ``slots``: :meth:`find`'s answer for these ids, if
        nothing changed the cache since (saves the search); ``n_held``: how many of them it
        found, if the caller knows (saves the host read)."""
        q = self._index(ids)
        if q.numel() == 0:
            return
        s = self.find(q)[0] if slots is None else self._index(slots)
        order = torch.argsort(q)
        q, s = q.index_select(0, order), s.index_select(0, order)
        held = s >= 0
        if n_held is None:
            n_held = int(held.sum())  # the host read: the index's new size depends on it
        values = rows.to(self.device).index_select(0, order)
        valid = torch.ones_like(held)
        keys = self.caches.keys(q[None])
        self.caches.store(keys, values[None], (s + 1)[None], held[None], valid[None], [q.numel()], [n_held])

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [n]: held, rows [n, dim]: the held rows, zeros where not held)."""
        slots, held = self.find(ids)
        return held, self.gather(slots)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.caches.rows(0, ids)

    def ids(self) -> list[int]:
        """Held ids, least recent first (for comparing two copies)."""
        return self.caches.ids(0)

    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`load_state_dict` needs to continue exactly (tensors and ints): a
        restored copy evicts and answers as this one would."""
        return self.caches.block_state(0)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.caches.load_blocks([state])

    def _index(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """int64 [n] ids or slots on the cache's device."""
        if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.dim() == 1 and x.device == self.device:
            return x.detach()
        return torch.as_tensor(x).detach().reshape(-1).to(self.device, torch.int64)


_COLUMNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _columns(n: int, device: torch.device) -> torch.Tensor:
    """[1, n]: 0..n-1 (int64) on ``device``, made once per size and device (the chunk's rows)."""
    key = (n, torch.device(device))
    if key not in _COLUMNS:
        if len(_COLUMNS) > 64:  # a bounded memo: a few chunk sizes recur
            _COLUMNS.clear()
        _COLUMNS[key] = torch.arange(n, device=device)[None, :]
    return _COLUMNS[key]


_INF: dict[torch.device, torch.Tensor] = {}


def _inf(device: torch.device) -> torch.Tensor:
    """:data:`INF` as an int64 0-d tensor on ``device``, made once per device."""
    if device not in _INF:
        _INF[device] = torch.tensor(INF, dtype=torch.int64).to(device)
    return _INF[device]


def _on_int(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host integers as an int64 tensor on ``device``, sent without waiting for its queue."""
    t = torch.tensor(list(values), dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def positions(keep: torch.Tensor, n: int, host: bool) -> torch.Tensor:
    """``keep.nonzero().flatten()`` when the host knows ``n = keep.sum()``: on a device, each kept
    element's rank scattered to it (the others to one spare place), which needs no host
    synchronisation, unlike ``nonzero`` or a mask index. ``host``: the host backend's
    ``nonzero`` for a CPU tensor (``Backend.host_compaction``: ~5x the scatter there)."""
    if n == 0 or n == keep.numel():
        return torch.arange(n, device=keep.device)
    if host and keep.device.type == "cpu":
        return keep.nonzero().flatten()
    at = torch.arange(keep.numel(), device=keep.device)
    dest = torch.where(keep, keep.cumsum(0) - 1, n)
    return at.new_empty(n + 1).index_copy_(0, dest, at)[:n]


def compact(x: torch.Tensor, keep: torch.Tensor, n: int, host: bool) -> torch.Tensor:
    """``x[keep]`` (along dim 0) when the host knows ``n = keep.sum()``, without a host wait
    (``host``: as :func:`positions`)."""
    if n == x.shape[0] or n == 0:
        return x[:n]
    return x.index_select(0, positions(keep, n, host))
