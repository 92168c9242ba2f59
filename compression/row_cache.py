"""A bounded row cache keyed by id, with deterministic least-recently-used eviction, in arrays.

Two copies driven by the same sequence of calls hold the same ids and rows: a sender can mirror
what a receiver holds without asking it. The index is a few flat arrays, searched and updated a
whole batch of ids at a time (no per-id Python): the held ids in ascending order (found with
``searchsorted``), the row of the row table that holds each, and one tick per row (the
:meth:`RowCache.store` call that last used it).

Eviction rule: each :meth:`RowCache.store` call is one tick; it makes all its ids the most recent,
and among ids of the same tick the larger id counts as more recent (as if they had been touched
one by one in ascending order). After a call, while more than ``capacity_rows`` ids are held, the
least recent (smallest ``(tick, id)``) go, all chosen at once; if a call brings more ids than the
capacity, its own smallest ids are not kept. Nothing depends on hashing, timing or slot numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

_EMPTY = np.empty(0, dtype=np.int64)
_INDEX = ("ids", "slots", "ticks", "free")  # the index arrays (int64)


class RowCache:
    """Rows of one table (width ``dim``) by id; ``capacity_rows`` 0 means unlimited.

    ``find`` -> ``gather`` -> ``store``: look a batch's unique ids up (row slots, held mask), read
    the held rows, then write the batch's rows back under its ids (which makes them the most
    recent and evicts past the capacity). CPU tensors.
    """

    def __init__(self, dim: int, capacity_rows: int = 0, dtype: torch.dtype = torch.float32) -> None:
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}")
        self.dim, self.capacity = dim, capacity_rows
        self._ids = _EMPTY  # held ids, ascending
        self._slots = _EMPTY  # the row of _rows holding each id of _ids
        self._ticks = _EMPTY  # per row of _rows: the store() call that last used it
        self._free = _EMPTY  # rows of _rows holding nothing (taken from the end)
        self._rows = torch.empty(0, dim, dtype=dtype)
        self._clock = 0

    def __len__(self) -> int:
        return int(self._ids.size)

    @property
    def nbytes(self) -> int:
        """Memory allocated: the row table (capacity x dim x dtype once full; grown by doubling
        while it fills) and the index arrays (ids, slots, ticks, free rows)."""
        index = self._ids.nbytes + self._slots.nbytes + self._ticks.nbytes + self._free.nbytes
        return self._rows.numel() * self._rows.element_size() + index

    def find(self, ids: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots int64 [n]: the row holding each id, -1 where not held; held bool [n])."""
        slots = self._find(_host(ids))
        return torch.from_numpy(slots), torch.from_numpy(slots >= 0)

    def gather(self, slots: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows [n, dim] at ``slots`` (from :meth:`find`); zeros where a slot is -1."""
        s = _host(slots)
        if self._rows.shape[0] == 0:
            return self._rows.new_zeros(s.size, self.dim)
        held = s >= 0
        if held.all():
            return self._rows[torch.from_numpy(s)]
        rows = self._rows.new_zeros(s.size, self.dim)
        rows[torch.from_numpy(held)] = self._rows[torch.from_numpy(s[held])]
        return rows

    def store(
        self, ids: torch.Tensor | np.ndarray, rows: torch.Tensor, slots: torch.Tensor | np.ndarray | None = None
    ) -> None:
        """Hold ``rows`` [n, dim] under ``ids`` (unique), making them the most recent, then evict
        past the capacity (module docstring). ``slots``: :meth:`find`'s answer for these ids, if
        nothing changed the cache since (saves the search)."""
        q = _host(ids)
        if q.size == 0:
            return
        self._clock += 1
        s = self._find(q) if slots is None else _host(slots).copy()
        held = s >= 0
        self._ticks[s[held]] = self._clock
        new = np.flatnonzero(~held)
        excess = len(self) + new.size - self.capacity if self.capacity else 0
        if excess > 0:
            older = np.flatnonzero(self._ticks[self._slots] < self._clock)  # not in this call
            if excess <= older.size:
                gone = older[_smallest(self._ticks[self._slots[older]], excess)]
            else:  # every older id goes, and this call's smallest ids (held or new) are not kept
                gone = older
                dropped = np.sort(q)[: excess - older.size]
                out = np.isin(q, dropped)
                gone = np.concatenate([gone, np.searchsorted(self._ids, q[out & held])])
                s[out] = -1
                new = new[~out[new]]
            self._free = np.concatenate([self._free, self._slots[gone]])
            self._ids, self._slots = np.delete(self._ids, gone), np.delete(self._slots, gone)
        if new.size:
            self._insert(q[new], new, s)
        write = np.flatnonzero(s >= 0)
        if write.size == q.size:  # the usual case: one copy of every row
            self._rows.index_copy_(0, torch.from_numpy(s), rows.to(self._rows.dtype))
        elif write.size:
            at = torch.from_numpy(write)
            self._rows.index_copy_(0, torch.from_numpy(s[write]), rows.index_select(0, at).to(self._rows.dtype))

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [n]: held, rows [n, dim]: the held rows, zeros where not held)."""
        slots, held = self.find(ids)
        return held, self.gather(slots)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)[1]

    def ids(self) -> list[int]:
        """Held ids, least recent first (for comparing two copies)."""
        return self._ids[np.lexsort((self._ids, self._ticks[self._slots]))].tolist()

    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`load_state_dict` needs to continue exactly (tensors and ints): a
        restored copy evicts and answers as this one would."""
        arrays = {k: torch.from_numpy(getattr(self, f"_{k}").copy()) for k in _INDEX}
        return {"dim": self.dim, "capacity": self.capacity, "clock": self._clock, "rows": self._rows.clone(), **arrays}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (state["dim"], state["capacity"]) != (self.dim, self.capacity):
            raise ValueError(
                f"the saved row cache holds rows of width {state['dim']} with capacity {state['capacity']}; this one "
                f"has width {self.dim} and capacity {self.capacity} (compression.forward.cache.capacity_rows changed?)"
            )
        for k in _INDEX:
            setattr(self, f"_{k}", state[k].cpu().numpy().astype(np.int64))
        self._rows = state["rows"].cpu().to(self._rows.dtype).clone()
        self._clock = int(state["clock"])

    def _find(self, q: np.ndarray) -> np.ndarray:
        n = self._ids.size
        if n == 0 or q.size == 0:
            return np.full(q.size, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._ids, q), n - 1)
        return np.where(self._ids[pos] == q, self._slots[pos], -1)

    def _insert(self, new_ids: np.ndarray, where: np.ndarray, s: np.ndarray) -> None:
        """Give ``new_ids`` (at positions ``where`` of the call) free rows, this call's tick, and
        their place in the sorted index; ``s`` gets their rows."""
        k = new_ids.size
        if k > self._free.size:
            self._grow(k - self._free.size)
        got = self._free[self._free.size - k :][::-1]
        self._free = self._free[: self._free.size - k]
        s[where] = got
        self._ticks[got] = self._clock
        order = np.argsort(new_ids)
        at = np.searchsorted(self._ids, new_ids[order]) + np.arange(k)  # places in the merged index
        ids, slots = np.empty(self._ids.size + k, dtype=np.int64), np.empty(self._ids.size + k, dtype=np.int64)
        old = np.ones(ids.size, dtype=bool)
        old[at] = False
        ids[at], slots[at] = new_ids[order], got[order]
        ids[old], slots[old] = self._ids, self._slots
        self._ids, self._slots = ids, slots

    def _grow(self, need: int) -> None:
        n = self._rows.shape[0]
        size = max(2 * n, n + need, 1024)
        if self.capacity:
            size = max(min(size, self.capacity), n + need)
        bigger = self._rows.new_empty(size, self.dim)
        bigger[:n] = self._rows
        self._rows = bigger
        self._ticks = np.concatenate([self._ticks, np.zeros(size - n, dtype=np.int64)])
        # taken from the end: row n first
        self._free = np.concatenate([np.arange(size - 1, n - 1, -1, dtype=np.int64), self._free])


def _smallest(ticks: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` smallest ``(tick, position)`` pairs (positions are in ascending id
    order, so this is the least recent by the module's rule), in any order."""
    key = ticks * ticks.size + np.arange(ticks.size, dtype=np.int64)
    if k >= key.size:
        return np.arange(key.size)
    return np.argpartition(key, k - 1)[:k]


def _host(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """int64 host array of ids or slots."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).astype(np.int64, copy=False)
    return x.detach().reshape(-1).to("cpu", torch.int64).numpy()
