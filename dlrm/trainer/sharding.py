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

from dlrm.process.env import DistEnv

SHARDING_TYPES = {
    "planner": None,
    "table_wise": ShardingType.TABLE_WISE.value,
    "row_wise": ShardingType.ROW_WISE.value,
    "column_wise": ShardingType.COLUMN_WISE.value,
    "table_row_wise": ShardingType.TABLE_ROW_WISE.value,
    "table_column_wise": ShardingType.TABLE_COLUMN_WISE.value,
    "data_parallel": ShardingType.DATA_PARALLEL.value,
}


def kernel_for(sharding_type: str) -> str:
    """The compute kernel of a sharding type: TorchRec runs data-parallel tables only with the
    dense kernel; every other type takes the fused one (the optimizer applied in the backward)."""
    return "dense" if sharding_type == ShardingType.DATA_PARALLEL.value else "fused"


def constraints_for(
    cfg: Mapping[str, Any], table_names: Sequence[str], dim: int, fused_only: bool = False
) -> dict[str, ParameterConstraints] | None:
    """Per-table constraints that pin the sharding type (and fused kernel) a config asks for;
    ``fused_only`` keeps the planner off data-parallel tables (plain parameters, no fused kernel)."""
    kind = cfg["type"]
    if kind not in SHARDING_TYPES:
        choices = sorted([*SHARDING_TYPES, "comm_aware"])
        raise ValueError(f"sharding.type must be one of {choices} (got {kind!r})")
    sharding_type = SHARDING_TYPES[kind]
    if sharding_type is None and not fused_only:
        return None
    dp = ShardingType.DATA_PARALLEL.value
    if fused_only and sharding_type == dp:
        raise ValueError(
            "sharding.type=data_parallel cannot hold precision.embeddings=fp16 tables (see dlrm/precision/config.py)"
        )
    kinds = [sharding_type] if sharding_type else [t for t in SHARDING_TYPES.values() if t not in (None, dp)]
    min_partition = cfg.get("min_partition") or max(4, dim // 2)
    return {
        name: ParameterConstraints(
            sharding_types=kinds,
            compute_kernels=sorted({kernel_for(k) for k in kinds}),
            min_partition=min_partition,
        )
        for name in table_names
    }


def check_supported(
    cfg: Mapping[str, Any], supported: Sequence[str], excluded: Mapping[str, str] | None = None
) -> None:
    """A sharding type the config pins must be one the compression's sharder handles; ``excluded``
    names the setting that rules a type out (type -> why), for the error."""
    pinned = SHARDING_TYPES.get(cfg["type"])
    if pinned is not None and pinned in (excluded or {}):
        raise ValueError(f"sharding.type={cfg['type']} cannot be used with {(excluded or {})[pinned]}")
    if pinned is not None and pinned not in supported:
        raise ValueError(
            f"sharding.type={cfg['type']} is not among the sharding types this compression supports "
            f"(compression.sharding_types: {list(supported)}); pick one of those or another compression"
        )


def topology_args(env: DistEnv) -> dict[str, Any]:
    """TorchRec Topology arguments of this run's ranks (memory caps left to the caller)."""
    return {"world_size": env.world_size, "compute_device": env.device.type, "local_world_size": env.local_world_size}


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
    planner: EmbeddingShardingPlanner | None = None,
) -> DistributedModelParallel:
    """Plan collectively (every rank gets rank 0's plan) and wrap the model in DMP; the dense part
    goes through ``data_parallel_wrapper`` (TorchRec's default DDP wrapping when None);
    ``fused_only``: every table in FBGEMM's fused kernel (see :func:`constraints_for`). A given
    ``planner`` (sharding=comm_aware's, which applies ``fused_only`` itself) replaces the one
    ``cfg`` describes."""
    if planner is None:
        planner = EmbeddingShardingPlanner(
            topology=Topology(**topology_args(env)),
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
