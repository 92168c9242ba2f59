"""Set up hot-row replication for a run (``placement.hot_rows``): from each feature's hottest ids
(the run's frequency statistics: meta.json's, else the first training batches), choose how many to replicate
per table within the memory budget, install the replicas and their optimizer in the sharded model.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.distributed.types import ShardingType

from data.frequency import FeatureFrequency
from dlrm.embedding_comm.config import CompressionSpec
from dlrm.embedding_comm.dist import CompressionRuntime
from dlrm.placement.config import PlacementSpec
from dlrm.placement.hot_choice import STATE_BYTES_PER_ROW, SYNC_CODEC_RATIO, SYNC_CODEC_SLOT_BYTES, Wire, choose_auto
from dlrm.placement.hot_rows import HotSplit, install
from dlrm.placement.hot_sync import HotRowOptimizer
from dlrm.placement.hot_wire import HEADER_BYTES, SyncWire
from dlrm.placement.traffic import Direction, ReplicaSync
from dlrm.process.timeout import named_collective
from dlrm.trainer.model import table_names
from dlrm.trainer.state import CheckpointError, PerRank

log = logging.getLogger(__name__)


def table_memory_per_rank(model: torch.nn.Module, rule: str) -> list[int]:
    """Bytes of each rank's table shards and their optimizer state (a collective); a data_parallel
    table (a plain tensor) is whole on every rank."""
    ebc = get_unwrapped_module(model).model.sparse_arch.embedding_bag_collection
    mine = 0
    for w in ebc.state_dict().values():
        pieces = [s.tensor for s in w.local_shards()] if hasattr(w, "local_shards") else [w]
        for piece in pieces:
            rows, cols = piece.shape
            mine += rows * cols * piece.element_size() + rows * STATE_BYTES_PER_ROW[rule](cols)
    if not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    with named_collective("the all-gather of every rank's table memory (placement.hot_rows)"):
        dist.all_gather_object(out, mine)
    return [int(b) for b in out]


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def wire_of(
    directions: tuple[Direction, Direction],
    batch_size: int,
    world: int,
    dim: int,
    sync_every: int,
    row_bytes: int,
    sync_codec: str = "exact",
) -> Wire:
    """The all-to-alls' (``directions``: :func:`dlrm.placement.codec_ratio.priced_directions`) and
    the replica sync's traffic shape for the cost model, with ``placement.sync_codec``."""
    return Wire(
        lookups=batch_size,
        world=world,
        dim=dim,
        forward=directions[0],
        backward=directions[1],
        row_bytes=row_bytes,
        sync=(
            ReplicaSync(sync_every, SYNC_CODEC_RATIO, SYNC_CODEC_SLOT_BYTES, padded=False)
            if sync_codec == "backward"
            else ReplicaSync(sync_every)
        ),
    )


def data_parallel_tables(model: torch.nn.Module) -> set[str]:
    """Tables the plan already keeps whole on every rank (no all-to-all to save)."""
    plan = getattr(model, "plan", None)
    modules = plan.plan.values() if plan is not None else []
    return {t for m in modules for t, ps in m.items() if ps.sharding_type == ShardingType.DATA_PARALLEL.value}


@dataclass
class Replication(PerRank):
    """What the trainer holds: the replicated ids (feature -> ids, hottest first), the batch split,
    the replicas' optimizer, a summary for metrics.json. Its checkpoint state (per rank): the ids,
    which a resume must replicate again (the checkpoint's replica tensors are rows of exactly those;
    dlrm-export writes them back over their tables' rows), and this rank's unsynchronised gradients."""

    hot_ids: dict[str, torch.Tensor]
    split: HotSplit
    optimizer: HotRowOptimizer
    summary: dict[str, Any] = field(default_factory=dict)

    def metrics(self, iterations: int) -> dict[str, Any]:
        """The summary with every rank's sync bytes per iteration (summed), the sync's ratio on
        its rows (fp32 bytes / coded bytes, all ranks; 1 for the exact sync) and a crc32 of each
        rank's replicas (equal digests: identical replicas). A collective."""
        weights = torch.cat([p.detach().flatten() for p in self.optimizer.params.values()])
        wire = self.optimizer.wire
        coded = (wire.raw_row_bytes, wire.coded_row_bytes) if wire is not None else (0, 0)
        mine = (self.optimizer.sent_bytes, zlib.crc32(weights.cpu().numpy().tobytes()), *coded)
        ranks: list[Any] = [mine]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        sent, raw, coded = (sum(r[i] for r in ranks) for i in (0, 2, 3))
        return {
            "hot_rows": {
                **self.summary,
                "sync_bytes_per_iteration": sent / iterations if iterations else 0.0,
                "sync_row_ratio": (raw / coded if coded else None) if wire is not None else 1.0,
                "replica_digest_per_rank": [r[1] for r in ranks],
            }
        }

    def state_dict(self) -> dict[str, Any]:
        return {"hot_ids": self._ids(), **self.optimizer.pending_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the pending gradients; refuse a checkpoint written with other replicated ids."""
        theirs = {f: [int(i) for i in ids] for f, ids in state.get("hot_ids", {}).items()}
        if theirs != self._ids():
            counts = [{f: len(ids) for f, ids in d.items()} or "none" for d in (theirs, self._ids())]
            why = " (as many rows, other ids: the id statistics differ)" if counts[0] == counts[1] else ""
            raise CheckpointError(
                f"it replicates hot rows {counts[0]} but this run replicates {counts[1]}{why}: resume with the "
                "placement.hot_rows (and data, placement.estimate_batches) the checkpoint was written with, or start "
                "a new run (resume=false)"
            )
        self.optimizer.load_pending_state(state)

    def _ids(self) -> dict[str, list[int]]:
        return {f: [int(i) for i in ids] for f, ids in self.hot_ids.items()}

    def sync_traffic(self, row_ratio: float | None) -> ReplicaSync:
        """The replica sync as :mod:`dlrm.placement.traffic` prices it, at the row ratio this run measured
        (metrics.json ``hot_rows.sync_row_ratio``)."""
        every, wire = self.optimizer.sync_every, self.optimizer.wire
        if wire is None:
            return ReplicaSync(every=every)
        return ReplicaSync(every, row_ratio or 1.0, wire.width, HEADER_BYTES, padded=False)


def choose_sizes(
    spec: PlacementSpec,
    tables: Sequence[str],
    freqs: Sequence[FeatureFrequency],
    wire: Wire,
    free_bytes: float,
) -> dict[str, int]:
    """table -> rows to replicate (tables with none left out), from a number, a list or auto."""
    if spec.hot_rows == "auto":
        chosen = choose_auto(tables, freqs, wire, free_bytes, verbose=is_main())
        return {t: p.hot for t, p in chosen.items()}
    wanted = spec.hot_rows if isinstance(spec.hot_rows, list) else [int(spec.hot_rows)] * len(tables)
    sizes = {}
    for t, f, h in zip(tables, freqs, wanted, strict=True):
        if h > len(f.top_ids) and is_main():
            log.warning(
                "placement.hot_rows: %s has %d known hot ids, replicating those (asked for %d)", t, len(f.top_ids), h
            )
        if min(h, len(f.top_ids)):
            sizes[t] = min(h, len(f.top_ids))
    need = sum(sizes.values()) * wire.row_bytes
    if need > free_bytes:
        raise ValueError(
            f"placement.hot_rows={spec.hot_rows} needs {need} bytes per rank for replicas, but placement.memory_budget "
            f"leaves {free_bytes:.0f} after the sharded tables: lower hot_rows, use auto, or raise the budget"
        )
    return sizes


def setup_replication(
    spec: PlacementSpec,
    model: torch.nn.Module,
    features: Sequence[str],
    freqs: Sequence[FeatureFrequency],
    optimizer_cfg: Mapping[str, Any],
    compression: CompressionSpec,
    batch_size: int,
    dim: int,
    runtime: CompressionRuntime | None,
    directions: tuple[Direction, Direction] | None,
) -> Replication | None:
    """Replicate the chosen hot rows in the sharded ``model`` (None when none are chosen), priced
    with the all-to-alls' ``directions`` (:func:`dlrm.placement.codec_ratio.priced_directions`);
    ``runtime``'s backward codec (ours; None for QComms) codes the sync with ``sync_codec=backward``."""
    if not spec.replicates:
        return None
    backward_codec = runtime.backward if runtime is not None else None
    if spec.sync_codec == "backward" and (backward_codec is None or not backward_codec.bounded):
        what = "none of ours" if backward_codec is None else f"codec {backward_codec.spec.codec!r}"
        raise ValueError(
            f"placement.sync_codec=backward codes the replica sync with compression.backward's error-bounded "
            f"codec, but compression={compression.name} has {what} there: use compression=lossy (or auto), "
            "or placement.sync_codec=exact"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    rule = str(optimizer_cfg["sparse"]["name"])
    if rule not in STATE_BYTES_PER_ROW:
        raise ValueError(
            f"placement.hot_rows needs optimizer.sparse.name in {sorted(STATE_BYTES_PER_ROW)}, got {rule!r}"
        )
    row_bytes = 4 * dim + STATE_BYTES_PER_ROW[rule](dim)
    used = table_memory_per_rank(model, rule)
    free = float("inf") if spec.memory_budget is None else spec.memory_budget - max(used)
    tables = table_names(features)
    assert directions is not None, "placement.hot_rows prices with the all-to-alls' directions"
    wire = wire_of(directions, batch_size, world, dim, spec.sync_every, row_bytes, spec.sync_codec)
    sizes = choose_sizes(spec, tables, freqs, wire, free)
    for t in data_parallel_tables(model) & set(sizes):
        if is_main():
            log.info("placement.hot_rows: %s is data_parallel (already on every rank), not replicated", t)
        del sizes[t]
    if not sizes:
        if is_main():
            log.info("placement.hot_rows=%s: no table replicated", spec.hot_rows)
        return None
    hot_ids = {
        f: torch.from_numpy(np.asarray(freq.top_ids[: sizes[t]]))
        for f, t, freq in zip(features, tables, freqs, strict=True)
        if t in sizes
    }
    replicas = install(model, hot_ids, dim)
    sparse = optimizer_cfg["sparse"]
    coded = None
    if spec.sync_codec == "backward":
        assert backward_codec is not None  # checked above
        coded = SyncWire(backward_codec, list(replicas.weights), [len(w) for w in replicas.weights.values()], dim)
    # where the split's and the sync's compactions run: the backward codec's backend (its own), else the run's
    backend = backward_codec.codec.backend_choice if backward_codec is not None else compression.backend
    optimizer = HotRowOptimizer(
        {f"model.sparse_arch.hot.weights.{f}": w for f, w in replicas.weights.items()},  # as the model names them
        rule,
        lr=float(sparse["lr"]),
        eps=float(sparse.get("eps", 1e-8)),
        sync_every=spec.sync_every,
        wire=coded,
        backend=backend,
    )
    replica_bytes = sum(sizes.values()) * row_bytes
    summary = {
        "tables": sizes,
        "sync_every": spec.sync_every,
        "sync_codec": spec.sync_codec,
        "replica_bytes_per_rank": replica_bytes,
        "memory_bytes_per_rank": [u + replica_bytes for u in used],  # tables, their state and replicas
    }
    if is_main():
        log.info("hot-row replication: %s", summary)
    return Replication(hot_ids, HotSplit(hot_ids, backend), optimizer, summary)
