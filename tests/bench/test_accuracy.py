"""The converged-accuracy driver on the bundled sample: 2 configurations x 1 seed, a few iterations
each; the report must be what the runs' own metrics.json say."""

from __future__ import annotations

import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainer_runs import SMALL

from dlrm.bench import accuracy, published_setup


def test_dense_params_of_the_terabyte_mlps():
    model = {"embedding_dim": 64, "dense_arch_layer_sizes": [512, 256, 64], "over_arch_layer_sizes": [512, 512, 256, 1]}
    assert accuracy.dense_params({"model": model}) == published_setup.PUBLISHED_DENSE_PARAMS == 762_177


def test_a_key_given_twice_keeps_the_last_value():
    got = accuracy.overrides("sample", None, "lossy", 0.02, 1, ["eval_every=2", "compression=none"])
    assert "eval_every=2" in got and "eval_every=10" not in got
    assert "compression=none" in got and "compression=lossy" not in got and "seed=1" in got


def test_driver_trains_skips_finished_runs_and_reports_from_their_metrics(tmp_path):
    out = tmp_path / "bench"
    argv = ["--out", str(out), "--data", "sample", "--configs", "none,lossy", "--seeds", "0", "--lrs", "0.02,0.05"]
    extra = ["--", *SMALL, f"data.cache_dir={tmp_path / 'cache'}", "max_iterations=4", "eval_every=2"]
    assert accuracy.main([*argv, *extra]) == 0
    runs = {c: accuracy.run_dir(out, c, json.loads((out / "lr.json").read_text())["lr"], 0) for c in ("none", "lossy")}
    metrics = {c: json.loads((d / "metrics.json").read_text()) for c, d in runs.items()}
    sweep = {lr: json.loads((accuracy.run_dir(out, "none", lr, 0) / "metrics.json").read_text()) for lr in (0.02, 0.05)}
    assert json.loads((out / "lr.json").read_text())["lr"] == max(sweep, key=lambda lr: sweep[lr]["best_val_auc"])
    assert all(m["tested_on"] == "best" and m["iterations"] <= 4 for m in metrics.values())
    report = {r["config"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    for c, m in metrics.items():
        assert report[c]["auc"] == [m["auc"]] and report[c]["iterations"] == [m["iterations"]]
        for path in ("forward", "backward", "input"):
            assert report[c]["bytes_by_path"][path] == pytest.approx(m["wire_bytes_by_path"][path])
    # the MLP all-reduce is not metered: the same ring bytes for both (dense_ratio 1), the rest measured
    dense = {c: r["bytes_by_path"]["dense"] for c, r in report.items()}
    assert dense["none"] == dense["lossy"] > 0
    total = {c: sum(m["wire_bytes_by_path"].values()) + dense[c] for c, m in metrics.items()}
    assert report["lossy"]["ratio_vs_none"] == pytest.approx(total["none"] / total["lossy"])
    assert report["lossy"]["ratio_vs_none"] > 1.5 and report["none"]["within_none_spread"] == "yes"
    md = (out / "report.md").read_text()
    assert f"| lossy | 1 | {metrics['lossy']['auc']:.4f} |" in md
    events = EventAccumulator(str(out / "tensorboard" / "lossy")).Reload().Scalars("accuracy/test_auc")
    assert [e.value for e in events] == [pytest.approx(metrics["lossy"]["auc"])]
    assert [e.step for e in events] == [round(total["lossy"] / 1e3)]  # AUC at a step of its KB per iteration
    assert (out / "auc_vs_bytes.png").stat().st_size > 0 and (out / "summary.md").exists()
    # finished runs are skipped: a second call trains nothing and rebuilds the same report
    stamp = {c: (d / "metrics.json").stat().st_mtime_ns for c, d in runs.items()}
    assert accuracy.main([*argv, *extra]) == 0
    assert stamp == {c: (d / "metrics.json").stat().st_mtime_ns for c, d in runs.items()}
    assert not math.isnan(report["none"]["bytes_per_iteration"])


@pytest.mark.scale
def test_ranks_sets_the_processes_of_every_run(tmp_path):
    out = tmp_path / "bench"
    argv = ["--out", str(out), "--data", "sample", "--configs", "none", "--seeds", "0", "--lr", "0.02", "--ranks", "3"]
    assert accuracy.main([*argv, "--", *SMALL, f"data.cache_dir={tmp_path / 'cache'}", "max_iterations=2"]) == 0
    metrics = json.loads((accuracy.run_dir(out, "none", 0.02, 0) / "metrics.json").read_text())
    assert metrics["world_size"] == 3
    (row,) = json.loads((out / "report.json").read_text())["rows"]
    assert row["auc"] == [metrics["auc"]]
    assert row["bytes_by_path"]["forward"] == metrics["wire_bytes_by_path"]["forward"]
    # the same --out at another world size would mix them in one report: refused, nothing trained
    with pytest.raises(SystemExit):
        accuracy.main([*argv[:-1], "2", "--", *SMALL, f"data.cache_dir={tmp_path / 'cache'}"])


def _fake_run(out, config: str, seed: int, auc: float, level: float | None = None) -> None:
    """A finished run as the driver leaves it: metrics.json, the resolved config, TensorBoard."""
    from torch.utils.tensorboard import SummaryWriter

    d = accuracy.run_dir(out, config, 0.005, seed)
    (d / ".hydra").mkdir(parents=True)
    model = {"embedding_dim": 4, "dense_arch_layer_sizes": [8, 4], "over_arch_layer_sizes": [8, 1]}
    (d / ".hydra" / "config.yaml").write_text(json.dumps({"model": model}))
    metrics = {"auc": auc, "iterations": 90, "forward_ratio": 1.0, "backward_ratio": 1.0, "world_size": 2}
    metrics["wire_bytes_by_path"] = dict.fromkeys(("forward", "backward", "allreduce", "input"), 1000.0)
    if level is not None:
        metrics["policy_forward_level"] = level
    (d / "metrics.json").write_text(json.dumps(metrics))
    with SummaryWriter(str(d / "tensorboard")) as w:
        for it in (30, 60, 90):
            w.add_scalar("eval/auc", auc - 0.01 / it, it)
            w.add_scalar("comm/forward/eb/cat_0", 0.02 * it / (30 + seed), it)  # this run's own bounds
            w.add_scalar("train/loss", 0.5, it)


def test_report_compares_seed_by_seed_and_shows_an_adaptive_bound_beside_validation_auc(tmp_path):
    out = tmp_path / "bench"
    aucs = {"none": [0.80, 0.81], "lossy+plateau": [0.7996, 0.8110]}
    for config, values in aucs.items():
        for seed, auc in enumerate(values):
            _fake_run(out, config, seed, auc, level=0.25 if config != "none" else None)
    result = accuracy.report(out, list(aucs), [0, 1], 0.005)
    rows = {r["config"]: r for r in result["rows"]}
    assert rows["lossy+plateau"]["delta_vs_none_same_seed"] == pytest.approx([-0.0004, 0.001])
    assert "| +0.0003 (-0.0004..+0.0010) |" in (out / "report.md").read_text()
    assert rows["lossy+plateau"]["adaptive"] and not rows["none"]["adaptive"]
    runs = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert runs == ["lossy_plateau", "lossy_plateau_bounds", "none"]
    events = EventAccumulator(str(out / "tensorboard" / "lossy_plateau_bounds")).Reload()
    assert set(events.Tags()["scalars"]) == {"eval/auc", "comm/forward/eb/cat_0"}  # the first seed's
    bound = [(e.step, e.value) for e in events.Scalars("comm/forward/eb/cat_0")]
    assert bound == [(it, pytest.approx(0.02 * it / 30)) for it in (30, 60, 90)]
    assert (out / "bounds_lossy+plateau.png").stat().st_size > 0 and not (out / "bounds_none.png").exists()
