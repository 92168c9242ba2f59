"""Converged accuracy: every configuration trained to the same early-stopping rule, a few seeds each.

    python -m dlrm.bench.accuracy --out DIR [--data synthetic|sample] [--configs none,lossy,...]
        [--seeds 0,1,2] [--lrs 0.01,0.02,0.05 | --lr LR] [--ranks 2] [--max-runs N] [--report-only]
        [-- overrides]

First a learning-rate sweep of ``none`` (seed 0, each lr set on the tables and the MLPs alike; the
lr with the best validation AUC wins, written to ``DIR/lr.json``), then each configuration x seed at
that lr, every run a ``torchrun`` subprocess of ``--ranks`` ranks (2 by default) stopped by
``early_stopping`` and tested on its best validation step's weights. Runs live in
``DIR/runs/<config>/lr<lr>/seed<s>/``; one whose metrics.json exists is skipped and an interrupted
one resumes from its checkpoints, so the same command completes a partial benchmark. Then the report
(:func:`report`): ``DIR/report.md``, ``DIR/report.json``, ``DIR/auc_vs_bytes.png`` and TensorBoard
(``DIR/tensorboard``: per configuration its AUC at a step of its bytes per iteration, and HPARAMS),
and the sweep summary's per-run table (``DIR/summary.md``, :mod:`dlrm.telemetry.sweep_summary`).
Each configuration is compared with ``none`` seed by seed (its AUC minus ``none``'s at the same
seed: runs are deterministic, so this isolates the configuration), and one with an adaptive bound
gets its first seed's bound per table beside validation AUC (``DIR/bounds_<config>.png``, and the
TensorBoard run ``<config>_bounds``). The configurations (:mod:`dlrm.bench.accuracy_configs`)
include the diagnostics of where ``lossy``'s AUC goes and the mechanisms tried against it.
Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dlrm.bench.accuracy_configs import COMMON, CONFIGS, DATA, DEFAULT_CONFIGS
from dlrm.performance.network import ring_allreduce_bytes
from dlrm.telemetry.sweep_summary import summarize

REPO = Path(__file__).resolve().parents[2]
# metrics.json keys of a policy whose bounds follow training (the plateau's final levels)
ADAPTIVE = ("policy_forward_level", "policy_backward_level")
# metrics.json's wire paths (allreduce: the data-parallel tables') and the MLPs' all-reduce (dense)
PATHS = ("forward", "backward", "dense", "allreduce", "input", "replica_sync")


def run_dir(out: Path, config: str, lr: float, seed: int) -> Path:
    return out / "runs" / config / f"lr{lr:g}" / f"seed{seed}"


def overrides(data: str, rows: int | None, config: str, lr: float, seed: int, extra: Sequence[str]) -> list[str]:
    """The run's Hydra overrides: data, the shared stopping rule, the configuration, lr and seed, then ``extra``."""
    size = [f"data.rows.train={rows}"] if rows and data == "synthetic" else []
    lrs = [f"optimizer.sparse.lr={lr:g}", f"optimizer.dense.lr={lr:g}"]
    merged: dict[str, str] = {}  # one value per key, the last given winning (Hydra refuses a key twice)
    for o in [*DATA[data], *size, *COMMON, *CONFIGS[config], *lrs, f"seed={seed}", *extra]:
        merged.pop(o.split("=", 1)[0], None)
        merged[o.split("=", 1)[0]] = o
    return list(merged.values())


def train(directory: Path, args: Sequence[str], timeout: float, ranks: int = 2) -> float:
    """One run with torchrun on ``ranks`` local processes, skipped when its metrics.json exists;
    returns its wall seconds."""
    if (directory / "metrics.json").exists():
        return 0.0
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd += ["-m", "dlrm.train"]
    cmd += [*args, f"hydra.run.dir={directory}"]
    (directory / "command.txt").write_text(" ".join(cmd) + "\n")
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    t0 = time.monotonic()
    with open(directory / "driver.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        tail = "\n".join((directory / "driver.log").read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{directory} failed (exit {rc}); last lines of driver.log:\n{tail}")
    shutil.rmtree(directory / "checkpoints", ignore_errors=True)  # hundreds of MB a run; the metrics stay
    return time.monotonic() - t0


def read_metrics(directory: Path) -> dict[str, Any]:
    path = directory / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    for key in ("auc", "iterations", "forward_ratio", "backward_ratio"):
        if key not in metrics:
            raise ValueError(f"{path}: missing key {key!r}")
    return metrics


def dense_params(cfg: Mapping[str, Any]) -> int:
    """Weights and biases of DLRM's MLPs (the all-reduced gradient): bottom 13 -> sizes, top from
    the dot interaction's dim + F(F-1)/2 (F = 26 tables + the dense vector) through its sizes."""
    model, dim, features = cfg["model"], int(cfg["model"]["embedding_dim"]), 27
    n, width = 0, 13
    for layer in (*model["dense_arch_layer_sizes"], None, *model["over_arch_layer_sizes"]):
        if layer is None:  # the interaction between the two MLPs
            width = dim + features * (features - 1) // 2
            continue
        n, width = n + width * layer + layer, layer
    return n


def bytes_by_path(metrics: Mapping[str, Any], baseline: Mapping[str, Any], dense_numel: int) -> dict[str, float]:
    """Bytes on the wire per iteration (all ranks) by path. Measured where the run metered them;
    TorchRec's QComms count none, so theirs are ``none``'s bytes over their fixed ratios; the MLP
    all-reduce (not metered) is the ring all-reduce's bytes over the run's measured dense ratio."""
    ws = int(metrics.get("world_size", 2))
    measured, raw = metrics.get("wire_bytes_by_path"), baseline.get("wire_bytes_by_path") or {}
    out = {}
    for path in ("forward", "backward"):
        if measured:
            out[path] = float(measured[path])
        else:
            out[path] = float(raw.get(path, math.nan)) / float(metrics[f"{path}_ratio"])
    out["dense"] = ws * ring_allreduce_bytes(dense_numel, ws) / float(metrics.get("dense_ratio") or 1.0)
    for path in ("allreduce", "input"):  # QComms leave both as they are
        out[path] = float((measured or raw).get(path, math.nan))
    out["replica_sync"] = float((measured or {}).get("replica_sync", 0.0))
    return out


def _config(directory: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    raw = OmegaConf.load(directory / ".hydra" / "config.yaml")
    return {"model": OmegaConf.to_container(raw.model, resolve=True)}


def report(out: Path, configs: Sequence[str], seeds: Sequence[int], lr: float, note: str = "") -> dict[str, Any]:
    """Build report.md / report.json / auc_vs_bytes.png / tensorboard from the runs' metrics.json."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for c in configs:
        for s in seeds:
            d = run_dir(out, c, lr, s)
            if (d / "metrics.json").exists():
                runs.setdefault(c, []).append({"seed": s, "dir": d, **read_metrics(d)})
    if "none" not in runs:
        raise ValueError(f"{out}: no finished `none` run at lr {lr:g}: the baseline every row is compared with")
    numel = dense_params(_config(runs["none"][0]["dir"]))
    none_auc = [r["auc"] for r in runs["none"]]
    none_by_seed = {r["seed"]: r["auc"] for r in runs["none"]}
    rows: list[dict[str, Any]] = []
    for c, rs in runs.items():
        aucs = [r["auc"] for r in rs]
        paired = [r["auc"] - none_by_seed[r["seed"]] for r in rs if r["seed"] in none_by_seed]
        paths = {p: statistics.fmean(bytes_by_path(r, runs["none"][0], numel)[p] for r in rs) for p in PATHS}
        rows.append(
            {
                "config": c,
                "overrides": list(CONFIGS[c]),
                "seeds": [r["seed"] for r in rs],
                "auc": aucs,
                "auc_mean": statistics.fmean(aucs),
                "auc_std": statistics.stdev(aucs) if len(aucs) > 1 else None,
                "within_none_spread": _within(statistics.fmean(aucs), none_auc),
                "delta_vs_none_same_seed": paired,  # this config's AUC minus `none`'s, seed by seed
                "run_dirs": [str(r["dir"]) for r in rs],
                "adaptive": any(k in rs[0] for k in ADAPTIVE),
                "iterations": [r["iterations"] for r in rs],
                "best_iteration": [r.get("best_iteration") for r in rs],
                "stopped": [r.get("stopped_iteration") is not None for r in rs],
                "bytes_by_path": paths,
                "bytes_per_iteration": sum(paths.values()),
            }
        )
    total = {r["config"]: r["bytes_per_iteration"] for r in rows}
    # QComms MX4 is fixed-rate: without its run, its bytes still follow from `none`'s and its ratios
    mx4 = total.get("qcomm_mx4") or sum(
        bytes_by_path(
            {**qcomm_mx4_ratios(), "world_size": runs["none"][0].get("world_size", 2)}, runs["none"][0], numel
        ).values()
    )
    for r in rows:
        r["ratio_vs_none"] = total["none"] / r["bytes_per_iteration"]
        r["ratio_vs_qcomm_mx4"] = mx4 / r["bytes_per_iteration"]
    missing = [
        f"{c} seed {s}" for c in configs for s in seeds if not (run_dir(out, c, lr, s) / "metrics.json").exists()
    ]
    result: dict[str, Any] = {
        "qcomm_mx4_bytes_per_iteration": mx4,
        "qcomm_mx4_measured": "qcomm_mx4" in total,
        "lr": lr,
        "dense_params": numel,
        "rows": rows,
        "missing": missing,
        "note": note,
    }
    (out / "report.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(result))
    plot(rows, out / "auc_vs_bytes.png")
    for r in rows:
        if r["adaptive"]:
            plot_bounds(r["config"], bound_scalars(Path(r["run_dirs"][0])), out / f"bounds_{r['config']}.png")
    tensorboard(rows, out / "tensorboard", lr)
    summarize(out / "runs", out / "summary", title="Converged runs: AUC vs forward ratio")
    return result


def qcomm_mx4_ratios() -> dict[str, float]:
    """forward_ratio/backward_ratio of configs/compression/qcomm_mx4.yaml, as its runs report them."""
    from omegaconf import OmegaConf

    from dlrm.embedding_comm.config import parse_compression_cfg
    from dlrm.embedding_comm.sharders import qcomm_ratios

    cfg = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "compression" / "qcomm_mx4.yaml"))
    assert isinstance(cfg, dict)
    return qcomm_ratios(parse_compression_cfg({str(k): v for k, v in cfg.items()}))


def _within(mean: float, reference: Sequence[float]) -> str:
    """Where a mean AUC sits against the spread (min-max over seeds) of ``none``'s."""
    lo, hi = min(reference), max(reference)
    return "yes" if lo <= mean <= hi else ("above" if mean > hi else "below")


def _paired(deltas: Sequence[float]) -> str:
    if not deltas:
        return "-"
    return f"{statistics.fmean(deltas):+.4f} ({min(deltas):+.4f}..{max(deltas):+.4f})"


def _mb(v: float) -> str:
    return "-" if math.isnan(v) else f"{v / 1e6:.3g}"


def markdown(result: Mapping[str, Any]) -> str:
    lines = [
        f"Learning rate {result['lr']:g} (tables and MLPs); test AUC on each run's best validation step; "
        "bytes on the wire per iteration, all ranks, MB.",
        "",
        "| config | seeds | test AUC mean ± std (min-max) | within `none`'s seed spread | minus `none`, same seed: "
        "mean (min..max) | iterations to stop (best) | fwd / bwd / dense / DP tables / input / sync MB | "
        "total MB/iter | vs none | vs qcomm_mx4 |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        std = "" if r["auc_std"] is None else f" ± {r['auc_std']:.4f}"
        spread = f" ({min(r['auc']):.4f}-{max(r['auc']):.4f})" if len(r["auc"]) > 1 else ""
        its = ", ".join(f"{i} ({b})" for i, b in zip(r["iterations"], r["best_iteration"], strict=True))
        mx4 = f"{r['ratio_vs_qcomm_mx4']:.2f}x"
        paths = " / ".join(_mb(r["bytes_by_path"][p]) for p in PATHS)
        lines.append(
            f"| {r['config']} | {len(r['seeds'])} | {r['auc_mean']:.4f}{std}{spread} | {r['within_none_spread']} | "
            f"{_paired(r['delta_vs_none_same_seed'])} | {its} | {paths} | {_mb(r['bytes_per_iteration'])} | "
            f"{r['ratio_vs_none']:.2f}x | {mx4} |"
        )
    if not result["qcomm_mx4_measured"]:
        lines += [
            "",
            f"qcomm_mx4 (no run here): {result['qcomm_mx4_bytes_per_iteration'] / 1e6:.3g} MB per iteration, "
            "`none`'s all-to-all bytes over MX4's fixed ratios (what its runs report), the rest as `none`.",
        ]
    if result["missing"]:
        lines += ["", f"Missing (partial): {', '.join(result['missing'])}."]
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Test AUC (mean, std bars) against bytes per iteration (log x), one labelled point per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        x = r["bytes_per_iteration"] / 1e6
        ax.errorbar([x], [r["auc_mean"]], yerr=[r["auc_std"] or 0], fmt="o", capsize=3)
        ax.annotate(r["config"], (x, r["auc_mean"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("MB on the wire per iteration (all ranks)")
    ax.set_ylabel("test AUC at the best validation step")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bound_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """A run's validation AUC and per-table bounds over its iterations, from its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    tags = [t for t in acc.Tags()["scalars"] if t == "eval/auc" or t.split("/")[2:3] == ["eb"]]
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}


def plot_bounds(config: str, scalars: Mapping[str, Sequence[tuple[int, float]]], path: Path) -> None:
    """Validation AUC above, each table's bound per direction below, over the iterations (one run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds = {t: v for t, v in scalars.items() if t != "eval/auc"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for ax, series in ((top, {"eval/auc": scalars.get("eval/auc", [])}), (bottom, bounds)):
        for tag, points in series.items():
            style = "--" if "/backward/" in tag else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, linewidth=1)
    top.set_ylabel("validation AUC")
    bottom.set_ylabel("bound per table\n(forward solid, backward dashed)")
    bottom.set_yscale("log")
    bottom.set_xlabel("iteration")
    top.set_title(f"{config}: the bound of every table beside validation AUC (first seed)")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tensorboard(rows: Sequence[Mapping[str, Any]], log_dir: Path, lr: float) -> None:
    """Per configuration: ``accuracy/test_auc`` at step = KB per iteration (the scalars plot AUC
    against bytes), and its hparams beside AUC and bytes (HPARAMS), as the sweep summary's runs.
    A configuration with an adaptive bound also gets its first seed's validation AUC and bound per
    table over the iterations (run ``<config>_bounds``, the custom-scalars layout of a training run)."""
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.telemetry.tb_layout import add_layout

    shutil.rmtree(log_dir, ignore_errors=True)
    for r in rows:
        if r.get("adaptive"):
            with SummaryWriter(str(log_dir / (r["config"].replace("+", "_") + "_bounds"))) as w:
                add_layout(w)
                for tag, points in bound_scalars(Path(r["run_dirs"][0])).items():
                    for step, value in points:
                        w.add_scalar(tag, value, step)
        with SummaryWriter(str(log_dir / r["config"].replace("+", "_"))) as w:
            step = round(r["bytes_per_iteration"] / 1e3)
            w.add_scalar("accuracy/test_auc", r["auc_mean"], step)
            w.add_hparams(
                {"config": r["config"], "lr": lr, "seeds": len(r["seeds"])},
                {
                    "hparam/auc": r["auc_mean"],
                    "hparam/auc_std": r["auc_std"] or 0.0,
                    "hparam/bytes_per_iteration": r["bytes_per_iteration"],
                    "hparam/ratio_vs_none": r["ratio_vs_none"],
                },
                run_name=".",
            )


def choose_lr(out: Path, lrs: Sequence[float]) -> float:
    """The swept lr with the best validation AUC of ``none`` (seed 0), written to lr.json."""
    best: dict[float, float | None] = {lr: read_metrics(run_dir(out, "none", lr, 0)).get("best_val_auc") for lr in lrs}
    lr = max(lrs, key=lambda v: -1.0 if best[v] is None else float(best[v] or 0.0))
    (out / "lr.json").write_text(json.dumps({"lr": lr, "best_val_auc": {f"{k:g}": v for k, v in best.items()}}) + "\n")
    return lr


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", choices=sorted(DATA), default="synthetic")
    p.add_argument("--rows", type=int, default=1_000_000, help="synthetic training rows")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lrs", default="0.0025,0.005,0.01", help="lrs of the `none` sweep")
    p.add_argument("--lr", type=float, default=None, help="skip the sweep and train at this lr")
    p.add_argument("--ranks", type=int, default=2, help="processes per run (one host)")
    p.add_argument("--max-runs", type=int, default=None, help="train at most this many new runs, then report")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--note", default="", help="a line for the report (e.g. what is still missing and why)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    a = p.parse_args(argv)
    configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    if a.ranks < 1:
        p.error(f"--ranks must be >= 1, got {a.ranks}")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    a.out.mkdir(parents=True, exist_ok=True)
    budget = a.max_runs if a.max_runs is not None else math.inf
    lrs = [a.lr] if a.lr is not None else _floats(a.lrs)

    def run(config: str, lr: float, seed: int) -> None:
        nonlocal budget
        d = run_dir(a.out, config, lr, seed)
        if (d / "metrics.json").exists():
            ranks = read_metrics(d).get("world_size", 2)
            if ranks != a.ranks and not a.report_only:  # its runs would mix world sizes in one report
                p.error(f"--ranks {a.ranks}: {d} ran on {ranks} ranks; give this benchmark its own --out")
            return
        if a.report_only or budget <= 0:
            return
        budget -= 1
        wall = train(d, overrides(a.data, a.rows, config, lr, seed, a.overrides), a.timeout, a.ranks)
        m = read_metrics(d)
        print(f"{config} lr {lr:g} seed {seed}: test AUC {m['auc']}, {m['iterations']} iterations, {wall:.0f} s")

    for lr in lrs:
        run("none", lr, 0)
    if any(not (run_dir(a.out, "none", lr, 0) / "metrics.json").exists() for lr in lrs):
        print("the learning-rate sweep is not finished; run the same command again", file=sys.stderr)
        return 1
    lr = choose_lr(a.out, lrs)
    for config in configs:  # in the order given: the first configurations get all their seeds first
        for seed in seeds:
            run(config, lr, seed)
    result = report(a.out, configs, seeds, lr, a.note)
    print((a.out / "report.md").read_text())
    print(f"report: {a.out / 'report.md'}, {a.out / 'report.json'}; plot: {a.out / 'auc_vs_bytes.png'}")
    return 0 if not result["missing"] else 2


if __name__ == "__main__":
    sys.exit(main())
