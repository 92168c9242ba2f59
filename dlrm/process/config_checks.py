"""Validation helpers shared by every config parser (compression, policy, dense_comm, placement,
strategy, precision): each check written once, so that every error names the offending key the
same way."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

# Keys that no longer exist, and what to set instead. Hydra rejects an override of a missing key
# with "Key ... is not in struct", which does not say where the value went; the entry point
# checks the command line against this table first.
MOVED = {
    "compression.forward.eb": "the policy group owns every bound: policy.forward.eb under policy=fixed, "
    "iteration_wise or closed_loop; policy.forward.bounds.{tight,base,loose} and "
    "policy.forward.scale under policy=table_wise or dual (the default)",
    "compression.backward.eb": "the policy group owns every bound: policy.backward.eb (and policy.backward.scale)",
}


def plain_config(cfg: Any) -> Any:
    """An OmegaConf container as plain, resolved Python (anything else unchanged)."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def check_keys(cfg: Mapping[str, Any], allowed: set[str], where: str) -> None:
    """Refuse keys a parser would silently ignore."""
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def number(cfg: Mapping[str, Any], key: str, where: str, default: float | None = None, positive: bool = False) -> float:
    """``cfg[key]`` as a finite float >= 0 (> 0 with ``positive``), or ``default`` when absent."""
    if key not in cfg or cfg[key] is None:
        if default is None:
            raise ValueError(f"{where}.{key} is missing")
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}.{key} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{where}.{key} must be finite and {'> 0' if positive else '>= 0'}, got {v}")
    return v


def integer(cfg: Mapping[str, Any], key: str, where: str, default: int | None = None, minimum: int = 0) -> int:
    """``cfg[key]`` as an integer >= ``minimum`` (true/false are not integers), ``default`` when absent."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}.{key} must be an integer >= {minimum}, got {v!r}")
    return v


def flag(cfg: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    """``cfg[key]`` as true or false (nothing else), ``default`` when absent."""
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {v!r}")
    return v


def one_of(cfg: Mapping[str, Any], key: str, where: str, choices: Sequence[Any], default: Any = None) -> Any:
    """``cfg[key]`` (``default`` when absent) if it is one of ``choices``."""
    v = cfg.get(key, default)
    if v not in choices:
        raise ValueError(f"{where}.{key} must be one of {', '.join(map(str, choices))}, got {v!r}")
    return v


def check_moved_keys(overrides: Sequence[str]) -> None:
    """Stop on a command-line override of a key listed in :data:`MOVED`, naming where it went."""
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key in MOVED:
            raise SystemExit(f"override {o!r}: {key} has no effect any more; {MOVED[key]}")
