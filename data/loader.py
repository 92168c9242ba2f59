"""Batches of a preprocessed (or synthetic) dataset for one rank, as TorchRec ``Batch`` objects.

Row order: the rows of the given stems are concatenated in the given order; with ``shuffle`` the
epoch's order is a permutation drawn from ``(seed, epoch)`` only (``data.shuffle``: held in
memory up to 134M rows, computed per position above), so it does not depend on the world size.
Global batch ``g`` is the ``batch_size * world_size`` consecutive rows
``g*B*W .. (g+1)*B*W`` of that order and rank ``r`` takes its ``r``-th slice of ``batch_size``
rows; hence for a fixed global batch size, every global batch holds the same rows whatever the
world size. The final partial global batch is split as evenly as possible over the ranks (sizes
differ by at most one row) and dropped when ``drop_last`` or when it has fewer rows than ranks,
so every rank yields the same number of batches and collectives never wait on a missing rank.
Arrays are memory-mapped; only the rows of the current batch are read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data.layout import DatasetError, array_path, read_meta
from data.shuffle import EpochOrder


def dataset_info(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The dataset's meta.json: ``num_embeddings`` (table sizes with reserved ids),
    ``sparse_features``/``dense_features`` names, ``rows`` per stem, and provenance."""
    return read_meta(data_dir)


_SLICE = re.compile(r"^(?P<stem>[^\[\]]+)\[(?P<lo>[0-9.]*):(?P<hi>[0-9.]*)\]$")


def parse_stem(spec: str) -> tuple[str, float, float]:
    """``"day_23[0.5:]"`` -> ``("day_23", 0.5, 1.0)``: a stem, or a fraction range of its rows.

    The published protocols evaluate on halves of the last day (Terabyte day 23, Kaggle day 6):
    ``val_stems=[day_23[:0.5]]``, ``test_stems=[day_23[0.5:]]``.
    """
    m = _SLICE.match(spec)
    if m is None:
        if "[" in spec or "]" in spec:
            raise ValueError(f"stem {spec!r}: a row range is written stem[lo:hi] with fractions, e.g. day_23[0.5:]")
        return spec, 0.0, 1.0
    lo, hi = float(m["lo"] or 0.0), float(m["hi"] or 1.0)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"stem {spec!r}: need 0 <= lo < hi <= 1 (got {lo}, {hi})")
    return m["stem"], lo, hi


def _open_stem(data_dir: str | os.PathLike, spec: str, meta: dict[str, Any]) -> tuple[np.ndarray, ...]:
    stem, lo, hi = parse_stem(spec)
    if stem not in meta["rows"]:
        raise DatasetError(f"{data_dir}: no stem {stem!r}; it has {sorted(meta['rows'])}")
    arrays = []
    for kind, width in (
        ("dense", len(meta["dense_features"])),
        ("sparse", len(meta["sparse_features"])),
        ("labels", None),
    ):
        path = array_path(data_dir, stem, kind)
        if not path.is_file():
            raise DatasetError(f"{path}: missing array of stem {stem!r}")
        a = np.load(path, mmap_mode="r")
        want = (meta["rows"][stem],) if width is None else (meta["rows"][stem], width)
        if a.shape != want:
            raise DatasetError(f"{path}: shape {a.shape}, meta.json says {want}")
        arrays.append(a)
    n = meta["rows"][stem]
    first, last = round(n * lo), round(n * hi)
    return tuple(a[first:last] for a in arrays)


def _split(n: int, parts: int, r: int) -> tuple[int, int]:
    """Bounds of part ``r`` when ``n`` items are split into ``parts`` sizes differing by at most 1."""
    base, extra = divmod(n, parts)
    lo = r * base + min(r, extra)
    return lo, lo + base + (r < extra)


class CriteoBatches:
    """This rank's batches of ``stems`` for one epoch (see the module docstring for the order);
    ``len()`` is the number of batches it yields. ``start_batch`` skips that many batches without
    reading them (resume from a checkpoint)."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        stems: list[str],
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        epoch: int = 0,
        start_batch: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size={batch_size}, rank={rank}, world_size={world_size}")
        if not stems:
            raise ValueError("no stems given")
        meta = read_meta(data_dir)
        self.keys = list(meta["sparse_features"])
        self._arrays = [_open_stem(data_dir, s, meta) for s in stems]
        sizes = [len(a[2]) for a in self._arrays]
        self._offsets = np.cumsum([0, *sizes])
        self.num_rows = int(self._offsets[-1])
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, epoch
        global_batch = batch_size * world_size
        full, tail = divmod(self.num_rows, global_batch)
        self._tail = tail if tail >= world_size and not drop_last else 0
        self.batches_per_epoch = full + (self._tail > 0)
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch={start_batch} outside 0..{self.batches_per_epoch} (batches per epoch)")
        self.start_batch = start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def order(self) -> EpochOrder:
        """The epoch's global row order (identical on every rank), sliceable by position."""
        return EpochOrder(self.num_rows, self.shuffle, self.seed, self.epoch)

    def rows_of(self, batch: int, order: EpochOrder | None = None) -> np.ndarray:
        """Global row indices that this rank reads for batch number ``batch``."""
        order = self.order() if order is None else order
        gb = self.batch_size * self.world_size
        g0 = batch * gb
        if g0 + gb <= self.num_rows:
            lo, hi = g0 + self.rank * self.batch_size, g0 + (self.rank + 1) * self.batch_size
        else:
            lo, hi = _split(self._tail, self.world_size, self.rank)
            lo, hi = g0 + lo, g0 + hi
        return order[lo:hi]

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self._arrays) == 1:
            dense, sparse, labels = self._arrays[0]
            return dense[rows], sparse[rows], labels[rows]
        dense = np.empty((len(rows), self._arrays[0][0].shape[1]), np.float32)
        sparse = np.empty((len(rows), len(self.keys)), np.int64)
        labels = np.empty(len(rows), np.float32)
        which = np.searchsorted(self._offsets, rows, side="right") - 1
        for s, (d, sp, lab) in enumerate(self._arrays):
            sel = np.flatnonzero(which == s)
            if len(sel):
                local = rows[sel] - self._offsets[s]
                dense[sel], sparse[sel], labels[sel] = d[local], sp[local], lab[local]
        return dense, sparse, labels

    def make_batch(self, rows: np.ndarray) -> Batch:
        """The TorchRec Batch of the given global rows (one id per feature per row)."""
        dense, sparse, labels = self._gather(rows)
        b, k = len(rows), len(self.keys)
        values = torch.from_numpy(np.ascontiguousarray(sparse.T, dtype=np.int64).reshape(-1))
        # One id per feature per row: lengths and per-key sizes are known, no device sync needed.
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=values,
            lengths=torch.ones(b * k, dtype=torch.int32),
            stride=b,
            length_per_key=[b] * k,
            offset_per_key=list(range(0, b * k + 1, b)),
        )
        return Batch(
            dense_features=torch.from_numpy(np.asarray(dense, dtype=np.float32)),
            sparse_features=kjt,
            labels=torch.from_numpy(np.asarray(labels, dtype=np.float32)),
        )

    def __iter__(self) -> Iterator[Batch]:
        order = self.order()
        for b in range(self.start_batch, self.batches_per_epoch):
            yield self.make_batch(self.rows_of(b, order))


criteo_batches = CriteoBatches  # (the name its callers use: a function's, for the batches it yields)
