"""The ``placement`` config group: id statistics and the comm_aware planner's inputs, checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlrm.config_checks import check_keys, number

_PLACEMENT_KEYS = {"memory_budget", "estimate_batches", "link_mbit"}


@dataclass(frozen=True)
class PlacementSpec:
    """The ``placement`` group's keys that this module reads."""

    memory_budget: int | None = None  # bytes per rank for the comm_aware planner (None: the device's)
    estimate_batches: int = 16  # batches to estimate id frequencies from when meta.json has none
    link_mbit: float | None = None  # the link the comm_aware planner prices bytes with (None: timed)


def parse_placement_cfg(cfg: Mapping[str, Any], sharding_type: str) -> PlacementSpec:
    """The ``placement`` group, checked; keys only comm_aware reads are refused with other shardings."""
    where = "placement"
    check_keys(cfg, _PLACEMENT_KEYS, where)
    for key in ("memory_budget", "link_mbit"):
        if cfg.get(key) is not None and sharding_type != "comm_aware":
            raise ValueError(
                f"{where}.{key} only applies to sharding=comm_aware (sharding.type is {sharding_type!r}); "
                "use sharding=comm_aware or leave it null"
            )
    budget = cfg.get("memory_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
        raise ValueError(f"{where}.memory_budget must be a number of bytes > 0 or null, got {budget!r}")
    k = cfg.get("estimate_batches", 16)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{where}.estimate_batches must be an integer >= 1, got {k!r}")
    link = None if cfg.get("link_mbit") is None else number(cfg, "link_mbit", where, positive=True)
    return PlacementSpec(None if budget is None else int(budget), k, link)
