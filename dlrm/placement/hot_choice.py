"""Which ids to replicate on every rank (``placement.hot_rows``), priced by expected distinct ids.

For a table with per-lookup id probabilities p (hottest first) and ``B`` lookups per rank and
iteration, replicating the ``H`` hottest ids changes the bytes all ranks send per iteration by::

    saved = (W-1) * [R_H * 4D / r * (each direction) + B * P_H * 8]    (both all-to-alls, the ids)
    sync  = W * (W-1) * U_H(kB) * (4D / s + b) / k                      (touched rows, all-gathered)

where U_H(n) = sum_{i<H} 1 - (1 - p_i)^n is the expected number of distinct hot ids among n
lookups, P_H = sum_{i<H} p_i, R_H the hot rows a direction no longer sends: U_H(B) where the
codec sends one row per distinct id (``dedup``), none where it sends one row per bag, empty or
not (stock TorchRec, ``compression=none``: there only the ids of the input all-to-all shrink),
r the codec's ratio, W the ranks and k ``placement.sync_every``; s and b are the sync's ratio on
the rows and bytes per slot: 1 and 8 for the exact sync (fp32 rows, int64 slots), and with
``placement.sync_codec=backward`` a nominal 4 (SYNC_CODEC_RATIO: conservative, under the ratio
runs measure, metrics.json ``hot_rows.sync_row_ratio``: 23-25x in the README's 200 Mbit runs) and 4 (an int32 slot, the
wider of the two widths the wire uses; payload headers are not priced). A rank finds a table's rows on
another rank with probability (W-1)/W. With the exact sync replication pays only
where hot ids repeat within a batch enough for their ids to outweigh the sync of their rows, or
where the sync is amortised over k iterations. ``auto`` picks per table the H with the largest
positive saving within ``placement.memory_budget`` bytes per rank, and logs why a table gets none.
The model prices bytes, not time: on a link fast enough that bytes do not matter it still
replicates where bytes are saved.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from data.frequency import FeatureFrequency, seen_probability
from dlrm.placement.traffic import ID_BYTES, ReplicaSync

log = logging.getLogger(__name__)
# Nominal compression ratios of each codec for the model (the lossy codec's depends on the data
# and the bound; 4x is typical of the dual policy on Criteo-like tables, see README).
NOMINAL_RATIO = {"none": 1.0, "fp16": 2.0, "bf16": 2.0, "qcomm_fp16": 2.0, "qcomm_int8": 4.0, "lossy": 4.0}
# The coded sync's nominal ratio on the rows it sends (placement.sync_codec=backward): a
# conservative figure, under the measured one (metrics.json hot_rows.sync_row_ratio)
SYNC_CODEC_RATIO = 4.0
SYNC_CODEC_SLOT_BYTES = 4
STATE_BYTES_PER_ROW = {
    "sgd": lambda d: 0,
    "adagrad": lambda d: 4 * d,
    "rowwise_adagrad": lambda d: 4,
}  # per row of width d


@dataclass(frozen=True)
class Wire:
    """What the embedding all-to-alls of a run send: per-rank lookups of a table per iteration,
    ranks, row width, the codec's ratio and whether each direction sends one row per distinct id
    (``dedup``) or one per bag (stock TorchRec, ``compression=none``)."""

    lookups: int
    world: int
    dim: int
    ratio: float = 1.0
    dedup_forward: bool = False
    dedup_backward: bool = False
    row_bytes: int = 0  # memory per replicated row and rank: weight and optimizer state
    sync: ReplicaSync = field(default_factory=ReplicaSync)  # the replica sync (default: exact, every iteration)


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


def price(freq: FeatureFrequency, hot: int, w: Wire) -> Pricing:
    """The model of the module docstring for the ``hot`` hottest ids of one table."""
    p = np.minimum(freq.probabilities()[:hot], 1 - 1e-12)
    distinct = float(seen_probability(p, w.lookups).sum())
    distinct_k = float(w.sync.touched(p, w.lookups).sum())
    hot_lookups = w.lookups * float(p.sum())
    rows = distinct * (w.dedup_forward + w.dedup_backward)  # a bag emptied by replication still travels
    saved = (w.world - 1) * (rows * 4 * w.dim / w.ratio + hot_lookups * ID_BYTES)
    sync = w.world * (w.world - 1) * distinct_k * w.sync.row_bytes(w.dim) / w.sync.every
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
    priced = {t: [price(f, h, wire) for h in candidates(f) if h] for t, f in zip(tables, freqs, strict=True)}
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
