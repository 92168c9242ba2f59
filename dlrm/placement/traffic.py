"""Expected bytes on the wire per training iteration, per table and rank, from id frequencies.

A batch of ``B`` lookups of a table with id probabilities ``p`` touches E[distinct] =
sum_i 1 - (1 - p_i)^B rows (:meth:`data.frequency.FeatureFrequency.expected_distinct`). Our
all-to-all sends each distinct id of a (source rank, destination rank) chunk once when its codec
dedups by id (comm_ops: forward rows by id, backward gradients summed per id), so per iteration:

* table-wise / column-wise shard on rank o, each other rank r: input dist r -> o: ``B`` ids
  (values + lengths); forward o -> r and backward r -> o: ``rows x width x 4 / ratio`` with
  ``rows`` = E[distinct in B] (dedup) or ``B``;
* row-wise, rows split in ranges j: input dist r -> j: ``B`` lengths and the ``B * P_j`` ids in
  range j; forward j -> r: the partial sums of r's samples, deduplicated by value (E[distinct in
  range j] + 1 zero row); backward r -> j: the whole ``B x dim`` gradient (its rows differ);
* data-parallel: no all-to-all, a ring all-reduce of the whole table gradient;
* per collective: the size exchange (8 bytes per peer and direction) of framed payloads, and the
  input dist's splits exchange (one int64 per tensor and the stride, per peer);
* hot-row replication (``hot``: table -> H, the H hottest ids served by local replicas): the
  input dist carries only the cold lookups (``B * (1 - P_H)`` ids, still ``B`` lengths), a
  deduplicated chunk the cold ids' distinct rows (the top H skipped) plus one zero row shared by
  the bags replication emptied, and each rank sends every peer, every ``k`` iterations, the
  replica rows its ``k * B`` lookups touched (E = sum_{i<H} 1 - (1 - p_i)^{kB}) with their slots
  (:class:`ReplicaSync`).

With ``compression.input=ids`` (``input_coded``) an input chunk costs, per key, the sorted
distinct ids (gaps) and an index per lookup at ceil(log2 distinct) bits
(:func:`compression.ids_codec.expected_bytes`), and each payload a header and a size word.

``ratio`` is the codec's: fp32 bytes of the rows it is given / payload bytes (1 for
``compression=none`` less its framing), measured in the run (or calibrated before it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from data.frequency import FeatureFrequency, seen_probability
from dlrm.performance.network import ring_allreduce_bytes
from dlrm_compression.ids_codec import PAYLOAD_BYTES, expected_bytes

PATHS = ("input", "forward", "backward", "allreduce", "replica_sync")
FP32 = 4
ID_BYTES = 8  # an int64 on the wire: an id, a count, a size word


@dataclass(frozen=True)
class Shard:
    """One shard of a table: its rank, rows ``[row, row + rows)`` and ``width`` columns."""

    rank: int
    row: int
    rows: int
    width: int


@dataclass(frozen=True)
class TablePlacement:
    """A table's sharding type and shards (data-parallel: one full shard per rank)."""

    name: str
    kind: str
    num_embeddings: int
    dim: int
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Direction:
    """How one direction's chunks travel: deduplicated by id or not, the codec's ratio on the rows
    it is given (by id, and by row for chunks without single ids), and whether payloads are framed
    (a size exchange precedes them)."""

    dedup: bool
    ratio_ids: float = 1.0
    ratio_rows: float = 1.0
    framed: bool = True


@dataclass(frozen=True)
class ReplicaSync:
    """How the replicas of hot rows synchronise (dlrm/placement/hot_sync.py): every ``every`` iterations each
    rank sends every peer the rows its lookups touched since the last sync, each with its slot, and
    an int64 size. Exact (the defaults): fp32 rows and int64 slots, padded to the largest rank's
    count (``padded``). Coded: ``row_ratio`` = fp32 bytes / the codec payloads' bytes (their own
    headers included), ``slot_bytes`` per slot, and ``prefix_bytes`` of framing (dlrm/placement/hot_wire.py)."""

    every: int = 1
    row_ratio: float = 1.0
    slot_bytes: int = ID_BYTES
    prefix_bytes: int = 0
    padded: bool = True

    def row_bytes(self, dim: int) -> float:
        """Bytes of one touched row of width ``dim`` and its slot."""
        return dim * FP32 / self.row_ratio + self.slot_bytes

    def touched(self, p_hot: np.ndarray, lookups: float) -> np.ndarray:
        """Per replicated id (probabilities ``p_hot``): the chance that one rank's ``lookups`` per
        iteration touch it between two syncs."""
        return seen_probability(p_hot, self.every * lookups)


@dataclass
class TrafficModel:
    """Bytes each rank sends per iteration, by path, for ``world_size`` ranks of ``batch_size``."""

    world_size: int
    batch_size: float  # lookups per rank and table (the mean batch trained, for a finished run)
    index_bytes: tuple[int, int] = (8, 4)  # element sizes of a KJT's values and lengths
    forward: Direction = field(default_factory=lambda: Direction(dedup=True))
    backward: Direction = field(default_factory=lambda: Direction(dedup=True))
    hot: Mapping[str, int] = field(default_factory=dict)  # table -> replicated hot rows (placement.hot_rows)
    sync: ReplicaSync = field(default_factory=ReplicaSync)
    input_coded: bool = False  # compression.input=ids: the input dist's ids coded (compression/ids_codec.py)
    _distinct: dict[tuple[int, int], float] = field(default_factory=dict)

    def distinct(self, freq: FeatureFrequency, skip_top: int = 0) -> float:
        """E[distinct ids] among one rank's ``batch_size`` lookups (cached per feature)."""
        key = (id(freq), skip_top)
        if key not in self._distinct:
            self._distinct[key] = freq.expected_distinct(self.batch_size, skip_top)
        return self._distinct[key]

    def hot_mass(self, table: str, freq: FeatureFrequency) -> float:
        """The share of ``table``'s lookups that its replicas serve (0 without replication)."""
        return float(freq.top_probabilities()[: self.hot.get(table, 0)].sum())

    def chunk_rows(self, table: str, freq: FeatureFrequency) -> float:
        """E[rows] of a deduplicated chunk of a table- or column-wise ``table``: its distinct ids,
        less the replicated ones, and the one zero row of emptied bags (when any lookup is hot)."""
        h = self.hot.get(table, 0)
        if not h:
            return self.distinct(freq)
        any_hot = seen_probability(np.array([self.hot_mass(table, freq)]), self.batch_size)
        return self.distinct(freq, skip_top=h) + float(any_hot[0])

    def table(self, t: TablePlacement, freq: FeatureFrequency) -> np.ndarray:
        """float64 ``[world_size, len(PATHS)]``: what each rank sends for table ``t``."""
        ws, b = self.world_size, self.batch_size
        out = np.zeros((ws, len(PATHS)))
        cold = 1 - self.hot_mass(t.name, freq)  # the share of lookups still sent
        if t.kind == "data_parallel":
            out[:, 3] = ring_allreduce_bytes(t.num_embeddings * t.dim, ws, FP32)
            return out
        if t.kind in ("row_wise", "table_row_wise"):  # one host: table-row-wise is row-wise
            mass, distinct = self._row_ranges(t, freq)
            for j, s in enumerate(t.shards):
                for r in range(ws):
                    if r == s.rank:
                        continue
                    out[r, 0] += self._input(b, b * mass[j], distinct[j], s.rows, mass[j] < 1)
                    fwd_rows = distinct[j] + 1 if self.forward.dedup else b
                    out[s.rank, 1] += fwd_rows * s.width * FP32 / self.forward.ratio_rows
                    out[r, 2] += b * s.width * FP32 / self.backward.ratio_rows
            return out
        rows_f = self.chunk_rows(t.name, freq) if self.forward.dedup else b
        rows_b = self.chunk_rows(t.name, freq) if self.backward.dedup else b
        for s in t.shards:
            for r in range(ws):
                if r == s.rank:
                    continue
                cold_distinct = self.distinct(freq, skip_top=self.hot.get(t.name, 0))
                out[r, 0] += self._input(b, b * cold, cold_distinct, t.num_embeddings, cold < 1)
                out[s.rank, 1] += rows_f * s.width * FP32 / self.forward.ratio_ids
                out[r, 2] += rows_b * s.width * FP32 / self.backward.ratio_ids
        return out

    def _input(self, bags: float, ids: float, distinct: float, id_range: float, lengths_vary: bool) -> float:
        """Input-dist bytes of one key's chunk: TorchRec's values and lengths, or coded (sorted
        distinct ids + an index per lookup, :func:`compression.ids_codec.expected_bytes`)."""
        if self.input_coded:
            return expected_bytes(bags, ids, distinct, id_range, lengths_vary)
        val_b, len_b = self.index_bytes
        return bags * len_b + ids * val_b

    def _row_ranges(self, t: TablePlacement, freq: FeatureFrequency) -> tuple[list[float], list[float]]:
        """Per row range: the probability mass of its ids and E[distinct ids] of it in a batch. Top
        ids fall where they are (replicated ones nowhere); the tail spreads over the rows that are
        not top ids."""
        p = freq.top_probabilities()
        tail_mass = max(1.0 - float(p.sum()), 0.0)
        tail_rows = max(t.num_embeddings - len(p), 1)
        tail_distinct = self.distinct(freq, skip_top=len(p))
        top_distinct = seen_probability(p, self.batch_size)
        h = self.hot.get(t.name, 0)
        p, top_distinct = p.copy(), top_distinct.copy()
        p[:h] = top_distinct[:h] = 0.0
        mass, distinct = [], []
        for s in t.shards:
            inside = (freq.top_ids >= s.row) & (freq.top_ids < s.row + s.rows)
            share = max(s.rows - int(inside.sum()), 0) / tail_rows
            mass.append(float(p[inside].sum()) + tail_mass * share)
            distinct.append(float(top_distinct[inside].sum()) + tail_distinct * share)
        return mass, distinct

    def overhead(self, kinds: Iterable[str]) -> np.ndarray:
        """Per-collective bytes each rank sends: one input dist and one output collective per
        sharding type present (data-parallel has none)."""
        ws = self.world_size
        out = np.zeros((ws, len(PATHS)))
        for _ in set(kinds) - {"data_parallel"}:
            out[:, 0] += ID_BYTES * 3 * (ws - 1)  # lengths, values, stride
            if self.input_coded:  # and each payload's size, and its header
                out[:, 0] += (ID_BYTES + PAYLOAD_BYTES) * (ws - 1)
            out[:, 1] += ID_BYTES * (ws - 1) if self.forward.framed else 0
            out[:, 2] += ID_BYTES * (ws - 1) if self.backward.framed else 0
        return out

    def plan(self, tables: Iterable[TablePlacement], freqs: Mapping[str, FeatureFrequency]) -> np.ndarray:
        """``[world_size, len(PATHS)]`` bytes each rank sends per iteration under a whole plan
        (``freqs``: table name -> its feature's frequencies)."""
        tables = list(tables)
        out = self.overhead(t.kind for t in tables)
        for t in tables:
            out += self.table(t, freqs[t.name])
        out[:, PATHS.index("replica_sync")] += self.replica_sync(tables, freqs)
        return out

    def replica_sync(self, tables: Iterable[TablePlacement], freqs: Mapping[str, FeatureFrequency]) -> float:
        """Bytes each rank sends per iteration to synchronise the replicas of ``hot`` rows."""
        s, ws = self.sync, self.world_size
        hot = [(t, self.hot[t.name]) for t in tables if self.hot.get(t.name)]
        if not hot:
            return 0.0
        rows = variance = row_bytes = 0.0
        for t, h in hot:
            q = s.touched(freqs[t.name].top_probabilities()[:h], self.batch_size)
            rows += float(q.sum())
            variance += float((q * (1 - q)).sum())
            row_bytes += float(q.sum()) * s.row_bytes(t.dim)
        if s.padded:  # every rank sends the largest count: E[max of ws ~normal counts] (Blom's approximation)
            extra = math.sqrt(variance) * NormalDist().inv_cdf((ws - 0.375) / (ws + 0.25))
            row_bytes *= (rows + max(extra, 0.0)) / rows
        return (ws - 1) * (row_bytes + s.prefix_bytes + ID_BYTES) / s.every


def by_path(per_rank: np.ndarray) -> dict[str, float]:
    """Total bytes of all ranks per path."""
    return {p: float(v) for p, v in zip(PATHS, per_rank.sum(axis=0), strict=True)}
