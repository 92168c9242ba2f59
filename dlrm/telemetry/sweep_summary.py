"""Accuracy against compression ratio over a sweep: a markdown table and a PNG with the Pareto front.

    python -m dlrm.bench.summary SWEEP_DIR [--out PREFIX]

Here, not in :mod:`dlrm.bench`, because every training run loads :class:`SweepSummary` (the Hydra
callback of ``configs/config.yaml``) and the trainer never imports the benchmarks.

Reads every ``metrics.json`` under SWEEP_DIR (recursively; each run's Hydra ``.hydra/`` beside it
supplies the policy, bound, codec and seed when metrics.json lacks them), writes
``PREFIX.md`` and ``PREFIX.png`` (default ``SWEEP_DIR/summary``). Runs that differ only in
``seed`` are also averaged (mean and standard deviation), so a difference can be read against the
spread between seeds. Unreadable runs are listed, with the reason, and do not stop the summary. A
null AUC (undefined: the test split held one class) shows as "-" and leaves the run off the plot
and the Pareto front.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from dlrm.process.run_dir import task_rank

REQUIRED = ("auc", "forward_ratio")  # keys every run has; auc may be null (undefined)
UNBOUNDED = ("none", "fp16", "bf16", "int8", "fp8", "mx4")  # codecs without an error bound


@dataclass
class Run:
    """One training run of the sweep, as the summary needs it."""

    config: str  # run directory relative to the sweep
    group: str  # the run's overrides without seed (runs with equal groups are seed repeats)
    overrides: tuple[str, ...]  # the same, one override per item
    policy: str
    bound: float | None
    codec: str
    seed: int | None
    auc: float | None
    logloss: float | None
    forward_ratio: float
    backward_ratio: float | None
    samples_per_s: float | None


@dataclass
class Point:
    """Seed repeats of one configuration: means, standard deviations and the runs."""

    group: str
    runs: list[Run] = field(default_factory=list)

    @overload
    def mean(self, key: Literal["forward_ratio"]) -> float: ...  # every run has it
    @overload
    def mean(self, key: str) -> float | None: ...
    def mean(self, key: str) -> float | None:
        vals = [getattr(r, key) for r in self.runs if getattr(r, key) is not None]
        return statistics.fmean(vals) if vals else None

    def std(self, key: str) -> float | None:
        vals = [getattr(r, key) for r in self.runs if getattr(r, key) is not None]
        return statistics.stdev(vals) if len(vals) > 1 else None


def _load_hydra(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """The run's composed config (values that resolve without Hydra) and its override list."""
    cfg_path, ovr_path = run_dir / ".hydra" / "config.yaml", run_dir / ".hydra" / "overrides.yaml"
    cfg: dict[str, Any] = {}
    overrides: list[str] = []
    if cfg_path.exists() or ovr_path.exists():
        from omegaconf import OmegaConf

        if cfg_path.exists():
            raw = OmegaConf.load(cfg_path)
            for key in ("seed", "policy", "compression"):
                try:  # ${hydra:...} elsewhere cannot resolve outside Hydra; these keys do
                    node = OmegaConf.select(raw, key)
                    cfg[key] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
                except Exception:  # an unresolvable value only loses that column
                    cfg[key] = None
        if ovr_path.exists():
            overrides = [str(o) for o in OmegaConf.load(ovr_path)]
    return cfg, overrides


def _policy_bound(policy: Any) -> float | None:
    """The level a sweep varies: base bound (eb or classes' base) or closed-loop target, x scale."""
    fwd = policy.get("forward") if isinstance(policy, dict) else None
    if not isinstance(fwd, dict):
        return None
    if isinstance(fwd.get("control"), dict):
        level = fwd["control"].get("target")
    elif fwd.get("eb") is not None:
        level = fwd["eb"]
    else:
        level = (fwd.get("bounds") or {}).get("base", 0.03)
    try:
        return float(level) * float(fwd.get("scale", 1.0) or 1.0)
    except (TypeError, ValueError):
        return None


def _number(metrics: dict[str, Any], key: str, path: Path) -> float | None:
    v = metrics.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{path}: key {key!r} must be a number, got {v!r}")
    return float(v)


def read_run(path: Path, sweep_dir: Path) -> Run:
    """One run from its metrics.json (and .hydra/); a ValueError names the file and the key."""
    try:
        metrics = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(metrics).__name__}")
    for key in REQUIRED:
        if key not in metrics or (key != "auc" and metrics[key] is None):
            raise ValueError(f"{path}: missing key {key!r}")
    run_dir = path.parent
    cfg, overrides = _load_hydra(run_dir)
    policy_cfg = cfg.get("policy")
    compression_cfg: dict[str, Any] = c if isinstance(c := cfg.get("compression"), dict) else {}
    policy = metrics.get("policy") or (policy_cfg.get("name") if isinstance(policy_cfg, dict) else None)
    bound = _number(metrics, "policy_forward_bound", path)
    if bound is None:
        bound = _policy_bound(policy_cfg)
    codec = metrics.get("compression") or compression_cfg.get("name") or "?"
    fwd_codec = (compression_cfg.get("forward") or {}).get("codec") if compression_cfg else None
    if fwd_codec and fwd_codec != codec:
        codec = f"{codec} ({fwd_codec})"
    if compression_cfg.get("kind") == "qcomm" or fwd_codec in UNBOUNDED:
        bound, policy = None, None  # fixed-rate codecs ignore the policy
    seed = metrics.get("seed", cfg.get("seed"))
    rel = str(run_dir.relative_to(sweep_dir)) if run_dir != sweep_dir else "."
    kept = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith(("seed", "hydra."))]
    group = ",".join(sorted(kept)) if overrides else f"{policy}|{bound}|{codec}"
    auc, forward_ratio = _number(metrics, "auc", path), _number(metrics, "forward_ratio", path)
    assert forward_ratio is not None  # REQUIRED, checked above
    return Run(
        config=rel,
        group=group or "(defaults)",
        overrides=tuple(sorted(kept)),
        policy=policy or "-",
        bound=None if bound is None else float(bound),
        codec=str(codec),
        seed=None if seed is None else int(seed),
        auc=auc,
        logloss=_number(metrics, "logloss", path),
        forward_ratio=forward_ratio,
        backward_ratio=_number(metrics, "backward_ratio", path),
        samples_per_s=_number(metrics, "samples_per_s", path),
    )


def collect(sweep_dir: Path) -> tuple[list[Run], list[str]]:
    """Every readable run under ``sweep_dir``, and one line per run that could not be read."""
    runs, problems = [], []
    for path in sorted(sweep_dir.rglob("metrics.json")):
        try:
            runs.append(read_run(path, sweep_dir))
        except (ValueError, OSError) as e:
            problems.append(str(e))
    for hydra_dir in sorted(sweep_dir.rglob(".hydra")):
        if not (hydra_dir.parent / "metrics.json").exists():
            problems.append(f"{hydra_dir.parent}: no metrics.json (the run failed or is still running)")
    return runs, problems


def group_runs(runs: Iterable[Run]) -> list[Point]:
    """Seed repeats together, in the order of first appearance; overrides that every run shares
    are left out of the configuration labels (they tell the configurations nothing apart)."""
    runs = list(runs)
    shared = set.intersection(*(set(r.overrides) for r in runs)) if len(runs) > 1 else set()
    points: dict[str, Point] = {}
    for r in runs:
        label = ",".join(o for o in r.overrides if o not in shared) or r.group
        points.setdefault(label, Point(label)).runs.append(r)
    return list(points.values())


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: higher-or-equal in both x and y, higher in one."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def auc_front(points: Sequence[Point]) -> list[int]:
    """Indices of the Pareto front of forward ratio against mean AUC, over points whose AUC is defined."""
    defined = [i for i, p in enumerate(points) if p.mean("auc") is not None]
    front = pareto_front([(points[i].mean("forward_ratio"), points[i].mean("auc") or 0.0) for i in defined])
    return [defined[j] for j in front]


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _pm(mean: float | None, std: float | None, spec: str) -> str:
    return _fmt(mean, spec) + ("" if std is None else f" ± {format(std, spec)}")


def markdown(runs: Sequence[Run], points: Sequence[Point], front: set[int], problems: Sequence[str], title: str) -> str:
    """The summary as markdown: one row per run, then per configuration over seeds (Pareto marked)."""
    lines = [
        f"# {title}",
        "",
        f"{len(runs)} runs, {len(points)} configurations. Pareto front "
        "(highest AUC for its forward ratio, over configuration means) marked ★.",
        "",
        "| config | policy | bound | codec | seed | AUC | logloss | fwd ratio | bwd ratio | samples/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(runs, key=lambda r: (r.group, r.seed if r.seed is not None else -1)):
        lines.append(
            f"| {r.config} | {r.policy} | {_fmt(r.bound, '.4g')} | {r.codec} | {_fmt(r.seed, 'd')} | "
            f"{_fmt(r.auc, '.4f')} | {_fmt(r.logloss, '.4f')} | {r.forward_ratio:.2f} | "
            f"{_fmt(r.backward_ratio, '.2f')} | {_fmt(r.samples_per_s, '.0f')} |"
        )
    lines += [
        "",
        "## Per configuration (mean ± standard deviation over seeds)",
        "",
        "| | configuration | policy | bound | codec | n | AUC | logloss | fwd ratio | bwd ratio | samples/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = sorted(range(len(points)), key=lambda i: -(points[i].mean("forward_ratio") or 0))
    for i in order:
        p, r0 = points[i], points[i].runs[0]
        lines.append(
            f"| {'★' if i in front else ''} | {p.group} | {r0.policy} | {_fmt(r0.bound, '.4g')} | "
            f"{r0.codec} | {len(p.runs)} | {_pm(p.mean('auc'), p.std('auc'), '.4f')} | "
            f"{_pm(p.mean('logloss'), p.std('logloss'), '.4f')} | "
            f"{_pm(p.mean('forward_ratio'), p.std('forward_ratio'), '.2f')} | "
            f"{_pm(p.mean('backward_ratio'), p.std('backward_ratio'), '.2f')} | "
            f"{_fmt(p.mean('samples_per_s'), '.0f')} |"
        )
    if problems:
        lines += ["", "## Runs not included", ""] + [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


def plot(points: Sequence[Point], front: Sequence[int], path: Path, title: str) -> None:
    """AUC against forward ratio (log x), error bars = std over seeds, the Pareto front as a line."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    policies = sorted({p.runs[0].policy for p in points})
    colours = {pol: plt.get_cmap("tab10")(k % 10) for k, pol in enumerate(policies)}
    auc = {i: a for i, p in enumerate(points) if (a := p.mean("auc")) is not None}  # undefined: not plotted
    for pol in policies:
        mine = [i for i in auc if points[i].runs[0].policy == pol]
        ax.errorbar(
            [points[i].mean("forward_ratio") for i in mine],
            [auc[i] for i in mine],
            xerr=[points[i].std("forward_ratio") or 0 for i in mine],
            yerr=[points[i].std("auc") or 0 for i in mine],
            fmt="o",
            color=colours[pol],
            label=pol if pol != "-" else "fixed-rate codec",
            capsize=3,
            alpha=0.85,
        )
    for i, y in auc.items():
        p = points[i]
        label = p.runs[0].codec if p.runs[0].bound is None else f"{p.runs[0].bound:.3g}"
        ax.annotate(label, (p.mean("forward_ratio"), y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    best = sorted((points[i].mean("forward_ratio"), auc[i]) for i in front)
    if best:
        ax.plot([x for x, _ in best], [y for _, y in best], "k--", lw=1, label="Pareto front")
        ax.scatter([x for x, _ in best], [y for _, y in best], s=140, facecolors="none", edgecolors="k")
    ax.set_xscale("log")
    ax.set_xlabel("forward compression ratio (raw / wire bytes)")
    ax.set_ylabel("test AUC")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(sweep_dir: Path, out: Path | None = None, title: str | None = None) -> tuple[Path, Path]:
    """Write ``<out>.md`` and ``<out>.png`` for the runs under ``sweep_dir``; returns both paths."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory {sweep_dir} does not exist")
    runs, problems = collect(sweep_dir)
    if not runs:
        raise ValueError(f"{sweep_dir}: no readable metrics.json" + "".join(f"\n  {p}" for p in problems))
    points = group_runs(runs)
    front = auc_front(points)
    out = Path(out) if out is not None else sweep_dir / "summary"
    title = title or f"AUC vs forward compression ratio: {sweep_dir.name}"
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(runs, points, set(front), problems, title), encoding="utf-8")
    plot(points, front, png, title)
    return md, png


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweep_dir", type=Path, help="directory holding the runs' metrics.json files (any depth)")
    p.add_argument("--out", type=Path, default=None, help="output prefix (default SWEEP_DIR/summary)")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    try:
        md, png = summarize(a.sweep_dir, a.out, a.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(md.read_text(encoding="utf-8"))
    print(f"table: {md}\nplot:  {png}")
    return 0


class SweepSummary(Callback):
    """Hydra callback (configs/config.yaml ``hydra.callbacks``): the sweep's summary, kept current.

    Rewritten after every job, so a sweep with a failed job (which ends Hydra's multirun before
    ``on_multirun_end``) or one still running on a cluster has its table and plot of the runs so
    far. Only the job's rank 0 writes (a submitit job runs the callback in every task).
    """

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN and task_rank() == "0":
            self._write(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write(Path(config.hydra.sweep.dir))

    @staticmethod
    def _write(sweep_dir: Path) -> None:
        try:
            md, png = summarize(sweep_dir)
        except (FileNotFoundError, ValueError) as e:  # no finished run yet
            print(f"sweep summary: {e}", file=sys.stderr)
            return
        print(f"sweep summary: {md} and {png}", file=sys.stderr)
