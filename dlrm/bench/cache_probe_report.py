"""The row cache probe's curve over training, from a run's TensorBoard windows.

``python -m dlrm.bench.cache_probe_report RUN_DIR [RUN_DIR ...]`` prints, per run, a Markdown
table by iteration range: the share of each batch's unique forward rows whose id the destination
holds, the share it could keep (within the bound), and the forward ratio today and with the cache
(raw bytes over wire bytes, the probed payloads replaced by what the cache would send), for both
schemes of :mod:`dlrm.embedding_comm.cache_probe` (moved rows sent whole, or as differences). Ranges are
unions of log windows (``log_every``): choose ``log_every`` dividing 100. With ``--compare``, one
line per run with or without ``compression.forward.cache`` (its real wire bytes).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = {
    "unique": "comm/forward/cache_probe/unique_rows",
    "held": "comm/forward/cache_probe/held_rows",
    "hit": "comm/forward/cache_probe/hit_rows",
    "payload": "comm/forward/cache_probe/payload_bytes",
    "cached": "comm/forward/cache_probe/cached_bytes",
    "delta_hit": "comm/forward/cache_delta_probe/hit_rows",
    "delta_cached": "comm/forward/cache_delta_probe/cached_bytes",
    "raw": "comm/forward/raw_bytes",
    "wire": "comm/forward/wire_bytes",
}


def windows(run_dir: Path) -> dict[int, dict[str, float]]:
    """Window end iteration -> the probe's sums over that window (all ranks)."""
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    tags = set(acc.Tags()["scalars"])
    missing = [t for t in TAGS.values() if t not in tags]
    if missing:
        raise ValueError(f"{run_dir}: no {missing} in its TensorBoard files (run with compression.stats.cache_probe)")
    out: dict[int, dict[str, float]] = {}
    for name, tag in TAGS.items():
        for e in acc.Scalars(tag):
            out.setdefault(e.step, {})[name] = e.value
    return out


def ranges(last: int) -> list[tuple[int, int]]:
    """(first, last) iteration ranges: 1-100, 101-300, 301-700, ... doubling, the last 100, all."""
    out, a, width = [], 1, 100
    while a + width - 1 < last - 100:
        out.append((a, a + width - 1))
        a, width = a + width, width * 2
    return list(dict.fromkeys([*out, (a, last), (max(1, last - 99), last), (1, last)]))  # distinct, in order


def summarize(wins: Mapping[int, Mapping[str, float]], first: int, last: int) -> dict[str, float]:
    s: dict[str, float] = {k: 0.0 for k in TAGS}
    for step, w in wins.items():
        if first <= step and step <= last:  # a window ending at `step` lies in the range
            for k in TAGS:
                s[k] += w.get(k, 0.0)
    u = max(s["unique"], 1.0)
    return {
        "held": s["held"] / u,
        "hit": s["hit"] / u,
        "ratio": s["raw"] / s["wire"] if s["wire"] else float("nan"),
        "ratio_cached": s["raw"] / (s["wire"] - s["payload"] + s["cached"]) if s["wire"] else float("nan"),
        "delta_hit": s["delta_hit"] / u,
        "ratio_delta": s["raw"] / (s["wire"] - s["payload"] + s["delta_cached"]) if s["wire"] else float("nan"),
    }


def table(run_dir: Path) -> str:
    wins = windows(run_dir)
    last = max(wins)
    step = min(wins)
    lines = [
        f"**{run_dir.name}** ({last} iterations, log windows of {step})",
        "",
        "| iterations | ids held | hit | forward ratio | cache | gain | delta: hit | cache + delta | gain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for a, b in ranges(last):
        r = summarize(wins, a + step - 1, b)
        label = "whole run" if (a, b) == (1, last) else f"{a}-{b}"
        lines.append(
            f"| {label} | {r['held']:.1%} | {r['hit']:.1%} | {r['ratio']:.1f}x | {r['ratio_cached']:.1f}x "
            f"| {r['ratio_cached'] / r['ratio']:.2f}x | {r['delta_hit']:.1%} | {r['ratio_delta']:.1f}x "
            f"| {r['ratio_delta'] / r['ratio']:.2f}x |"
        )
    metrics = run_dir / "metrics.json"
    if metrics.exists():
        m = json.loads(metrics.read_text())
        mib = m.get("cache_probe_bytes_per_rank", 0.0) / 2**20
        worst = m.get("cache_delta_probe_max_error_over_bound")
        lines += [
            "",
            f"cache memory per rank at the end: {mib:.1f} MiB; delta scheme's worst error/bound {worst}; "
            f"test AUC {m.get('auc')}",
        ]
    return "\n".join(lines)


def compare(run_dirs: Sequence[Path]) -> str:
    """One line per run (with or without ``compression.forward.cache``): the forward ratio over
    the training windows and over the whole run (evaluation included, which never uses the
    cache), the worst forward error / bound of any window (``sample_every=1``: every chunk),
    the test AUC, the caches' memory and the forward codec time (both ranks, per iteration)."""
    lines = [
        "| run | forward ratio (training) | forward ratio (run) | worst error / bound | test AUC | cache MiB/rank "
        "| forward codec ms/iteration |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in run_dirs:
        acc = EventAccumulator(str(d / "tensorboard"), size_guidance={"scalars": 0}).Reload()
        raw = sum(e.value for e in acc.Scalars("comm/forward/raw_bytes"))
        wire = sum(e.value for e in acc.Scalars("comm/forward/wire_bytes"))
        worst = max(e.value for e in acc.Scalars("comm/forward/max_error_over_bound"))
        codec_ms = sum(e.value for e in acc.Scalars("comm/forward/codec_ms"))
        m = json.loads((d / "metrics.json").read_text())
        mib = m.get("cache_bytes_per_rank", 0.0) / 2**20
        lines.append(
            f"| {d.name} | {raw / wire:.1f}x | {m['forward_ratio']:.1f}x | {worst:.7f} | {m['auc']:.4f} | {mib:.1f} "
            f"| {codec_ms / max(m['iterations'], 1):.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--compare", action="store_true", help="runs with/without the cache: one line each")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(args.run_dirs))
        return
    for d in args.run_dirs:
        print(table(d) + "\n")


if __name__ == "__main__":
    main()
