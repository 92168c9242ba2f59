"""The ``placement`` config group: id statistics, the comm_aware planner's inputs and hot-row
replication, checked in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from data.frequency import DEFAULT_TOP_N
from dlrm.process.config_checks import check_keys, integer, number, one_of, plain_config

_PLACEMENT_KEYS = {"memory_budget", "estimate_batches", "link_mbit", "hot_rows", "sync_every", "sync_codec"}
SYNC_CODECS = ("exact", "backward")


@dataclass(frozen=True)
class PlacementSpec:
    """A validated ``placement`` group."""

    memory_budget: int | None = None  # bytes per rank for table shards, their optimizer state and replicas
    estimate_batches: int = 16  # global batches to estimate id frequencies from when meta.json has none
    link_mbit: float | None = None  # the link the comm_aware planner prices bytes with (None: timed)
    hot_rows: int | list[int] | str = 0  # ids replicated on every rank: N, N per table, or auto (0: off)
    sync_every: int = 1  # replica gradients summed every k iterations
    sync_codec: str = "exact"  # the replica gradient sync: exact fp32, or the backward all-to-all's codec

    @property
    def replicates(self) -> bool:
        return self.hot_rows != 0

    @property
    def top_n(self) -> int:
        """Hot ids to keep per feature when estimating frequencies: enough for an explicit hot_rows."""
        explicit = max(self.hot_rows) if isinstance(self.hot_rows, list) else self.hot_rows
        return max(DEFAULT_TOP_N, explicit if isinstance(explicit, int) else 0)


def parse_placement_cfg(cfg: Mapping[str, Any] | None, sharding_type: str, num_tables: int) -> PlacementSpec:
    """The ``placement`` group, every key checked; a key that would have no effect is refused."""
    where = "placement"
    cfg = dict(plain_config(cfg) or {})
    check_keys(cfg, _PLACEMENT_KEYS, where)
    hot = cfg.get("hot_rows") or 0
    if isinstance(hot, list):
        if len(hot) != num_tables or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hot):
            raise ValueError(f"{where}.hot_rows as a list needs {num_tables} integers >= 0 (one per table), got {hot}")
        hot = hot if any(hot) else 0
    elif hot != "auto" and (isinstance(hot, bool) or not isinstance(hot, int) or hot < 0):
        raise ValueError(f"{where}.hot_rows must be an integer >= 0, a list of them per table, or auto (got {hot!r})")
    if hot != 0 and sharding_type == "data_parallel":
        raise ValueError(
            f"{where}.hot_rows has no effect under sharding.type=data_parallel (every table is already whole on "
            "every rank, so no id crosses the network); set it to 0 or pick another sharding"
        )
    k = integer(cfg, "sync_every", where, 1, minimum=1)
    if k > 1 and hot == 0:
        raise ValueError(f"{where}.sync_every={k} has no effect without {where}.hot_rows; set hot_rows or leave it 1")
    codec = one_of(cfg, "sync_codec", where, SYNC_CODECS, "exact")
    if codec != "exact" and hot == 0:
        raise ValueError(
            f"{where}.sync_codec={codec} has no effect without {where}.hot_rows; set hot_rows or leave it exact"
        )
    if cfg.get("link_mbit") is not None and sharding_type != "comm_aware":
        raise ValueError(
            f"{where}.link_mbit only applies to sharding=comm_aware (sharding.type is {sharding_type!r}); "
            "use sharding=comm_aware or leave it null"
        )
    budget = cfg.get("memory_budget")
    if budget is not None and sharding_type != "comm_aware" and hot == 0:
        raise ValueError(
            f"{where}.memory_budget only applies to sharding=comm_aware or {where}.hot_rows "
            f"(sharding.type is {sharding_type!r}, hot_rows is 0); set one of them or leave it null"
        )
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
        raise ValueError(f"{where}.memory_budget must be a number of bytes per rank > 0, or null (got {budget!r})")
    n = integer(cfg, "estimate_batches", where, 16, minimum=1)
    link = None if cfg.get("link_mbit") is None else number(cfg, "link_mbit", where, positive=True)
    return PlacementSpec(None if budget is None else int(budget), n, link, hot, k, codec)
