"""Which ids to replicate on every rank (``placement.hot_rows``), priced by the traffic model.

Replicating a table's ``H`` hottest ids saves, per iteration, the bytes
:class:`dlrm.placement.traffic.TrafficModel` predicts for the table without replicas less those
with them (the cold ids alone in the input dist; a deduplicated chunk without the hot rows but
with the emptied bags' zero row; nothing saved on a direction that sends one row per bag, as
stock TorchRec does), and costs the replica sync it predicts (the touched rows every
``placement.sync_every`` iterations, all ranks). The all-to-alls are priced at the codec ratio
measured before training (:mod:`dlrm.placement.codec_ratio`), the sync at the backward codec's
with ``placement.sync_codec=backward`` (int32 slots) and exact otherwise (fp32 rows, int64
slots). The table is priced as one table-wise shard. ``auto`` picks per table the H with the
largest positive saving within ``placement.memory_budget`` bytes per rank, and logs why a table
gets none. The model prices bytes, not time: on a link fast enough that bytes do not matter it
still replicates where bytes are saved.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from data.frequency import FeatureFrequency
from dlrm.placement.traffic import Direction, ReplicaSync, Shard, TablePlacement, TrafficModel

log = logging.getLogger(__name__)
# The coded sync (placement.sync_codec=backward) codes gradient sums, which do not exist before
# training: priced at a nominal ratio (runs measure metrics.json hot_rows.sync_row_ratio: 4.0x in
# 12-iteration tests, 6x in 24-iteration ones, 23-25x in the README's 200 Mbit runs), with its
# int32 slot, the wider of the two widths the wire uses.
SYNC_CODEC_RATIO = 4.0
SYNC_CODEC_SLOT_BYTES = 4
STATE_BYTES_PER_ROW = {
    "sgd": lambda d: 0,
    "adagrad": lambda d: 4 * d,
    "rowwise_adagrad": lambda d: 4,
}  # per row of width d


@dataclass(frozen=True)
class Wire:
    """What the embedding all-to-alls of a run send, as the traffic model takes it: per-rank lookups
    of a table per iteration, ranks, row width, each direction (dedup, measured ratio), a replicated
    row's memory per rank (weight and optimizer state) and the replica sync."""

    lookups: int
    world: int
    dim: int
    forward: Direction = field(default_factory=lambda: Direction(dedup=False))
    backward: Direction = field(default_factory=lambda: Direction(dedup=False))
    row_bytes: int = 0
    sync: ReplicaSync = field(default_factory=ReplicaSync)  # the replica sync (default: exact, every iteration)

    def traffic(self) -> TrafficModel:
        return TrafficModel(self.world, self.lookups, forward=self.forward, backward=self.backward, sync=self.sync)


@dataclass(frozen=True)
class Pricing:
    """What one table's replication of ``hot`` rows saves and costs (bytes per iteration, all ranks)."""

    hot: int
    saved: float
    sync: float
    memory: int  # bytes per rank

    @property
    def net(self) -> float:
        return self.saved - self.sync


def price(freq: FeatureFrequency, hot: int, w: Wire, traffic: TrafficModel | None = None) -> Pricing:
    """The ``hot`` hottest ids of one table, priced by the traffic model (``traffic``: ``w``'s,
    shared between calls to reuse its expected distinct ids)."""
    model = traffic or w.traffic()
    n = max(freq.distinct, hot)
    table = TablePlacement("t", "table_wise", n, w.dim, (Shard(0, 0, n, w.dim),))
    replicated = replace(model, hot={"t": hot})
    saved = float(model.table(table, freq).sum() - replicated.table(table, freq).sum())
    sync = w.world * replicated.replica_sync([table], {"t": freq})
    return Pricing(hot, saved, sync, hot * w.row_bytes)


def candidates(freq: FeatureFrequency) -> list[int]:
    """Sizes worth pricing: powers of two up to the ids the statistics name, and all of them."""
    n = len(freq.top_ids)
    return sorted({0, n} | {1 << i for i in range(n.bit_length()) if 1 << i <= n})


def choose_auto(
    tables: Sequence[str], freqs: Sequence[FeatureFrequency], wire: Wire, free_bytes: float, verbose: bool = True
) -> dict[str, Pricing]:
    """Per table the priced size with the largest positive net saving; tables are served in order
    of their best saving per byte while ``free_bytes`` (of the memory budget) lasts."""
    model = wire.traffic()
    priced = {t: [price(f, h, wire, model) for h in candidates(f) if h] for t, f in zip(tables, freqs, strict=True)}
    chosen: dict[str, Pricing] = {}
    order = sorted(tables, key=lambda t: -max((q.net / max(q.memory, 1) for q in priced[t]), default=0.0))
    for t in order:
        fits = [q for q in priced[t] if q.memory <= free_bytes and q.net > 0]
        if not fits:
            top = max(priced[t], key=lambda q: q.net, default=None)
            if top is None:
                why = "no frequency statistics name a hot id"
            elif top.net <= 0:
                why = f"no size pays (best H={top.hot}: saves {top.saved:.0f} B/iteration, sync costs {top.sync:.0f})"
            else:
                why = f"the memory budget is spent ({free_bytes:.0f} B left, H={top.hot} needs {top.memory})"
            if verbose:
                log.info("placement.hot_rows=auto: %s not replicated: %s", t, why)
            continue
        pick = max(fits, key=lambda q: q.net)
        chosen[t] = pick
        free_bytes -= pick.memory
        if verbose:
            log.info(
                "placement.hot_rows=auto: %s replicates %d rows: saves %.0f B/iteration, sync %.0f, %d B per rank",
                t,
                pick.hot,
                pick.saved,
                pick.sync,
                pick.memory,
            )
    return chosen
