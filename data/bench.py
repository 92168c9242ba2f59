"""``dlrm-preprocess`` throughput at several worker counts, against one worker in the same run.

    python -m data.bench [--rows 400000] [--workers 1,2] [--tsv FILE] [--dir DIR]

Writes a Criteo-like TSV with the synthetic generator (``data.synthetic.write_tsv``: the Kaggle
cardinalities, Zipf ids) unless ``--tsv`` names one, then runs the real command line
(``python -m data.preprocess --workers N``) once per worker count, each in its own process.
Prints rows/s from the two passes' own clock (meta.json ``seconds``: worker start-up included,
interpreter start-up not), the wall time of the whole command, the largest resident set of any of
its processes, the speed-up over the first worker count, and checks that every output's arrays
equal the first one's byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from data.synthetic import write_tsv


def run_preprocess(tsv: Path, out: Path, workers: int) -> dict[str, float]:
    """One ``dlrm-preprocess`` command: pass seconds, wall seconds, peak RSS (MiB) of its processes."""
    cmd = [sys.executable, "-m", "data.preprocess", "--format", "kaggle", "--out", str(out), "--overwrite", "-q"]
    t0 = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--workers", str(workers), str(tsv)])
    _, status, usage = os.wait4(proc.pid, 0)  # usage covers the command and its reaped workers
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} --workers {workers} failed with status {status}")
    meta = json.loads((out / "meta.json").read_text())
    return {
        "rows": float(sum(meta["rows"].values())),
        "seconds": float(sum(meta["seconds"].values())),
        "wall": wall,
        "peak_rss_mib": usage.ru_maxrss / 1024,  # Linux reports KiB
    }


def same_arrays(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.npy"))
    return names == sorted(p.name for p in b.glob("*.npy")) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.bench", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=400_000, help="rows of the generated TSV")
    p.add_argument("--workers", default="1,2", help="worker counts, comma-separated; the first is the baseline")
    p.add_argument("--tsv", type=Path, default=None, help="an existing Criteo TSV file instead of a generated one")
    p.add_argument("--dir", type=Path, default=None, help="where to write the TSV and outputs (default: a temp dir)")
    a = p.parse_args(argv)
    counts = [int(w) for w in a.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="dlrm-preprocess-bench-") as tmp:
        work = a.dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tsv = a.tsv
        if tsv is None:
            tsv = work / "train.tsv"
            t0 = time.perf_counter()
            write_tsv(tsv, "train", a.rows)
            print(f"generated {tsv}: {a.rows} rows in {time.perf_counter() - t0:.1f} s")
        print(f"input {tsv}: {tsv.stat().st_size / 2**20:.1f} MiB; {os.cpu_count()} CPUs; load {os.getloadavg()}")
        results = {}
        for w in counts:
            results[w] = run_preprocess(tsv, work / f"out_w{w}", w)
        base = results[counts[0]]
        print("| workers | rows | pass seconds | rows/s | MB/s | speed-up | wall s | peak RSS MiB | same arrays |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for w, r in results.items():
            rate = r["rows"] / r["seconds"]
            print(
                f"| {w} | {r['rows']:.0f} | {r['seconds']:.2f} | {rate:,.0f} | "
                f"{tsv.stat().st_size / r['seconds'] / 1e6:.1f} | {base['seconds'] / r['seconds']:.2f}x | "
                f"{r['wall']:.2f} | {r['peak_rss_mib']:.0f} | "
                f"{same_arrays(work / f'out_w{counts[0]}', work / f'out_w{w}')} |"
            )
        print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
