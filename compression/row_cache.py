"""A bounded row cache keyed by id, with deterministic least-recently-used eviction.

Two copies driven by the same sequence of calls hold the same ids and rows: a sender can mirror
what a receiver holds without asking it. Recency is the order of :meth:`RowCache.touch` calls,
and within one call the order of its ids (callers pass them sorted), so ties never depend on
hashing or timing.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class RowCache:
    """Rows of one table (width ``dim``) by id; ``capacity_rows`` 0 means unlimited."""

    def __init__(self, dim: int, capacity_rows: int = 0, dtype: torch.dtype = torch.float32) -> None:
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}")
        self.dim, self.capacity = dim, capacity_rows
        self._slot: OrderedDict[int, int] = OrderedDict()  # id -> row of _rows, oldest first
        self._free: list[int] = []
        self._rows = torch.empty(0, dim, dtype=dtype)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def nbytes(self) -> int:
        """Memory of the rows held (the slot table aside)."""
        return len(self._slot) * self.dim * self._rows.element_size()

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [n]: held, rows [n, dim]: the held rows, zeros where not held)."""
        slots = torch.tensor([self._slot.get(i, -1) for i in ids.tolist()], dtype=torch.int64)
        held = slots >= 0
        rows = self._rows.new_zeros(ids.numel(), self.dim)
        rows[held] = self._rows[slots[held]]
        return held, rows

    def put(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` under ``ids`` (unique; new ids become the most recent, held ones keep their place)."""
        slots = []
        for i in ids.tolist():
            slot = self._slot.get(i)
            if slot is None:
                slot = self._free.pop() if self._free else self._grow()
                self._slot[i] = slot
            slots.append(slot)
        if slots:  # one copy (ids are unique: the dedup plan's)
            self._rows[torch.tensor(slots, dtype=torch.int64)] = rows.to(self._rows.dtype)

    def touch(self, ids: torch.Tensor) -> None:
        """Make ``ids`` (those held) the most recent, in the given order, then evict the oldest
        beyond the capacity."""
        for i in ids.tolist():
            if i in self._slot:
                self._slot.move_to_end(i)
        while self.capacity and len(self._slot) > self.capacity:
            _, slot = self._slot.popitem(last=False)
            self._free.append(slot)

    def ids(self) -> list[int]:
        """Held ids, least recent first (for comparing two copies)."""
        return list(self._slot)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)[1]

    def _grow(self) -> int:
        n = self._rows.shape[0]
        bigger = self._rows.new_empty(max(2 * n, 1024), self.dim)
        bigger[:n] = self._rows
        self._free.extend(range(bigger.shape[0] - 1, n, -1))  # popped from the end: n + 1 first
        self._rows = bigger
        return n
