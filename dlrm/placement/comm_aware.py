"""``sharding=comm_aware``: TorchRec's planner pricing communication by expected distinct ids.

TorchRec's planner already searches what we need: its enumerator lists each table's options
(sharding type x compute kernel x shards), estimators give each shard a perf and a storage, its
proposers and partitioner place shards on ranks within each rank's memory, and it keeps the plan
whose slowest rank has the least total perf (``NoopPerfModel``). What it lacks is our traffic:
its comm estimate knows neither our deduplication nor our codec. So the planner is TorchRec's,
with :class:`CommAwarePerfEstimator` in place of its perf estimator (:mod:`dlrm.placement.traffic`'s bytes
over the link measured at start-up, plus the memory traffic of the lookups) and ``ddr_cap``/``hbm_cap``
set to ``placement.memory_budget``. :class:`KernelFilter` keeps each sharding type on the kernel
our trainer runs it with (data-parallel: dense; the rest: fused).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import Perf, ShardEstimator, ShardingOption
from torchrec.distributed.types import ModuleSharder

from data.frequency import FeatureFrequency
from dlrm.embedding_comm.config import CompressionSpec
from dlrm.performance.link_timing import calibrate_link
from dlrm.performance.network import Link
from dlrm.placement.config import PlacementSpec
from dlrm.placement.traffic import FP32, PATHS, Direction, Shard, TablePlacement, TrafficModel
from dlrm.process.env import DistEnv
from dlrm.trainer.model import table_names
from dlrm.trainer.sharding import kernel_for, topology_args

log = logging.getLogger("dlrm.placement.comm_aware")
CHOICES = ("data_parallel", "table_wise", "row_wise", "column_wise")


class CommAwarePerfEstimator(ShardEstimator):
    """Each shard's perf: the seconds its expected bytes take on ``link`` (input dist + forward;
    backward + data-parallel all-reduce) and the memory traffic of its lookups and updates at the
    topology's memory bandwidth. TorchRec's own compute estimate is not used: it is tuned for
    GPU kernels and puts ~3 ms per table and batch of 256 on this CPU (measured iterations take
    ~15 ms for all 26 tables), which would drown the link in the comparison."""

    def __init__(
        self, topology: Topology, traffic: TrafficModel, freqs: Mapping[str, FeatureFrequency], link: Link
    ) -> None:
        per_ms = topology.hbm_mem_bw if topology.compute_device == "cuda" else topology.ddr_mem_bw
        self.mem_bw = 1e3 * per_ms  # TorchRec's bandwidths are bytes/ms; our perfs are seconds
        self.traffic, self.freqs, self.link = traffic, freqs, link

    def shard_bytes(self, kind: str, table: str, num_embeddings: int, row: int, rows: int, width: int) -> np.ndarray:
        """Bytes per path that one shard puts on the wire per iteration (all ranks together; a
        data-parallel shard: its own rank's share of the all-reduce)."""
        one = TablePlacement(table, kind, num_embeddings, width, (Shard(0, row, rows, width),))
        per_rank = self.traffic.table(one, self.freqs[table])
        return per_rank[0] if kind == "data_parallel" else per_rank.sum(axis=0)

    def compute_bytes(self, kind: str, num_embeddings: int, rows: int, width: int) -> tuple[float, float]:
        """Memory bytes a shard touches per iteration, forward and backward: the rows it looks up
        and the pooled rows it writes (all ranks' samples; a data-parallel copy only its own rank's),
        twice that in backward, plus a data-parallel table's dense gradient and update."""
        b, ws = self.traffic.batch_size, self.traffic.world_size
        if kind == "data_parallel":
            fwd = 2.0 * b * width * FP32
            return fwd, 2 * fwd + 3.0 * num_embeddings * width * FP32
        share = rows / max(num_embeddings, 1) if kind in ("row_wise", "table_row_wise") else 1.0
        fwd = b * ws * width * FP32 * (1.0 + share)
        return fwd, 2 * fwd

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: Any = None) -> None:
        bw = self.link.bytes_per_s
        for so in sharding_options:
            n = so.tensor.shape[0]
            for shard in so.shards:
                b = self.shard_bytes(so.sharding_type, so.name, n, shard.offset[0], shard.size[0], shard.size[1])
                c_fwd, c_bwd = self.compute_bytes(so.sharding_type, n, shard.size[0], shard.size[1])
                shard.perf = Perf(
                    fwd_compute=c_fwd / self.mem_bw,
                    fwd_comms=(b[PATHS.index("input")] + b[PATHS.index("forward")]) / bw,
                    bwd_compute=c_bwd / self.mem_bw,
                    bwd_comms=(b[PATHS.index("backward")] + b[PATHS.index("allreduce")]) / bw,
                )


class KernelFilter(EmbeddingEnumerator):
    """TorchRec's enumerator, keeping only (sharding type, kernel) pairs the trainer runs."""

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        options = super().enumerate(module, sharders)
        return [o for o in options if o.compute_kernel == kernel_for(o.sharding_type)]


def allowed_types(compressed_types: Sequence[str], dense_hooked: bool, fused_only: bool = False) -> list[str]:
    """The choices comm_aware may use: those our sharder supports for this compression, less
    data-parallel when a dense_comm hook is installed (TorchRec runs a data-parallel table's fused
    optimizer through DDP's own comm hook, and DDP takes one hook) or when the tables are fp16
    (``fused_only``: see dlrm/precision/config.py)."""
    out = [t for t in CHOICES if t in compressed_types]
    if "data_parallel" in out and (dense_hooked or fused_only):
        out.remove("data_parallel")
        why = "dense_comm installs a DDP hook" if dense_hooked else "precision.embeddings=fp16 needs the fused kernel"
        log.info("comm_aware: no data_parallel tables: %s", why)
    return out


def comm_aware_planner(
    topology_args: dict[str, Any],
    batch_size: int,
    table_names: Sequence[str],
    dim: int,
    types: Sequence[str],
    traffic: TrafficModel,
    freqs: Mapping[str, FeatureFrequency],
    link: Link,
    memory_budget: int | None,
    min_partition: int,
) -> EmbeddingShardingPlanner:
    """TorchRec's planner with our estimator, the kernel filter and the per-rank memory cap."""
    cap = (
        {"hbm_cap" if topology_args["compute_device"] == "cuda" else "ddr_cap": memory_budget} if memory_budget else {}
    )
    topology = Topology(**topology_args, **cap)
    constraints = {
        t: ParameterConstraints(
            sharding_types=list(types),
            compute_kernels=sorted({kernel_for(k) for k in types}),
            min_partition=min_partition,
        )
        for t in table_names
    }
    estimators: list[ShardEstimator] = [
        CommAwarePerfEstimator(topology, traffic, freqs, link),
        EmbeddingStorageEstimator(topology, constraints),
    ]
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        enumerator=KernelFilter(topology, batch_size, constraints, estimators),
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(percentage=0.05),
    )


def build_planner(
    env: DistEnv,
    sharding_cfg: Mapping[str, Any],
    placement: PlacementSpec,
    spec: CompressionSpec,
    directions: tuple[Direction, Direction],
    dense_hooked: bool,
    features: Sequence[str],
    freqs: Sequence[FeatureFrequency],
    batch_size: int,
    dim: int,
    fused_only: bool = False,
) -> tuple[EmbeddingShardingPlanner, TrafficModel]:
    """The comm_aware planner of a run, and the traffic model it plans with: the link given
    (``placement.link_mbit``) or timed now (a collective), and the all-to-alls as
    :func:`dlrm.placement.codec_ratio.priced_directions` prices them."""
    names = table_names(features)
    link = calibrate_link(env) if placement.link_mbit is None else Link(placement.link_mbit * 1e6 / 8)
    memory_budget = placement.memory_budget
    fwd, bwd = directions
    traffic = TrafficModel(env.world_size, batch_size, forward=fwd, backward=bwd)
    types = allowed_types(spec.sharding_types, dense_hooked, fused_only)
    log.info(
        "comm_aware: link %.3g MB/s (+%.2g ms), codec ratio %.3g (forward, calibrated), choices %s, memory budget %s",
        link.bytes_per_s / 1e6,
        1e3 * link.latency_s,
        fwd.ratio_ids,
        types,
        "device" if memory_budget is None else f"{memory_budget} bytes per rank",
    )
    min_partition = sharding_cfg.get("min_partition") or max(4, dim // 2)
    planner = comm_aware_planner(
        topology_args(env),
        batch_size,
        names,
        dim,
        types,
        traffic,
        dict(zip(names, freqs, strict=True)),
        link,
        memory_budget,
        min_partition,
    )
    return planner, traffic


def log_plan(tables: Sequence[TablePlacement], traffic: TrafficModel, freqs: Mapping[str, FeatureFrequency]) -> None:
    """The plan, table by table, and each rank's predicted bytes per iteration by path."""
    for t in tables:
        log.info(
            "comm_aware: %s %s ranks %s (E[distinct] %.1f of %d lookups)",
            t.name,
            t.kind,
            sorted({s.rank for s in t.shards}),
            traffic.distinct(freqs[t.name]),
            traffic.batch_size,
        )
    per_rank = traffic.plan(tables, freqs)
    for r, row in enumerate(per_rank):
        parts = ", ".join(f"{p} {v / 1e3:.1f}" for p, v in zip(PATHS, row, strict=True))
        log.info("comm_aware: rank %d predicted %.1f KB sent per iteration (%s)", r, row.sum() / 1e3, parts)
