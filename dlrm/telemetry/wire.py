"""Bytes the embedding path puts on the wire per training iteration: measured, and predicted.

Measured (:class:`WireMeter`, a :class:`dlrm.trainer.loop.StepObserver`): over training segments only
(evaluation excluded), what each rank sends in the input (KJT) all-to-alls and their splits
exchange (``input``), the compressed pooled-embedding all-to-alls with their size exchanges
(``forward``, ``backward``), and the ring all-reduce DDP runs on the whole gradient of every
data-parallel table (``allreduce``; counted from the gradient's size, as the dense channel counts
its buckets), and the gradient exchange of replicated hot rows (``replica_sync``). Predicted:
:mod:`dlrm.placement.traffic` on the run's plan, id frequencies, replicated rows and the codec ratios this
run measured (the all-to-alls' and the replica sync's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel

from data.frequency import FeatureFrequency
from dlrm.embedding_comm.config import CompressionSpec
from dlrm.performance.network import ring_allreduce_bytes
from dlrm.placement.traffic import PATHS, Direction, ReplicaSync, Shard, TablePlacement, TrafficModel, by_path
from dlrm.telemetry.comm_stats import run_sums_all_ranks, run_totals
from dlrm.trainer.model import table_names

_A2A_KEYS = {"input": "input/wire_bytes", "forward": "forward/wire_bytes", "backward": "backward/wire_bytes"}
_SYNC_KEY = "replica_sync/wire_bytes"


def placements(model: DistributedModelParallel, num_embeddings: Mapping[str, int], dim: int) -> list[TablePlacement]:
    """Every table's sharding type and shards under the model's plan."""
    out = []
    for module_plan in model.plan.plan.values():
        for table, ps in module_plan.items():
            n = int(num_embeddings[table])
            spec = ps.sharding_spec
            if spec is None:  # data-parallel: the whole table on every rank
                shards = tuple(Shard(r, 0, n, dim) for r in ps.ranks)
            else:
                shards = tuple(
                    Shard(_rank_of(s.placement), int(s.shard_offsets[0]), int(s.shard_sizes[0]), int(s.shard_sizes[1]))
                    for s in spec.shards
                )
            out.append(TablePlacement(table, ps.sharding_type, n, dim, shards))
    return out


def _rank_of(placement: Any) -> int:
    """The rank of a shard placement (TorchRec's ``rank:R/device``)."""
    return int(placement.rank())


class WireMeter:
    """Counts this rank's embedding-path bytes inside training segments (see the module doc)."""

    def __init__(self, dp_numel: int, world_size: int, sync_bytes: Callable[[], float] | None = None) -> None:
        self.allreduce_per_step = ring_allreduce_bytes(dp_numel, world_size) if world_size > 1 else 0.0
        self.sync_bytes = sync_bytes  # this rank's replica-sync bytes so far (hot-row replication)
        self.train: dict[str, float] = {}  # run-total keys (forward/raw_bytes, ...) over training only
        self.iterations = 0
        self._start: dict[str, float] = {}

    def _totals(self, model: torch.nn.Module) -> dict[str, float]:
        totals = run_totals(model)
        if self.sync_bytes is not None:
            totals[_SYNC_KEY] = float(self.sync_bytes())
        return totals

    def segment_start(self, model: torch.nn.Module) -> None:
        self._start = self._totals(model)

    def step_end(self, model: torch.nn.Module) -> None:
        self.iterations += 1

    def segment_end(self, model: torch.nn.Module) -> None:
        for k, v in self._totals(model).items():
            self.train[k] = self.train.get(k, 0.0) + v - self._start.get(k, 0.0)

    def gather(self) -> tuple[np.ndarray, dict[str, float]]:
        """``[world_size, len(PATHS)]`` bytes per iteration each rank sent, and the training
        totals summed over ranks (a collective)."""
        sent = {p: self.train.get(key, 0.0) for p, key in _A2A_KEYS.items()}
        sent["allreduce"] = self.allreduce_per_step * self.iterations
        sent["replica_sync"] = self.train.get(_SYNC_KEY, 0.0)
        mine = ([sent[p] / max(self.iterations, 1) for p in PATHS], self.train)
        gathered: list[Any] = [mine]
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        totals: dict[str, float] = {}
        for _, train in gathered:
            for k, v in train.items():
                totals[k] = totals.get(k, 0.0) + v
        return np.array([g[0] for g in gathered]), totals


def measured_directions(
    sampled: Mapping[str, float], train: Mapping[str, float], world_size: int, dedup: Mapping[str, bool]
) -> dict[str, Direction]:
    """Each direction's codec ratio on the rows it is given, as this run measured it (all ranks):
    raw / payload bytes over every training call, times the share of the raw rows the codec was
    given in the sampled chunks of each mode (1 without samples, e.g. compression=none)."""
    out = {}
    for d in ("forward", "backward"):
        payload = train.get(f"{d}/wire_bytes", 0.0) - 8 * (world_size - 1) * train.get(f"{d}/calls", 0.0)
        overall = train.get(f"{d}/raw_bytes", 0.0) / payload if payload > 0 else 1.0
        ratios = {}
        for mode in ("ids", "rows"):
            chunk = sampled.get(f"{d}/sampled_chunk_bytes/{mode}", 0.0)
            ratios[mode] = overall * sampled.get(f"{d}/sampled_given_bytes/{mode}", 0.0) / chunk if chunk else overall
        out[d] = Direction(dedup=dedup[d], ratio_ids=ratios["ids"], ratio_rows=ratios["rows"])
    return out


def measured_distinct(sums: Mapping[str, float], direction: str = "forward") -> dict[str, float]:
    """feature -> mean rows per sampled (source, destination) chunk that the codec was given."""
    prefix = f"{direction}/sampled_chunks/"
    return {
        k[len(prefix) :]: sums[f"{direction}/sampled_rows/{k[len(prefix) :]}"] / n
        for k, n in sums.items()
        if k.startswith(prefix) and n > 0
    }


def wire_report(
    measured: np.ndarray,
    tables: Sequence[TablePlacement],
    freqs: Mapping[str, FeatureFrequency],
    model: TrafficModel,
    distinct_measured: Mapping[str, float],
    features_of: Mapping[str, str],
) -> dict[str, Any]:
    """metrics.json's wire keys: measured and predicted bytes per iteration (all ranks), per rank
    and per path, and predicted against measured distinct ids per chunk of each table."""
    predicted = model.plan(tables, freqs)
    distinct = {}
    for t in tables:
        f = features_of[t.name]
        if f in distinct_measured and t.kind in ("table_wise", "column_wise", "table_column_wise"):
            distinct[t.name] = {
                "predicted": round(model.chunk_rows(t.name, freqs[t.name]), 2),
                "measured": round(distinct_measured[f], 2),
            }
    return {
        "wire_bytes_per_iteration": float(measured.sum()),
        "predicted_wire_bytes_per_iteration": float(predicted.sum()),
        "wire_bytes_per_rank": [float(v) for v in measured.sum(axis=1)],
        "predicted_wire_bytes_per_rank": [float(v) for v in predicted.sum(axis=1)],
        "wire_bytes_by_path": by_path(measured),
        "predicted_wire_bytes_by_path": by_path(predicted),
        "distinct_ids_per_chunk": distinct,
    }


def wire_metrics(
    model: torch.nn.Module,
    meter: WireMeter,
    spec: CompressionSpec,
    tables: Sequence[TablePlacement],
    freqs: Mapping[str, FeatureFrequency],
    world_size: int,
    batch_size: float,
    features: Sequence[str],
    hot: Mapping[str, int] | None = None,
    sync: ReplicaSync | None = None,
) -> dict[str, Any]:
    """:func:`wire_report` of this run (a collective); None values for TorchRec's QComms path,
    whose collectives count no bytes. ``hot``: table -> replicated rows, synchronised as ``sync``."""
    measured, train = meter.gather()
    sums = run_sums_all_ranks(model)
    if spec.kind != "compressed" or spec.forward is None or spec.backward is None:
        return {"wire_bytes_per_iteration": None, "predicted_wire_bytes_per_iteration": None}
    dedup = {"forward": spec.forward.dedup, "backward": spec.backward.dedup}
    dirs = measured_directions(sums, train, world_size, dedup)
    traffic = TrafficModel(
        world_size,
        batch_size,
        forward=dirs["forward"],
        backward=dirs["backward"],
        hot=hot or {},
        sync=sync or ReplicaSync(),
        input_coded=spec.input == "ids",
    )
    features_of = dict(zip(table_names(features), features, strict=True))
    distinct = measured_distinct(sums) if dedup["forward"] else {}
    return wire_report(measured, tables, freqs, traffic, distinct, features_of)
