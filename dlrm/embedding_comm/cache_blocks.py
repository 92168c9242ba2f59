"""Per-block views of :class:`compression.row_cache.RowCaches` (what tests, the probe and the
checkpoint see of :attr:`dlrm.embedding_comm.forward_cache.ForwardCache.caches`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dlrm_compression.row_cache import RowCaches


class Block:
    """One block's cache in its chunk's :class:`RowCaches` (the per-block view the tests and the
    checkpoint see)."""

    def __init__(self, group: RowCaches, k: int) -> None:
        self.group, self.k = group, k

    def ids(self) -> list[int]:
        """Held ids, least recent first."""
        return self.group.ids(self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.group.rows(self.k, ids)

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(held bool [n], rows: the held rows, zeros where not held)."""
        return self.group.lookup(self.k, ids)

    def __len__(self) -> int:
        return self.group.lengths()[self.k]

    def state_dict(self) -> dict[str, Any]:
        return self.group.block_state(self.k)


class SavedBlock:
    """A restored block's cache state, not yet taken up by a chunk."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    def _caches(self) -> RowCaches:
        caches = RowCaches([int(self.state["dim"])], int(self.state["capacity"]), self.state["rows"].dtype)
        caches.load_blocks([self.state])
        return caches

    def ids(self) -> list[int]:
        return self._caches().ids(0)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._caches().rows(0, ids)

    @property
    def nbytes(self) -> int:
        return self._caches().nbytes

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)
