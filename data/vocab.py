"""Streaming per-feature vocabularies: count raw values chunk by chunk, then map them to ids.

Counting keeps a sorted (values, counts) table per feature; chunk summaries are merged with
each other like a binary counter and into the table once they are as large as it, so the total
work is O(n log n) with numpy sorts and memory grows with the number of distinct values only.
Ids: 0 = missing, 1 = rare (values seen fewer than ``frequency_threshold`` times, when it is
> 0), then the kept values in ascending raw-value order.
"""

from __future__ import annotations

import numpy as np

from data.layout import MISSING_ID, RARE_ID


def _merge(values: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    v = np.concatenate(values)
    c = np.concatenate(counts)
    if not len(v):
        return v, c
    order = np.argsort(v, kind="stable")
    v, c = v[order], c[order]
    first = np.flatnonzero(np.concatenate([[True], v[1:] != v[:-1]]))
    return v[first], np.add.reduceat(c, first)


class ValueCounter:
    """Occurrence counts of the uint64 values of one feature, fed in chunks."""

    def __init__(self) -> None:
        self.values = np.zeros(0, dtype=np.uint64)
        self.counts = np.zeros(0, dtype=np.int64)
        self._pending_v: list[np.ndarray] = []
        self._pending_c: list[np.ndarray] = []
        self._pending = 0

    def add(self, values: np.ndarray) -> None:
        """Count one chunk of (non-missing) values."""
        if len(values):
            self.add_counts(*np.unique(values.astype(np.uint64, copy=False), return_counts=True))

    def add_counts(self, values: np.ndarray, counts: np.ndarray) -> None:
        """Count sorted distinct ``values`` seen ``counts`` times each (another counter's result)."""
        if not len(values):
            return
        self._pending_v.append(values.astype(np.uint64, copy=False))
        self._pending_c.append(counts.astype(np.int64, copy=False))
        self._pending += len(values)
        # Merge neighbours of similar size (a binary counter): O(log n) live arrays, each value
        # re-sorted O(log n) times. Many long-lived small arrays would also fragment the heap
        # (measured: the RSS then creeps up with the file size).
        while len(self._pending_v) > 1 and len(self._pending_v[-2]) <= 2 * len(self._pending_v[-1]):
            v, c = _merge(self._pending_v[-2:], self._pending_c[-2:])
            self._pending -= len(self._pending_v[-2]) + len(self._pending_v[-1]) - len(v)
            self._pending_v[-2:], self._pending_c[-2:] = [v], [c]
        if self._pending >= len(self.values):
            self._flush()

    def _flush(self) -> None:
        if self._pending_v:
            self.values, self.counts = _merge([self.values, *self._pending_v], [self.counts, *self._pending_c])
            self._pending_v, self._pending_c, self._pending = [], [], 0

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted distinct values and their counts."""
        self._flush()
        return self.values, self.counts


class IdMap:
    """Raw value -> contiguous id of one feature, by binary search in the sorted kept values."""

    def __init__(self, kept: np.ndarray, frequency_threshold: int = 0) -> None:
        self.threshold = frequency_threshold
        self.kept = kept
        self.base = RARE_ID + 1 if frequency_threshold > 0 else MISSING_ID + 1
        self.num_embeddings = self.base + len(self.kept)

    @classmethod
    def from_counts(cls, values: np.ndarray, counts: np.ndarray, frequency_threshold: int = 0) -> IdMap:
        """The map of a counter's result: values seen fewer than the threshold times become rare."""
        return cls(values[counts >= frequency_threshold] if frequency_threshold > 0 else values, frequency_threshold)

    def __call__(self, values: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Ids (int64) of a chunk of raw values; ``missing`` rows get id 0."""
        values = values.astype(np.uint64, copy=False)
        pos = np.searchsorted(self.kept, values)
        found = pos < len(self.kept)
        found[found] = self.kept[pos[found]] == values[found]
        if self.threshold == 0 and not np.all(found | missing):
            raise RuntimeError(
                "a value was not seen by the counting pass: did an input file change while it was being preprocessed?"
            )
        ids = np.where(found, pos + self.base, RARE_ID)
        return np.where(missing, MISSING_ID, ids).astype(np.int64)
