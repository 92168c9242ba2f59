"""The cost model's bytes per rank against real runs at several world sizes.

``python -m dlrm.bench.model_check RUN_DIR...`` reads each trainer run's metrics.json (the wire
meter's ``wire_bytes_by_path``) and its Hydra config, and predicts every path's bytes per rank
from the model: the raw all-to-all and input bytes of its workload (:class:`Workload`) divided by
the ratio measured in the *smallest* run of the same configuration (``compression=none``: ratio 1,
no reference). The smallest run's own rows are the calibration; the others are predictions of how
bytes scale with W. The dense gradients are left out: their wire bytes in metrics.json are the
dense hook's count from the same formula (:func:`sparse_aggregation_bytes`), not a meter, and stock
DDP's all-reduce is not metered.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dlrm.performance.cost_model import Workload

PATHS = ("forward", "backward", "input")  # the transport's meter (wire_bytes_by_path)


def load(run: Path) -> dict[str, Any]:
    """A run's configuration name, W, workload and bytes per rank by path (per iteration)."""
    m = json.loads((run / "metrics.json").read_text())
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    ws = int(m["world_size"])
    w = Workload(
        ranks=ws,
        batch_per_rank=int(cfg.batch_size),
        dims=(int(cfg.model.embedding_dim),) * len(m["sharding_plan"]),
    )
    per_rank = {p: float(m["wire_bytes_by_path"].get(p, 0.0)) / ws for p in PATHS}
    return {
        "run": str(run),
        "config": f"{m['compression']}+{m['dense_comm']}",
        "ws": ws,
        "workload": w,
        "bytes": per_rank,
    }


def raw(w: Workload, path: str) -> float:
    return w.input_dist_bytes() if path == "input" else w.a2a_bytes()


def predict(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """``run``'s bytes per rank by path from the model and ``ref``'s measured ratios."""
    out = {}
    for path in PATHS:
        ratio = 1.0 if run["config"].startswith("none+") else raw(ref["workload"], path) / ref["bytes"][path]
        out[path] = raw(run["workload"], path) / ratio
    return out


def report(runs: Sequence[Path]) -> list[dict[str, Any]]:
    loaded = sorted((load(r) for r in runs), key=lambda r: (r["config"], r["ws"]))
    rows = []
    for r in loaded:
        ref = next(x for x in loaded if x["config"] == r["config"])  # the smallest W of its config
        pred = predict(r, ref)
        for path in PATHS:
            m, p = r["bytes"][path], pred[path]
            err = (p / m - 1) if m else float("inf")
            rows.append(
                {
                    "config": r["config"],
                    "ws": r["ws"],
                    "path": path,
                    "measured": m,
                    "predicted": p,
                    "error": err,
                    "reference": r is ref,
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlrm.bench.model_check", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="trainer run directories (metrics.json, .hydra/)")
    args = p.parse_args(argv)
    for run in args.runs:
        if not (run / "metrics.json").is_file():
            p.error(f"{run}: no metrics.json (a finished trainer run directory)")
    print("| config | W | path | measured B/rank/iter | model B/rank/iter | error |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for row in report(args.runs):
        note = " (calibration)" if row["reference"] and not row["config"].startswith("none+") else ""
        print(
            f"| {row['config']} | {row['ws']} | {row['path']} | {row['measured']:,.0f} | "
            f"{row['predicted']:,.0f} | {100 * row['error']:+.1f}%{note} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
