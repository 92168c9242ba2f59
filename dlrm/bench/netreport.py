"""Read the network benchmark's run directories and build its tables (no torch or network needed).

A run directory is the trainer's Hydra run dir (``metrics.json``, ``.hydra/config.yaml``) plus
the probe's ``probe_rank<R>.json`` (:mod:`dlrm.bench.netprobe`). :func:`load_run` turns one into a
:class:`RunResult`; :func:`summarize` groups repeats per (rate, configuration) and compares each
with the baseline of the same repeat; :func:`validate_model` checks the cost model of
:mod:`dlrm.performance.cost_model` against the measurements; :func:`format_table` prints it all.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from dlrm.performance import cost_model as cm
from dlrm.performance.network import Link

PASSES = ("forward", "backward")
METRICS_KEYS = ("auc", "logloss", "iterations", "forward_ratio", "backward_ratio", "world_size")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
UNLIMITED = "unlimited"


class RunDirError(ValueError):
    """A run directory is missing a file or a key; the message names both."""


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(b|k|kb|m|mb|g|gb|kbit|mbit|gbit)?\s*$", re.IGNORECASE)
_SIZE_SCALE = {
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "kbit": 1024 / 8,
    "mbit": 1024**2 / 8,
    "gbit": 1024**3 / 8,
}


def parse_with_overrides(
    p: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """The driver's own options, and the trainer's Hydra overrides that follow them (after an
    optional ``--``); an unknown option is an error naming it."""
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    bad = [a for a in rest if a.startswith("-")]
    if bad:
        p.error(f"unknown option(s) {bad}; the trainer's Hydra overrides go after `--`")
    return args, rest


def size_bytes(size: str) -> float:
    """A tc size ('1mb', '64kb', '1500'; binary units as tc uses them for sizes) in bytes."""
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"size {size!r}: expected a number with b, kb, mb, gb, kbit or mbit (e.g. 1mb)")
    return float(m.group(1)) * _SIZE_SCALE[(m.group(2) or "b").lower()]


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate ('200mbit', '1gbit'; decimal units as tc uses them) in bytes/s; 'unlimited' is inf."""
    if rate.strip().lower() == UNLIMITED:
        return math.inf
    m = _RATE.match(rate)
    if not m:
        raise ValueError(
            f"rate {rate!r}: expected a number with bit, kbit, mbit, gbit or tbit (e.g. 200mbit), or {UNLIMITED!r}"
        )
    return float(m.group(1)) * _RATE_SCALE[m.group(2).lower()] / 8


@dataclass
class RunResult:
    """One training run: steady-state timings per iteration (mean over ranks) and final metrics."""

    label: str
    rate: str
    repeat: int
    world_size: int
    samples_per_iteration: int
    iterations_timed: int
    iteration_ms: float
    a2a_ms: dict[str, float]  # exposed pooled-embedding all-to-all time, per pass
    a2a_bytes: dict[str, float]  # bytes one rank sends to the others, per pass
    codec_ms: dict[str, float]
    other_a2a_ms: float  # the sparse input dist (ids), overlapped by TorchRec's pipeline
    dense_params: int
    embedding_dims: list[int]
    auc: float
    logloss: float
    forward_ratio: float  # the trainer's own raw/wire ratios (compressed configs)
    backward_ratio: float
    max_abs_error_seen: float | None
    trainer_samples_per_s: float | None
    extra: dict[str, Any] = field(default_factory=dict)  # load average, link bytes, wall time
    dense_ratio: float = 1.0  # the dense all-reduce's raw/wire ratio (metrics.json; 1 for stock DDP)
    dense_codec_ms: float = 0.0  # the dense hook's encode + decode per iteration

    @property
    def a2a_share(self) -> float:
        return (self.a2a_ms["forward"] + self.a2a_ms["backward"]) / self.iteration_ms

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_iteration / (self.iteration_ms / 1e3)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing (did the run finish? see train_rank*.log next to it)") from None
    except json.JSONDecodeError as e:
        raise RunDirError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


def _need(d: Mapping[str, Any], key: str, path: Path) -> Any:
    if key not in d or d[key] is None:
        raise RunDirError(f"{path}: key {key!r} is missing or null")
    return d[key]


def _run_config(run_dir: Path) -> dict[str, Any]:
    """batch size and embedding dims from Hydra's saved config of the run."""
    from omegaconf import OmegaConf

    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        raise RunDirError(f"{path}: missing (not a Hydra run directory)")
    cfg = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(path), resolve=False))  # Hydra saves a mapping
    batch = _need(cfg, "batch_size", path)
    dim = _need(_need(cfg, "model", path), "embedding_dim", path)
    return {"batch_size": int(batch), "embedding_dim": int(dim)}


def _steady(steps: list[dict[str, float]], warmup: int, path: Path) -> list[dict[str, float]]:
    if len(steps) <= warmup:
        raise RunDirError(
            f"{path}: {len(steps)} training iterations recorded, need more than the "
            f"{warmup} warm-up iterations (raise --iterations)"
        )
    return steps[warmup:]


def load_run(
    run_dir: Path, warmup: int, label: str, rate: str, repeat: int, extra: Mapping[str, Any] | None = None
) -> RunResult:
    """Parse one run directory; the first ``warmup`` iterations are left out of the timings."""
    run_dir = Path(run_dir)
    mpath = run_dir / "metrics.json"
    metrics = _read_json(mpath)
    for key in METRICS_KEYS:
        _need(metrics, key, mpath)
    ws = int(metrics["world_size"])
    cfg = _run_config(run_dir)
    per_rank = []
    for r in range(ws):
        ppath = run_dir / f"probe_rank{r}.json"
        probe = _read_json(ppath)
        if probe.get("error"):
            raise RunDirError(f"{ppath}: rank {r} failed: {probe['error']}")
        steps = _steady(_need(probe, "steps", ppath), warmup, ppath)
        for i, s in enumerate(steps):
            if "ms" not in s:
                raise RunDirError(f"{ppath}: iteration {warmup + i} has no 'ms'")
        per_rank.append((probe, steps))
    n_timed = min(len(s) for _, s in per_rank)

    def mean(key: str) -> float:
        """Mean per iteration over the steady iterations, then over ranks."""
        return statistics.fmean(statistics.fmean(s.get(key, 0.0) for s in steps) for _, steps in per_rank)

    n_tables = len(_need(metrics, "sharding_plan", mpath))
    return RunResult(
        label=label,
        rate=rate,
        repeat=repeat,
        world_size=ws,
        samples_per_iteration=cfg["batch_size"] * ws,
        iterations_timed=n_timed,
        iteration_ms=mean("ms"),
        a2a_ms={d: mean(f"a2a/{d}/ms") for d in PASSES},
        a2a_bytes={d: mean(f"a2a/{d}/bytes") for d in PASSES},
        codec_ms={d: mean(f"codec/{d}/ms") for d in PASSES},
        other_a2a_ms=mean("other_a2a/ms"),
        dense_params=int(per_rank[0][0].get("dense_params") or 0),
        embedding_dims=[cfg["embedding_dim"]] * n_tables,
        auc=math.nan if metrics["auc"] is None else float(metrics["auc"]),  # null: one class in the split
        logloss=float(metrics["logloss"]),
        forward_ratio=float(metrics["forward_ratio"]),
        backward_ratio=float(metrics["backward_ratio"]),
        max_abs_error_seen=metrics.get("max_abs_error_seen"),
        trainer_samples_per_s=metrics.get("samples_per_s"),
        extra=dict(extra or {}),
        dense_ratio=float(metrics.get("dense_ratio") or 1.0),
        dense_codec_ms=mean("codec/dense/ms"),
    )


@dataclass
class Summary:
    """All repeats of one configuration at one rate, against the baseline of the same repeats."""

    rate: str
    label: str
    repeats: int
    iteration_ms: float  # median over repeats
    samples_per_s: float
    speedup: float  # median over repeats of baseline_ms / this_ms within the same repeat
    speedup_range: tuple[float, float]
    a2a_share: float
    a2a_ms: dict[str, float]
    wire_ratio: dict[str, float]  # baseline bytes / these bytes, per pass (probe-measured)
    trainer_ratio: dict[str, float]  # metrics.json forward_ratio / backward_ratio
    codec_ms: dict[str, float]  # per pass of the all-to-all, and "dense" (the all-reduce's hook)
    auc: float
    auc_delta: float
    dense_ratio: float = 1.0
    model_ms: float | None = None
    model_error: float | None = None  # model_ms / iteration_ms - 1


def summarize(results: Iterable[RunResult], baseline: str = "none") -> list[Summary]:
    """Median figures per (rate, label), speedups paired with the baseline run of each repeat."""
    results = list(results)
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.rate, r.label), []).append(r)
    out = []
    for (rate, label), runs in groups.items():
        base = {r.repeat: r for r in groups.get((rate, baseline), [])}
        if not base:
            raise ValueError(f"no {baseline!r} run at rate {rate}: the baseline must be among the configs")
        paired = [base[r.repeat].iteration_ms / r.iteration_ms for r in runs if r.repeat in base]
        if not paired:
            raise ValueError(f"{label} at {rate}: no repeat shares a baseline run")
        med = lambda xs: statistics.median(list(xs))  # noqa: E731
        base_bytes = {d: med(b.a2a_bytes[d] for b in base.values()) for d in PASSES}
        it_ms = med(r.iteration_ms for r in runs)
        auc = statistics.fmean(r.auc for r in runs)
        out.append(
            Summary(
                rate=rate,
                label=label,
                repeats=len(runs),
                iteration_ms=it_ms,
                samples_per_s=med(r.samples_per_s for r in runs),
                speedup=med(paired),
                speedup_range=(min(paired), max(paired)),
                a2a_share=med(r.a2a_share for r in runs),
                a2a_ms={d: med(r.a2a_ms[d] for r in runs) for d in PASSES},
                wire_ratio={
                    d: (
                        base_bytes[d] / med(r.a2a_bytes[d] for r in runs)
                        if med(r.a2a_bytes[d] for r in runs) > 0
                        else math.nan
                    )
                    for d in PASSES
                },
                trainer_ratio={
                    "forward": med(r.forward_ratio for r in runs),
                    "backward": med(r.backward_ratio for r in runs),
                },
                codec_ms={
                    **{d: med(r.codec_ms[d] for r in runs) for d in PASSES},
                    "dense": med(r.dense_codec_ms for r in runs),
                },
                auc=auc,
                auc_delta=auc - statistics.fmean(b.auc for b in base.values()),
                dense_ratio=med(r.dense_ratio for r in runs),
            )
        )
    return out


def _workload(r: RunResult) -> cm.Workload:
    return cm.Workload(
        ranks=r.world_size,
        batch_per_rank=r.samples_per_iteration // r.world_size,
        dims=tuple(r.embedding_dims),
        dense_params=r.dense_params,
    )


def model_breakdown(
    r: RunResult,
    rate: str,
    wire_ratio: Mapping[str, float],
    compute_s: float,
    burst_bytes: float = 0.0,
    dense_ratio: float = 1.0,
) -> cm.Breakdown:
    """The cost model's iteration for a run: link model at ``rate`` (every rank's bytes on the one
    throttled loopback, a tbf burst free per collective), its measured wire ratios and codec
    time (the all-to-alls' and the dense hook's), and ``compute_s``."""
    w = _workload(r)
    link = Link(rate_bytes_per_s(rate), shared=True, burst_bytes=burst_bytes)

    def codec(ratio: float, ms: float, raw: float) -> cm.CodecCost:
        s = ms / 1e3  # measured encode + decode, folded into one throughput
        return cm.CodecCost(ratio=ratio, encode_bytes_per_s=raw / s if s > 0 else math.inf)

    raw, dense_raw = w.a2a_bytes(), w.dense_params * w.value_bytes
    b = cm.iteration_time(
        w,
        link,
        codec(wire_ratio["forward"], r.codec_ms["forward"], raw),
        codec(wire_ratio["backward"], r.codec_ms["backward"], raw),
        codec(dense_ratio, r.dense_codec_ms, dense_raw) if dense_raw else cm.NO_CODEC,
    )
    return cm.Breakdown(**{**b.as_dict(), "compute": compute_s})


def validate_model(
    results: Iterable[RunResult], summaries: list[Summary], baseline: str = "none", burst_bytes: float = 0.0
) -> dict[str, Any]:
    """Calibrate the model's compute on the baseline at the fastest rate, predict every other
    (rate, configuration) and set ``model_ms``/``model_error`` on the summaries."""
    results = list(results)
    base_runs = [r for r in results if r.label == baseline]
    if not base_runs:
        raise ValueError(f"no {baseline!r} runs to calibrate the cost model on")
    cal_rate = max({r.rate for r in base_runs}, key=rate_bytes_per_s)
    cal = [r for r in base_runs if r.rate == cal_rate]
    ones = {d: 1.0 for d in PASSES}
    # compute = measured iteration - modelled communication and codec, median over repeats
    computes = [
        cm.calibrate_compute(r.iteration_ms / 1e3, model_breakdown(r, cal_rate, ones, 0.0, burst_bytes)).compute
        for r in cal
    ]
    compute_s = statistics.median(computes)
    # the share of the baseline's iteration the model puts on the link: where it is most of it,
    # the compute is what is left of a link-bound run, and every prediction inherits its error
    link_share = 1.0 - compute_s / (statistics.median(r.iteration_ms for r in cal) / 1e3)
    by_key = {(r.rate, r.label): r for r in results}
    errors = []
    for s in summaries:
        r = by_key[(s.rate, s.label)]
        b = model_breakdown(r, s.rate, s.wire_ratio, compute_s, burst_bytes, s.dense_ratio)
        s.model_ms = 1e3 * b.total
        s.model_error = s.model_ms / s.iteration_ms - 1
        if not (s.rate == cal_rate and s.label == baseline):
            errors.append(abs(s.model_error))
    return {
        "calibration": f"{baseline} at {cal_rate}",
        "compute_ms": 1e3 * compute_s,
        "calibration_link_share": link_share,
        "burst_bytes": burst_bytes,
        "predictions": len(errors),
        "mean_abs_error": statistics.fmean(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(summaries: list[Summary]) -> str:
    """The results as a Markdown table, one row per (rate, configuration)."""
    lines = [
        "| rate | config | ms/iter | samples/s | speedup vs none (min-max) | a2a share | fwd a2a ms | "
        "bwd a2a ms | wire ratio fwd/bwd/dense | codec ms/iter | test AUC | dAUC | model ms (err) |",
        "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for s in sorted(summaries, key=lambda s: (-rate_bytes_per_s(s.rate), s.rate)):
        lines.append(
            f"| {s.rate} | {s.label} | {s.iteration_ms:.0f} | {s.samples_per_s:,.0f} | "
            f"{s.speedup:.2f}x ({s.speedup_range[0]:.2f}-{s.speedup_range[1]:.2f}) | {100 * s.a2a_share:.0f}% | "
            f"{s.a2a_ms['forward']:.0f} | {s.a2a_ms['backward']:.0f} | "
            f"{_f(s.wire_ratio['forward'], '.1f')}/{_f(s.wire_ratio['backward'], '.1f')}/{s.dense_ratio:.1f} | "
            f"{sum(s.codec_ms.values()):.0f} | {s.auc:.4f} | {s.auc_delta:+.4f} | "
            f"{_f(s.model_ms, '.0f')} ({_f(None if s.model_error is None else 100 * s.model_error, '+.0f')}%) |"
        )
    return "\n".join(lines)


def to_json(
    results: list[RunResult], summaries: list[Summary], validation: Mapping[str, Any], context: Mapping[str, Any]
) -> str:
    """Everything measured, as one JSON document."""
    return json.dumps(
        {
            "context": dict(context),
            "validation": dict(validation),
            "summaries": [asdict(s) for s in summaries],
            "runs": [asdict(r) for r in results],
        },
        indent=1,
        default=str,
    )
