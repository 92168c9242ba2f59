"""A bounded row cache keyed by id, with deterministic least-recently-used eviction, in tensors.

Two copies driven by the same sequence of calls hold the same ids and rows: a sender can mirror
what a receiver holds without asking it. The index is a few flat arrays, searched and updated a
whole batch of ids at a time (no per-id Python): the held ids in ascending order (found with
``searchsorted``), the row of the row table that holds each, and one tick per row (the
:meth:`RowCache.store` call that last used it). Everything lives on one device (the rows' own,
CPU or an accelerator): ``find`` and ``gather`` make no host synchronisation, ``store`` one (how
many of its ids are new: the index's new size), plus a few when a call brings more ids than the
capacity.

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

from .backend import Backend, backend_for

_INDEX = ("ids", "slots", "ticks", "free")  # the index tensors (int64)


class RowCache:
    """Rows of one table (width ``dim``) by id; ``capacity_rows`` 0 means unlimited.

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
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}")
        self.dim, self.capacity = dim, capacity_rows
        empty = torch.empty(0, dtype=torch.int64, device=device)
        self._index_ = empty.new_empty(2, 0)  # held ids, ascending, over the row of _rows holding each
        self._ticks = empty  # per row of _rows: the store() call that last used it
        self._free = empty  # rows of _rows holding nothing (taken from the end)
        self._rows = torch.empty(0, dim, dtype=dtype, device=device)
        self._clock = 0
        # the host's compactions (nonzero), or the device's that never wait (default: the device's choice)
        self.host = (backend or backend_for(self._rows.device)).host_compaction

    def __len__(self) -> int:
        return self._ids.numel()

    @property
    def _ids(self) -> torch.Tensor:
        return self._index_[0]

    @property
    def _slots(self) -> torch.Tensor:
        return self._index_[1]

    @property
    def device(self) -> torch.device:
        return self._rows.device

    def to_(self, device: torch.device) -> RowCache:
        """Move the cache (index and rows) to ``device``, in place (a restored checkpoint's)."""
        self._index_, self._ticks, self._free = (t.to(device) for t in (self._index_, self._ticks, self._free))
        self._rows = self._rows.to(device)
        return self

    @property
    def nbytes(self) -> int:
        """Memory allocated: the row table (capacity x dim x dtype once full; grown by doubling
        while it fills) and the index tensors (ids, slots, ticks, free rows)."""
        index = (self._index_.numel() + self._ticks.numel() + self._free.numel()) * 8
        return self._rows.numel() * self._rows.element_size() + index

    def find(self, ids: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots int64 [n]: the row holding each id, -1 where not held; held bool [n])."""
        slots = self._find(self._index(ids))
        return slots, slots >= 0

    def gather(self, slots: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows [n, dim] at ``slots`` (from :meth:`find`); zeros where a slot is -1."""
        s = self._index(slots)
        if self._rows.shape[0] == 0:
            return self._rows.new_zeros(s.numel(), self.dim)
        rows, miss = self._rows.index_select(0, s.clamp(min=0)), s < 0
        if self.host:  # ~3x faster on a CPU than the broadcast where
            return rows.index_fill_(0, miss.nonzero().flatten(), 0)
        return torch.where(miss.unsqueeze(1), 0, rows)

    def peek(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows [n, dim] at ``slots`` (from :meth:`find`), unspecified where a slot is -1: for a
        caller that overwrites those rows (one op, where :meth:`gather` zeroes them)."""
        s = self._index(slots)
        if self._rows.shape[0] == 0:
            return self._rows.new_zeros(s.numel(), self.dim)
        return self._rows.index_select(0, s.clamp(min=0))

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
        self._clock += 1
        s = self._find(q) if slots is None else self._index(slots)  # replaced, never written
        held = s >= 0
        if n_held is None:
            n_held = int(held.sum())  # the host read: the index's new size depends on it
        if n_held:
            self._ticks.index_fill_(0, compact(s, held, n_held, self.host), self._clock)
        n, n_new, new = len(self), q.numel() - n_held, ~held
        excess = n + n_new - self.capacity if self.capacity else 0
        written = q.numel()  # ids whose rows are kept
        if excess > 0:
            n_older = n - n_held  # ids not in this call
            if excess <= n_older:  # the least recent (smallest (tick, position)) go; this call's are the most recent
                key = self._ticks.index_select(0, self._slots) * n + torch.arange(n, device=q.device)
                gone = torch.topk(key, excess, largest=False).indices
            else:  # every older id goes, and this call's smallest ids (held or new) are not kept
                older = positions(self._ticks.index_select(0, self._slots) < self._clock, n_older, self.host)
                out = q <= torch.sort(q).values[excess - n_older - 1]
                dropped = out & held
                k = int(dropped.sum())
                gone = torch.cat([older, torch.searchsorted(self._ids, compact(q, dropped, k, self.host))])
                s = torch.where(out, -1, s)
                new &= ~out
                n_new -= excess - n_older - k
                written -= excess - n_older
            self._free = torch.cat([self._free, self._slots.index_select(0, gone)])
            keep = torch.ones(n, dtype=torch.bool, device=q.device)
            keep[gone] = False
            self._index_ = self._index_.index_select(1, positions(keep, n - gone.numel(), self.host))
        if n_new:
            s = self._insert(q, new, n_new, s)
        rows = rows.to(self._rows.device, self._rows.dtype)
        if written == q.numel():  # the usual case: one copy of every row
            self._rows.index_copy_(0, s, rows)
        elif written:
            at = positions(s >= 0, written, self.host)
            self._rows.index_copy_(0, s.index_select(0, at), rows.index_select(0, at))

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [n]: held, rows [n, dim]: the held rows, zeros where not held)."""
        slots, held = self.find(ids)
        return held, self.gather(slots)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)[1]

    def ids(self) -> list[int]:
        """Held ids, least recent first (for comparing two copies)."""
        return self._ids[torch.argsort(self._ticks[self._slots], stable=True)].tolist()  # ids ascend within a tick

    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`load_state_dict` needs to continue exactly (tensors and ints): a
        restored copy evicts and answers as this one would."""
        arrays = {k: getattr(self, f"_{k}").clone() for k in _INDEX}
        return {"dim": self.dim, "capacity": self.capacity, "clock": self._clock, "rows": self._rows.clone(), **arrays}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (state["dim"], state["capacity"]) != (self.dim, self.capacity):
            raise ValueError(
                f"the saved row cache holds rows of width {state['dim']} with capacity {state['capacity']}; this one "
                f"has width {self.dim} and capacity {self.capacity} (compression.forward.cache.capacity_rows changed?)"
            )
        ids, slots, self._ticks, self._free = (
            torch.as_tensor(state[k]).to(self.device, torch.int64).clone() for k in _INDEX
        )
        self._index_ = torch.stack([ids, slots])
        self._rows = state["rows"].to(self.device, self._rows.dtype).clone()
        self._clock = int(state["clock"])

    def _index(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """int64 [n] ids or slots on the cache's device."""
        if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.dim() == 1 and x.device == self.device:
            return x.detach()
        return torch.as_tensor(x).detach().reshape(-1).to(self.device, torch.int64)

    def _find(self, q: torch.Tensor) -> torch.Tensor:
        n = self._ids.numel()
        if n == 0 or q.numel() == 0:
            return torch.full_like(q, -1)
        pos = torch.searchsorted(self._ids, q).clamp_(max=n - 1)
        ids, slots = self._index_.index_select(1, pos)
        return torch.where(ids == q, slots, -1)

    def _insert(self, q: torch.Tensor, new: torch.Tensor, k: int, s: torch.Tensor) -> torch.Tensor:
        """Give the ``k`` ids ``q[new]`` free rows, this call's tick, and their place in the
        sorted index; returns ``s`` with their rows."""
        if k > self._free.numel():
            self._grow(k - self._free.numel())
        got = self._free[self._free.numel() - k :].flip(0)
        self._free = self._free[: self._free.numel() - k]
        new_at = positions(new, k, self.host)
        s = s.index_copy(0, new_at, got)  # the i-th new id takes got[i]
        self._ticks.index_fill_(0, got, self._clock)
        new_ids, order = torch.sort(q.index_select(0, new_at))
        n = self._ids.numel()
        at = torch.searchsorted(self._ids, new_ids) + torch.arange(k, device=q.device)  # places in the merged index
        old = torch.ones(n + k, dtype=torch.bool, device=q.device)
        old[at] = False
        index = self._index_.new_empty(2, n + k)
        index.index_copy_(1, at, torch.stack([new_ids, got.index_select(0, order)]))
        self._index_ = index.index_copy_(1, positions(old, n, self.host), self._index_)
        return s

    def _grow(self, need: int) -> None:
        n = self._rows.shape[0]
        size = max(2 * n, n + need, 1024)
        if self.capacity:
            size = max(min(size, self.capacity), n + need)
        bigger = self._rows.new_empty(size, self.dim)
        bigger[:n] = self._rows
        self._rows = bigger
        self._ticks = torch.cat([self._ticks, self._ticks.new_zeros(size - n)])
        # taken from the end: row n first
        self._free = torch.cat([torch.arange(size - 1, n - 1, -1, device=self.device), self._free])


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
