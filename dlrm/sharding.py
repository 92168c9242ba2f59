"""Sharding plan (TorchRec planner, optionally forcing one sharding type) and the DMP wrapper."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import ModuleSharder, ShardingType

from dlrm.env import DistEnv

SHARDING_TYPES = {
    "planner": None,
    "table_wise": ShardingType.TABLE_WISE.value,
    "row_wise": ShardingType.ROW_WISE.value,
    "column_wise": ShardingType.COLUMN_WISE.value,
    "table_row_wise": ShardingType.TABLE_ROW_WISE.value,
    "table_column_wise": ShardingType.TABLE_COLUMN_WISE.value,
}


def constraints_for(
    cfg: Mapping[str, Any], table_names: Sequence[str], dim: int, fused_only: bool = False
) -> dict[str, ParameterConstraints] | None:
    """Per-table constraints that pin the sharding type (and fused kernel) a config asks for;
    ``fused_only`` keeps the planner off data-parallel tables (plain parameters, no fused kernel)."""
    kind = cfg["type"]
    if kind not in SHARDING_TYPES:
        raise ValueError(f"sharding.type must be one of {sorted(SHARDING_TYPES)} (got {kind!r})")
    sharding_type = SHARDING_TYPES[kind]
    if sharding_type is None and not fused_only:
        return None
    kinds = [sharding_type] if sharding_type else [t for t in SHARDING_TYPES.values() if t is not None]
    min_partition = cfg.get("min_partition") or max(4, dim // 2)
    return {
        name: ParameterConstraints(sharding_types=kinds, compute_kernels=["fused"], min_partition=min_partition)
        for name in table_names
    }


def shard_model(
    model: torch.nn.Module,
    cfg: Mapping[str, Any],
    env: DistEnv,
    sharders: list[ModuleSharder],
    batch_size: int,
    table_names: Sequence[str],
    dim: int,
    data_parallel_wrapper: DataParallelWrapper | None = None,
    fused_only: bool = False,
) -> DistributedModelParallel:
    """Plan collectively (every rank gets rank 0's plan) and wrap the model in DMP; the dense part
    goes through ``data_parallel_wrapper`` (TorchRec's default DDP wrapping when None);
    ``fused_only``: every table in FBGEMM's fused kernel (see :func:`constraints_for`)."""
    planner = EmbeddingShardingPlanner(
        topology=Topology(
            world_size=env.world_size, compute_device=env.device.type, local_world_size=env.local_world_size
        ),
        batch_size=batch_size,
        constraints=constraints_for(cfg, table_names, dim, fused_only),
        storage_reservation=FixedPercentageStorageReservation(percentage=0.05),
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(
        module=model, device=env.device, plan=plan, sharders=sharders, data_parallel_wrapper=data_parallel_wrapper
    )


def describe_plan(model: DistributedModelParallel) -> dict[str, str]:
    """table -> 'sharding_type on ranks [...]', for logs and metrics.json."""
    out = {}
    for module_plan in model.plan.plan.values():
        for table, ps in module_plan.items():
            out[table] = f"{ps.sharding_type} ranks={ps.ranks}"
    return out
