"""The run's final metrics and metrics.json."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def write_metrics_json(path: Path, metrics: Mapping[str, Any]) -> None:
    """Atomically write metrics.json (a reader never sees a half-written file)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def final_metrics(
    test: Mapping[str, Any],
    last_val: Mapping[str, Any],
    *,
    iterations: int,
    samples_per_s: float | None,
    comm: Mapping[str, Any],
    policy: Mapping[str, Any],
    **run: Any,
) -> dict[str, Any]:
    """The keys of metrics.json: the test metrics, the last validation, counts and throughput, the
    communication totals, the policy's summary, and ``run`` (config name, world size, plan, ...)."""
    return {
        **test,
        "val_auc": last_val.get("auc"),
        "val_logloss": last_val.get("logloss"),
        "iterations": iterations,
        "samples_per_s": samples_per_s,
        **comm,
        **run,
        **policy,
    }
