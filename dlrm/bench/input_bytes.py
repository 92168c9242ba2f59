"""Bytes of the embedding path with and without ``compression.input=ids``, measured in one go.

Trains each variant for a few iterations on 2 gloo ranks (torchrun) and prints the wire bytes per
iteration of each path from its metrics.json, with each variant's ratio against the first (the
baseline measured in the same invocation)::

    python -m dlrm.bench.input_bytes --out runs/input_bytes -- data=synthetic batch_size=1024 model.embedding_dim=64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {"lossy": ["compression=lossy"], "lossy+ids": ["compression=lossy", "compression.input=ids"]}
PATHS = ("input", "forward", "backward")


def run(out: Path, name: str, overrides: Sequence[str], nproc: int, port: int) -> dict:
    """One training run of a variant; its metrics.json."""
    run_dir = out / name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "-m",
        "dlrm.train",
        f"hydra.run.dir={run_dir}",
        "progress_bar=false",
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads((run_dir / "metrics.json").read_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the runs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every variant (after --)")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, extra in VARIANTS.items():
        m = run(a.out, name, [*a.overrides, f"max_iterations={a.iterations}", *extra], a.nproc, a.port)
        rows[name] = {k: m["wire_bytes_by_path"][k] for k in PATHS}
        rows[name]["embedding path"] = sum(rows[name][k] for k in PATHS)
        rows[name]["predicted input"] = m["predicted_wire_bytes_by_path"]["input"]
        rows[name]["samples/s"] = m["samples_per_s"]
    base = rows[next(iter(VARIANTS))]
    print(f"bytes per iteration, all {a.nproc} ranks; overrides: {' '.join(a.overrides) or '(defaults)'}")
    print("samples/s: training throughput on this machine's unthrottled loopback (noisy on shared cores)")
    print(f"| variant | {' | '.join(base)} | input ratio | path ratio |")
    print("|---|" + "---:|" * (len(base) + 2))
    for name, r in rows.items():
        cells = " | ".join(f"{v:,.0f}" for v in r.values())
        ratio_in, ratio_path = base["input"] / r["input"], base["embedding path"] / r["embedding path"]
        print(f"| {name} | {cells} | {ratio_in:.2f}x | {ratio_path:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
