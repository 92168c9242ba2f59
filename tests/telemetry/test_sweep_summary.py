"""The sweep summary (markdown table, Pareto front, PNG) on real run directories, and the
TensorBoard custom-scalars layout read back from real event files."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import yaml

from dlrm.telemetry import sweep_summary as summary


def write_run(
    root: Path,
    name: str,
    *,
    auc: float | None,
    fwd: float,
    seed: int = 0,
    policy: str = "dual",
    scale: float = 1.0,
    codec: str = "lossy",
    extra: dict | None = None,
    metrics_text: str | None = None,
) -> Path:
    """A run directory as the trainer leaves it: metrics.json beside Hydra's .hydra/ files."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    forward = (
        {"kind": "fixed", "eb": 0.02, "scale": scale}
        if policy == "fixed"
        else {
            "kind": "dual",
            "classes": {"source": "auto"},
            "bounds": {"tight": 0.01, "base": 0.03, "loose": 0.05},
            "schedule": {"kind": "step"},
            "scale": scale,
        }
    )
    cfg = {
        "seed": seed,
        "run_name": "${data.name}-x",
        "checkpoint": {"dir": "${hydra:runtime.output_dir}/c"},
        "compression": {
            "name": codec,
            "kind": "compressed",
            "forward": {"codec": codec, "mode": "rel"},
            "backward": {"codec": codec, "mode": "rel"},
        },
        "policy": {"name": policy, "forward": forward, "backward": {"kind": "fixed", "eb": 0.01}},
    }
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    overrides = [f"policy={policy}", f"policy.forward.scale={scale}", f"compression={codec}", f"seed={seed}"]
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    metrics = {
        "auc": auc,
        "logloss": 0.5 - (auc or 0.0) / 10,
        "accuracy": 0.78,
        "iterations": 10,
        "samples_per_s": 1000.0 + seed,
        "forward_ratio": fwd,
        "backward_ratio": fwd / 2,
        "max_abs_error_seen": 0.01,
        "config_name": "x",
        "compression": codec,
        **(extra or {}),
    }
    (run / "metrics.json").write_text(metrics_text if metrics_text is not None else json.dumps(metrics))
    return run


def make_sweep(root: Path) -> None:
    # fixed: bound 0.02 x scale; dual: base 0.03 x scale; two seeds each
    for seed, (a, b) in enumerate([(0.70, 0.72), (0.74, 0.73)]):
        write_run(root, f"{seed}-fixed-1", auc=a, fwd=4.0 + seed, seed=seed, policy="fixed", scale=1.0)
        write_run(root, f"{seed}-dual-1", auc=b, fwd=8.0 + seed, seed=seed, policy="dual", scale=1.0)
    write_run(root, "9-fixed-4", auc=0.60, fwd=6.0, policy="fixed", scale=4.0)  # dominated by dual-1
    write_run(root, "7-none", auc=0.75, fwd=1.0, policy="fixed", codec="none")  # best AUC, ratio 1


def test_table_groups_seed_repeats_marks_the_pareto_front_and_draws_the_plot(tmp_path):
    make_sweep(tmp_path)
    md_path, png_path = summary.summarize(tmp_path)
    md = md_path.read_text()
    runs = [
        line
        for line in md.splitlines()
        if line.startswith("| ") and not line.startswith("| config") and "---" not in line
    ]
    per_run = [line for line in runs if line.count("|") == 11]
    assert len(per_run) == 6
    row = next(line for line in per_run if line.startswith("| 1-dual-1 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # bound: dual base 0.03 x scale 1; seed 1; AUC 0.73; ratios 9 and 4.5; samples/s 1001
    assert cells == ["1-dual-1", "dual", "0.03", "lossy", "1", "0.7300", "0.4270", "9.00", "4.50", "1001"]
    fixed4 = next(line for line in per_run if line.startswith("| 9-fixed-4 "))
    assert "| 0.08 |" in fixed4  # fixed eb 0.02 x scale 4
    none = [c.strip() for c in next(line for line in per_run if line.startswith("| 7-none ")).strip("|").split("|")]
    assert none[2:4] == ["-", "none"]  # a fixed-rate codec has no bound, whatever the policy says
    # per configuration: dual over seeds 0/1 -> AUC mean 0.725, std of (0.72, 0.73)
    config_rows = [line for line in runs if line.count("|") == 12]
    dual = next(line for line in config_rows if "policy=dual" in line)
    std = statistics.stdev([0.72, 0.73])
    assert f"0.7250 ± {std:.4f}" in dual and "| 2 |" in dual and "8.50 ± 0.71" in dual
    # Pareto over configuration means: none (1.0, 0.75) and dual (8.5, 0.725) survive; fixed x1
    # (4.5, 0.72) is beaten by dual, fixed x4 (6, 0.60) too
    starred = {line.split("|")[2].strip() for line in config_rows if line.startswith("| ★")}
    assert starred == {
        "compression=none,policy.forward.scale=1.0,policy=fixed",
        "compression=lossy,policy.forward.scale=1.0,policy=dual",
    }
    png = png_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(png_path).shape[:2]
    assert h > 300 and w > 500


def test_bad_or_missing_runs_are_listed_with_the_reason_and_the_rest_is_kept(tmp_path):
    make_sweep(tmp_path)
    write_run(tmp_path, "broken", auc=0.7, fwd=2.0, metrics_text='{"auc": 0.7,\n "forward_ratio": }')
    write_run(tmp_path, "noauc", auc=0.7, fwd=2.0, metrics_text=json.dumps({"forward_ratio": 2.0}))
    write_run(tmp_path, "textauc", auc=0.7, fwd=2.0, metrics_text=json.dumps({"auc": "high", "forward_ratio": 2.0}))
    crashed = write_run(tmp_path, "crashed", auc=0.7, fwd=2.0)
    (crashed / "metrics.json").unlink()
    md = summary.summarize(tmp_path, tmp_path / "out" / "s")[0].read_text()
    assert (tmp_path / "out" / "s.png").exists()
    tail = md.split("## Runs not included")[1]
    assert re.search(r"broken/metrics.json: not valid JSON \(line 2", tail)
    assert "noauc/metrics.json: missing key 'auc'" in tail
    assert "textauc/metrics.json: key 'auc' must be a number, got 'high'" in tail
    assert "crashed: no metrics.json" in tail
    assert md.count("| lossy |") >= 4  # the good runs are all there


def test_a_null_auc_shows_as_a_dash_and_stays_off_the_plot_and_the_front(tmp_path):
    make_sweep(tmp_path)
    # the best ratio of the sweep, but its test split held one class: AUC undefined (null)
    write_run(tmp_path, "5-dual-8", auc=None, fwd=50.0, policy="dual", scale=8.0)
    md_path, png_path = summary.summarize(tmp_path)
    md = md_path.read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 5-dual-8 "))
    assert [c.strip() for c in row.strip("|").split("|")][5:8] == ["-", "0.5000", "50.00"]
    config = next(line for line in md.splitlines() if "policy.forward.scale=8.0" in line and line.count("|") == 12)
    assert not config.startswith("| ★") and "| 1 | - |" in config
    starred = {line.split("|")[2].strip() for line in md.splitlines() if line.startswith("| ★")}
    assert starred == {  # as without the null run, which would otherwise dominate on ratio
        "compression=none,policy.forward.scale=1.0,policy=fixed",
        "compression=lossy,policy.forward.scale=1.0,policy=dual",
    }
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_exit_codes(tmp_path, capsys):
    from dlrm.bench.summary import main  # python -m dlrm.bench.summary

    assert main([str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    assert "no readable metrics.json" in capsys.readouterr().err
    make_sweep(tmp_path / "sweep")
    assert main([str(tmp_path / "sweep")]) == 0
    assert "Pareto" in capsys.readouterr().out


def test_metrics_keys_win_over_hydra_config(tmp_path):
    write_run(tmp_path, "a", auc=0.7, fwd=3.0, extra={"policy": "closed_loop", "policy_forward_bound": 0.005})
    (run,) = summary.collect(tmp_path)[0]
    assert (run.policy, run.bound, run.seed) == ("closed_loop", 0.005, 0)


def test_pareto_front():
    pts = [(1.0, 0.8), (2.0, 0.7), (2.0, 0.6), (3.0, 0.7), (0.5, 0.8)]
    assert summary.pareto_front(pts) == [0, 3]


# --------------------------------------------------------------------------- TensorBoard layout


def test_custom_scalars_layout_reads_back_and_matches_the_comm_and_policy_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from torch.utils.tensorboard import SummaryWriter

    from dlrm.embedding_comm.policy import build_policy
    from dlrm.embedding_comm.stats import derive
    from dlrm.telemetry.tb_layout import add_layout, eb_tag, policy_scalars, ratio_tag
    from dlrm_compression.policies import TableStats

    features = ["cat_0", "cat_1", "cat_2"]
    policy = build_policy(
        {"name": "p", "forward": {"kind": "fixed", "eb": 0.01}, "backward": {"kind": "fixed", "eb": 0.002}},
        [TableStats(f, 10, 8) for f in features],
    )
    # the keys dlrm.embedding_comm.stats derives from its raw sums (the real naming, not a copy of it)
    sums = {
        "forward/raw_bytes": 800.0,
        "forward/wire_bytes": 100.0,
        "backward/raw_bytes": 800.0,
        "backward/wire_bytes": 400.0,
    }
    for f in features:
        for d in ("forward", "backward"):
            sums[f"{d}/sampled_raw_bytes/{f}"] = 100.0
            sums[f"{d}/sampled_wire_bytes/{f}"] = 10.0
    maxes = {f"{d}/max_abs_error/{f}": 0.001 for d in ("forward", "backward") for f in features}
    maxes.update({"forward/max_error_over_bound": 0.9, "backward/max_error_over_bound": 0.8})
    scalars = {
        **derive(sums, maxes),
        **policy_scalars(policy, 5, features),
        "eval/auc": 0.7,
        "test/auc": 0.71,
        "train/loss": 0.5,
    }
    assert scalars[eb_tag("backward", "cat_1")] == 0.002 and ratio_tag("forward", "cat_2") in scalars

    writer = SummaryWriter(str(tmp_path))
    add_layout(writer)
    for tag, v in scalars.items():
        writer.add_scalar(tag, v, 5)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {(cat.title, ch.title): list(ch.multiline.tag) for cat in layout.category for ch in cat.chart}
    first = layout.category[0]
    assert [c.title for c in first.chart][:2] == ["AUC", "compression ratio (raw / wire bytes)"]  # side by side
    written = set(acc.Tags()["scalars"])

    def shown(chart: tuple[str, str]) -> set[str]:
        # TensorBoard matches a chart's regexes with re.match
        return {t for t in written if any(re.match(rx, t) for rx in charts[chart])}

    assert shown(("accuracy vs compression", "AUC")) == {"eval/auc", "test/auc"}
    assert shown(("accuracy vs compression", "compression ratio (raw / wire bytes)")) == {
        "comm/forward/ratio",
        "comm/backward/ratio",
    }
    for d in ("forward", "backward"):
        # an adaptive bound per table beside the validation AUC that moves it
        assert shown(("accuracy vs compression", f"{d} bound per table (policy)")) == {eb_tag(d, f) for f in features}
        assert shown((f"{d} per table", "error bound (policy)")) == {eb_tag(d, f) for f in features}
        assert shown((f"{d} per table", "compression ratio (sampled)")) == {ratio_tag(d, f) for f in features}
        assert shown((f"{d} per table", "max abs error (sampled)")) == {f"comm/{d}/max_abs_error/{f}" for f in features}


def test_labels_leave_out_overrides_every_run_shares(tmp_path):
    for seed in (0, 1):
        for policy in ("fixed", "dual"):
            run = write_run(tmp_path, f"{policy}{seed}", auc=0.7, fwd=3.0, seed=seed, policy=policy)
            (run / ".hydra" / "overrides.yaml").write_text(
                yaml.safe_dump([f"policy={policy}", "model.dense_arch_layer_sizes=[16,8]", "epochs=3", f"seed={seed}"])
            )
    points = summary.group_runs(summary.collect(tmp_path)[0])
    assert sorted(p.group for p in points) == ["policy=dual", "policy=fixed"]
    assert [len(p.runs) for p in points] == [2, 2]
