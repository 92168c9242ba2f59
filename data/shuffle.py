"""An epoch's row order: a seeded permutation of ``[0, n)`` read by position ranges.

Up to ``EXPLICIT_MAX`` rows (Criteo Kaggle's 39M included) it is numpy's own permutation held in
memory (4 bytes per row). Above that (Criteo Terabyte's 4.2 billion rows would take 17-34 GB per
rank, and minutes to draw every epoch) it is a keyed Feistel network over the next power of 4,
with cycle walking back into ``[0, n)``: a bijection evaluated per position in O(1) memory.
Both depend on ``(seed, epoch)`` only, never on the world size.
"""

from __future__ import annotations

import numpy as np

EXPLICIT_MAX = 1 << 27  # 134M rows: 512 MB as int32
_ROUNDS = 4  # Luby-Rackoff: four rounds of a random function give a pseudo-random permutation


class EpochOrder:
    """``order[lo:hi]`` of one epoch's permutation (the identity when not shuffling)."""

    def __init__(self, n: int, shuffle: bool, seed: int, epoch: int) -> None:
        if n < 0:
            raise ValueError(f"row count must be >= 0, got {n}")
        self.n, self.shuffle = n, shuffle
        self._dtype = np.int32 if n < 2**31 else np.int64
        self._explicit: np.ndarray | None = None
        self._keys: np.ndarray | None = None
        if shuffle and n <= EXPLICIT_MAX:
            self._explicit = np.random.default_rng([seed, epoch]).permutation(n).astype(self._dtype, copy=False)
        elif shuffle:
            self._half = max(1, ((n - 1).bit_length() + 1) // 2)  # domain 4**half >= n, < 4n
            rng = np.random.default_rng([seed, epoch, 0xFE15])
            self._keys = rng.integers(0, 2**63, size=_ROUNDS, dtype=np.uint64)

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, step = s.indices(self.n)
        if step != 1:
            raise ValueError("EpochOrder supports contiguous slices only")
        if self._explicit is not None:
            return self._explicit[lo:hi]
        positions = np.arange(lo, max(lo, hi), dtype=np.int64)
        if not self.shuffle:
            return positions.astype(self._dtype, copy=False)
        return self.permute(positions).astype(self._dtype, copy=False)

    def permute(self, positions: np.ndarray) -> np.ndarray:
        """The Feistel permutation of ``positions`` (each in ``[0, n)``), cycle-walked into range."""
        x = self._feistel(positions.astype(np.uint64))
        out = x >= self.n
        while out.any():  # a bijection of the 4**half domain: walking its cycles stays one on [0, n)
            x[out] = self._feistel(x[out])
            out = x >= self.n
        return x.astype(np.int64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        mask = np.uint64((1 << self._half) - 1)
        left, right = x >> h, x & mask
        assert self._keys is not None  # drawn in __init__ together with _half
        with np.errstate(over="ignore"):  # uint64 multiplies wrap on purpose
            for k in self._keys:
                f = (right ^ k) * np.uint64(0x9E3779B97F4A7C15)  # splitmix64-style mixing
                f ^= f >> np.uint64(31)
                f *= np.uint64(0xBF58476D1CE4E5B9)
                f ^= f >> np.uint64(29)
                left, right = right, (left ^ f) & mask
        return (left << h) | right
