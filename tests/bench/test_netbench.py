"""The network benchmark: rates, options, run-directory parsing, tables, the probe on a real
2-rank run, and (as root with tc) the whole driver in a throttled namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from multiprocess import free_port
from trainer_runs import REPO

from dlrm.bench import netbench, netns, netreport
from dlrm.performance import cost_model as cm

TINY = [
    "compression=none",
    "data=criteo_sample",
    "model.embedding_dim=16",
    "model.dense_arch_layer_sizes=[32,16]",
    "model.over_arch_layer_sizes=[32,1]",
    "batch_size=64",
    "eval_batch_size=256",
    "log_every=1000",
]


# ---------------------------------------------------------------- rates and options


@pytest.mark.parametrize(
    "rate,bps",
    [("800mbit", 1e8), ("200mbit", 2.5e7), ("1.5gbit", 1.875e8), ("64kbit", 8e3), ("unlimited", float("inf"))],
)
def test_tc_rates_become_bytes_per_second(rate, bps):
    assert netreport.rate_bytes_per_s(rate) == bps


@pytest.mark.parametrize("size,nbytes", [("1mb", 2**20), ("64kb", 65536), ("1500", 1500), ("2mbit", 2**18)])
def test_tc_sizes_become_bytes(size, nbytes):
    assert netreport.size_bytes(size) == nbytes


@pytest.mark.parametrize("rate", ["200", "200mbps", "fast", "-1mbit", ""])
def test_bad_rates_are_rejected_with_the_expected_form(rate):
    with pytest.raises(ValueError, match="mbit"):
        netreport.rate_bytes_per_s(rate)


def test_user_overrides_replace_the_defaults_for_the_same_key():
    merged = netbench.merge_overrides(["batch_size=2048", "data=synthetic", "batch_size=64", "+extra=1"])
    assert merged.count("batch_size=64") == 1 and "batch_size=2048" not in merged
    assert "data=synthetic" in merged and "+extra=1" in merged


def test_trainer_command_runs_the_probe_on_loopback_only(tmp_path):
    o = netbench.parse_args(["--iterations", "5", "--", "batch_size=64"])
    cmd, env = netbench.trainer_command(o, netbench.Variant("lossy", "lossy"), tmp_path, 29511)
    assert cmd[cmd.index("-m", 2) + 1] == "dlrm.bench.netprobe"
    assert "--rdzv-endpoint=127.0.0.1:29511" in cmd and "--local-addr=127.0.0.1" in cmd
    assert "batch_size=64" in cmd and "batch_size=2048" not in cmd
    assert "compression=lossy" in cmd and "max_iterations=5" in cmd and f"hydra.run.dir={tmp_path}" in cmd
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["DLRM_NETPROBE_OUT"] == str(tmp_path)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--configs", "fp16,lossy"], "include none"),
        (["--configs", "none,nosuchcodec"], "nosuchcodec"),
        (["--rate", "fast"], "mbit"),
        (["--iterations", "3", "--warmup", "3"], "leaves nothing"),
        (["--nproc", "1"], "nproc"),
        (["--bogus"], "after `--`"),
    ],
)
def test_bad_options_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        netbench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_variants_add_labelled_configurations():
    o = netbench.parse_args(
        ["--configs", "none", "--variant", "lossy_fixed", "lossy", "compression.forward.params.entropy=false"]
    )
    assert o.variants[-1] == netbench.Variant("lossy_fixed", "lossy", ("compression.forward.params.entropy=false",))


def test_without_root_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netbench.main(["--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "sudo" in err


def test_missing_iproute2_is_named_with_the_setup_step(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(netns.NetnsError, match="apt-get install iproute2"):
        netbench.preflight()


# ---------------------------------------------------------------- parsing and tables


def _write_run(
    root: Path,
    label: str,
    rep: int,
    step_ms: float,
    a2a_ms: float,
    fwd_bytes: float,
    bwd_bytes: float,
    auc: float,
    codec_ms: float = 0.0,
    warmup_ms: float = 5000.0,
) -> Path:
    """A run directory shaped like the trainer's (metrics.json, .hydra/config.yaml) plus probe files."""
    d = root / "runs" / f"r{rep}_800mbit_{label}"
    (d / ".hydra").mkdir(parents=True)
    (d / netbench.RUN_RECORD).write_text(
        json.dumps({"label": label, "rate": "800mbit", "repeat": rep, "extra": {"burst": "1mb", "load1_before": 1.0}})
    )
    (d / ".hydra" / "config.yaml").write_text("batch_size: 2048\nmodel:\n  embedding_dim: 64\n")
    plan = {f"t_cat_{i}": f"table_wise ranks=[{i % 2}]" for i in range(26)}
    (d / "metrics.json").write_text(
        json.dumps(
            {
                "accuracy": 0.75,
                "auc": auc,
                "logloss": 0.5,
                "iterations": 6,
                "samples_per_s": 1000.0,
                "forward_ratio": 1.0,
                "backward_ratio": 1.0,
                "max_abs_error_seen": 0.0,
                "compression": label,
                "config_name": f"synthetic-dlrm-{label}",
                "world_size": 2,
                "sharding_plan": plan,
                "val_auc": None,
                "val_logloss": None,
                "samples": 20000,
            }
        )
    )
    step = {
        "ms": step_ms,
        "a2a/forward/ms": a2a_ms,
        "a2a/backward/ms": 2 * a2a_ms,
        "a2a/forward/bytes": fwd_bytes,
        "a2a/backward/bytes": bwd_bytes,
        "codec/forward/ms": codec_ms,
        "other_a2a/ms": 1.0,
    }
    for r in range(2):
        steps = [dict(step, ms=warmup_ms)] + [dict(step) for _ in range(5)]
        (d / f"probe_rank{r}.json").write_text(
            json.dumps({"rank": r, "world_size": 2, "segments": 1, "dense_params": 1000, "steps": steps, "error": None})
        )
    return d


HEADER_ALLOWANCE = 1024  # bytes per payload beyond the raw rows: codec header, size exchange
RAW = 2048 * 13 * 64 * 4  # what each rank sends per direction uncompressed (13 of 26 tables)


def test_load_run_skips_warmup_and_reads_every_field(tmp_path):
    d = _write_run(tmp_path, "none", 0, step_ms=1000.0, a2a_ms=200.0, fwd_bytes=RAW, bwd_bytes=RAW, auc=0.7)
    r = netreport.load_run(d, warmup=1, label="none", rate="200mbit", repeat=0, extra={"wall_s": 9.0})
    assert r.iteration_ms == 1000.0 and r.iterations_timed == 5  # the 5000 ms warm-up is left out
    assert r.a2a_ms == {"forward": 200.0, "backward": 400.0} and r.a2a_share == pytest.approx(0.6)
    assert r.samples_per_s == pytest.approx(4096 / 1.0)
    assert r.embedding_dims == [64] * 26 and r.dense_params == 1000 and r.extra["wall_s"] == 9.0


def test_load_run_names_the_missing_file_and_the_failed_rank(tmp_path):
    d = _write_run(tmp_path, "none", 0, 1000.0, 200.0, RAW, RAW, 0.7)
    (d / "probe_rank1.json").unlink()
    with pytest.raises(netreport.RunDirError, match=r"probe_rank1\.json: missing"):
        netreport.load_run(d, 1, "none", "200mbit", 0)
    (d / "probe_rank1.json").write_text(json.dumps({"steps": [], "error": "RuntimeError: boom"}))
    with pytest.raises(netreport.RunDirError, match="rank 1 failed: RuntimeError: boom"):
        netreport.load_run(d, 1, "none", "200mbit", 0)
    (d / "metrics.json").write_text('{"auc": 0.5,\n oops')
    with pytest.raises(netreport.RunDirError, match=r"metrics.json:2: not valid JSON"):
        netreport.load_run(d, 1, "none", "200mbit", 0)


def test_too_few_iterations_for_the_warmup_is_an_error(tmp_path):
    d = _write_run(tmp_path, "none", 0, 1000.0, 200.0, RAW, RAW, 0.7)
    with pytest.raises(netreport.RunDirError, match="raise --iterations"):
        netreport.load_run(d, 6, "none", "200mbit", 0)


def _results(tmp_path: Path) -> list[netreport.RunResult]:
    runs = []
    for rep, (none_ms, lossy_ms) in enumerate([(1000.0, 500.0), (1200.0, 400.0), (900.0, 450.0)]):
        for label, ms, fb, bb, auc in (
            ("none", none_ms, RAW, RAW, 0.700),
            ("lossy", lossy_ms, RAW / 20, RAW / 8, 0.699),
        ):
            d = _write_run(tmp_path, label, rep, ms, 300.0 if label == "none" else 20.0, fb, bb, auc)
            runs.append(netreport.load_run(d, 1, label, "800mbit", rep))
    return runs


def test_summary_pairs_speedups_within_repeats(tmp_path):
    s = {x.label: x for x in netreport.summarize(_results(tmp_path))}
    # per-repeat speedups 2.0, 3.0, 2.0 -> median 2.0, range 2.0-3.0
    assert s["lossy"].speedup == pytest.approx(2.0) and s["lossy"].speedup_range == pytest.approx((2.0, 3.0))
    assert s["lossy"].iteration_ms == 450.0 and s["none"].speedup == 1.0
    assert s["lossy"].wire_ratio == pytest.approx({"forward": 20.0, "backward": 8.0})
    assert s["lossy"].auc_delta == pytest.approx(-0.001)
    assert s["none"].a2a_share == pytest.approx(900 / 1000)  # median of 900/1000, 900/1200, 900/900


def test_summary_needs_the_baseline(tmp_path):
    runs = [r for r in _results(tmp_path) if r.label != "none"]
    with pytest.raises(ValueError, match="no 'none' run"):
        netreport.summarize(runs)


def test_model_validation_and_table(tmp_path):
    results = _results(tmp_path)
    summaries = netreport.summarize(results)
    burst = 2.0**20
    v = netreport.validate_model(results, summaries, burst_bytes=burst)
    s = {x.label: x for x in summaries}
    assert v["calibration"] == "none at 800mbit" and v["predictions"] == 1
    # By hand: 2 ranks share 100 MB/s and each collective starts with a 1 MiB burst; none moves
    # 2 x RAW per direction, lossy RAW/20 and RAW/8 (both under the burst), the ring all-reduce
    # 2 x 1000 params x 4 B and the input dist 2 x 2048 x 26 x 12 / 2 B (both under it too).
    link = 1e8
    compute = 1.0 - 2 * (2 * RAW - burst) / link  # none's median iteration is 1000 ms
    lossy = compute + max(0, 2 * RAW / 8 - burst) / link
    assert v["compute_ms"] == pytest.approx(1e3 * compute)
    assert v["calibration_link_share"] == pytest.approx(1 - compute)  # of none's 1 s: not link-bound
    assert s["lossy"].model_ms == pytest.approx(1e3 * lossy)
    assert s["lossy"].model_error == pytest.approx(1e3 * lossy / 450.0 - 1)
    table = netreport.format_table(summaries)
    assert "| 800mbit | lossy | 450 |" in table and "2.00x (2.00-3.00)" in table and "20.0/8.0" in table


def test_report_mode_rebuilds_the_tables_without_running_anything(tmp_path, capsys):
    _results(tmp_path)
    assert netbench.main(["--report", "--out", str(tmp_path), "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 800mbit | lossy | 450 |" in out and "tbf burst 1 MiB" in out and "Published setup" in out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert len(doc["runs"]) == 6 and doc["validation"]["predictions"] == 1
    assert (tmp_path / "table.md").read_text().startswith("| rate | config |")


def test_a_calibration_on_a_link_bound_run_is_flagged(tmp_path, capsys):
    # none at 300 ms, of which the model puts 2 x (2 RAW - 1 MiB) / 100 MB/s = 252 ms on the link:
    # the compute it leaves (48 ms) is a small remainder, and the table says so
    for label, ms, fwd, bwd in (("none", 300.0, RAW, RAW), ("lossy", 100.0, RAW / 20, RAW / 8)):
        _write_run(tmp_path, label, 0, ms, 250.0 if label == "none" else 20.0, fwd, bwd, 0.7)
    assert netbench.main(["--report", "--out", str(tmp_path), "--warmup", "1"]) == 0
    share = 2 * (2 * RAW - 2**20) / 1e8 / 0.3
    assert f"<- {100 * share:.0f}% of that run was on the link" in capsys.readouterr().out


def test_report_mode_names_an_empty_directory(tmp_path, capsys):
    assert netbench.main(["--report", "--out", str(tmp_path)]) == 1
    assert "no run directories" in capsys.readouterr().err


# ---------------------------------------------------------------- the probe on real ranks


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_probe_counts_the_pooled_all_to_all_bytes_of_a_real_run(tmp_path, cache):
    """Two gloo ranks train 4 iterations through the probe; the bytes it saw sent are the model's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DLRM_NETPROBE_OUT=str(tmp_path))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=0",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--local-addr=127.0.0.1",
        "-m",
        "dlrm.bench.netprobe",
        *TINY,
        f"data.cache_dir={cache}",
        "sharding=table_wise",
        "max_iterations=4",
        "progress_bar=false",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = netreport.load_run(tmp_path, warmup=1, label="none", rate="unlimited", repeat=0)
    w = cm.Workload(ranks=2, batch_per_rank=64, dims=(16,) * 26)
    assert r.iterations_timed == 3
    for d in ("forward", "backward"):  # exact fp32 rows, plus the payload header and the size word
        assert w.a2a_bytes() < r.a2a_bytes[d] <= w.a2a_bytes() + HEADER_ALLOWANCE
    assert r.a2a_ms["forward"] > 0 and r.a2a_ms["backward"] > 0 and 0 < r.a2a_share < 1
    # the all-reduced dense MLPs: bottom 13-32-16, top (16 + 27*26/2)-32-1
    assert r.dense_params == (13 * 32 + 32 + 32 * 16 + 16) + ((16 + 351) * 32 + 32 + 32 + 1)
    # metrics.json's wire bytes (the trainer's own counters) are what the probe saw each rank send
    # in all its all-to-alls: the input dist and its splits, both pooled ones and their size words
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"probe_rank{rank}.json").read_text())["steps"]
        keys = ("a2a/forward/bytes", "a2a/backward/bytes", "other_a2a/bytes")
        seen = sum(s.get(k, 0.0) for s in steps for k in keys) / len(steps)
        assert metrics["wire_bytes_per_rank"][rank] == pytest.approx(seen, rel=1e-9)
    assert metrics["predicted_wire_bytes_per_iteration"] == pytest.approx(metrics["wire_bytes_per_iteration"], rel=0.1)


# ---------------------------------------------------------------- the driver, for real


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root for `ip netns add`"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


@pytest.mark.skipif(_can_make_namespaces() is not None, reason=str(_can_make_namespaces()))
@pytest.mark.timeout(90)
def test_driver_trains_in_a_throttled_namespace_and_removes_it(tmp_path, cache):
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    out = tmp_path / "bench"
    cmd = [
        "bash",
        str(REPO / "scripts" / "bench_network.sh"),
        "--configs",
        "none",
        "--rate",
        "800mbit",
        "--repeats",
        "1",
        "--iterations",
        "3",
        "--warmup",
        "1",
        "--timeout",
        "55",
        "--out",
        str(out),
        "--",
        *TINY,
        f"data.cache_dir={cache}",
    ]
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 800mbit | none |" in proc.stdout and "load average" in proc.stdout.lower()
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert after <= before  # its namespace is gone
    doc = json.loads((out / "results.json").read_text())
    run = doc["runs"][0]
    w = cm.Workload(ranks=2, batch_per_rank=64, dims=(16,) * 26)
    for d in ("forward", "backward"):
        assert w.a2a_bytes() < run["a2a_bytes"][d] <= w.a2a_bytes() + HEADER_ALLOWANCE
    assert run["extra"]["link_bytes"] > 2 * 2 * 3 * w.a2a_bytes()  # every rank's bytes crossed the tbf
    assert not (out / "runs" / "r0_800mbit_none" / "checkpoints").exists()
