"""``compression.strategy``: when ``auto`` calibrates and re-plans, or which saved strategy it replays
(:mod:`dlrm.strategy.controller` runs it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrm.process.config_checks import check_keys, integer, plain_config


@dataclass(frozen=True)
class StrategySpec:
    """When to calibrate and re-plan, or which saved strategy to replay."""

    calibrate_iterations: int = 2
    measure_iterations: int = 3
    replan_every: int = 1000
    drift: float = 0.2
    min_gain: float = 0.03  # a plan must be predicted this much faster than sending raw
    file: str | None = None  # replay this strategy.json instead of deciding


def parse_strategy_cfg(cfg: Mapping[str, Any] | None, file: str | None) -> StrategySpec:
    """``compression.strategy`` (and ``compression.strategy_file``) checked into a :class:`StrategySpec`."""
    cfg = plain_config(cfg) or {}
    where = "compression.strategy"
    check_keys(cfg, {f for f in StrategySpec.__dataclass_fields__ if f != "file"}, where)
    d = StrategySpec()
    out: dict[str, Any] = {}
    for key in ("calibrate_iterations", "measure_iterations", "replan_every"):
        out[key] = integer(cfg, key, where, getattr(d, key), minimum=1)
    drift = cfg.get("drift", d.drift)
    if isinstance(drift, bool) or not isinstance(drift, (int, float)) or not drift > 0:
        raise ValueError(f"{where}.drift must be a number > 0, got {drift!r}")
    min_gain = cfg.get("min_gain", d.min_gain)
    if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
        raise ValueError(f"{where}.min_gain must be a number in [0, 1), got {min_gain!r}")
    if file is not None and not Path(file).expanduser().is_file():
        raise FileNotFoundError(f"compression.strategy_file={file}: no such file (a strategy.json of an earlier run)")
    return StrategySpec(
        **out,
        drift=float(drift),
        min_gain=float(min_gain),
        file=None if file is None else str(Path(file).expanduser()),
    )
