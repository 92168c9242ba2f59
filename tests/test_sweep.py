"""scripts/sweep.sh: Hydra-grammar expansion into one torchrun per point, and a real tiny sweep."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "scripts" / "sweep.sh"


def sweep(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SWEEP), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def commands(out: subprocess.CompletedProcess) -> list[list[str]]:
    return [shlex.split(line) for line in out.stdout.splitlines() if "torch.distributed.run" in line]


def overrides_of(cmd: list[str]) -> dict[str, str]:
    after = cmd[cmd.index("dlrm.train") + 1 :]
    return dict(a.split("=", 1) for a in after)


def test_dry_run_expands_the_cartesian_product_and_replaces_default_axes(tmp_path):
    out = sweep(
        "--dry-run",
        "--out",
        str(tmp_path / "s"),
        "--nproc",
        "3",
        "policy=dual,closed_loop",
        "policy.forward.scale=range(1,4)",
        "data=synthetic",
    )
    assert out.returncode == 0, out.stderr
    cmds = commands(out)
    assert len(cmds) == 2 * 3 * 2  # policy x scale x the default seed axis (0,1)
    points = [overrides_of(c) for c in cmds]
    assert {(p["policy"], p["policy.forward.scale"], p["seed"]) for p in points} == {
        (pol, s, seed) for pol in ("dual", "closed_loop") for s in ("1", "2", "3") for seed in ("0", "1")
    }
    assert all(p["compression"] == "lossy" and p["data"] == "synthetic" for p in points)  # default + added
    assert all(c[c.index("--nproc_per_node") + 1] == "3" for c in cmds)
    # each point in its own directory under --out, named like Hydra's sweep subdirs, quoted for Hydra
    dirs = [p["hydra.run.dir"] for p in points]
    assert len(set(dirs)) == len(dirs)
    assert dirs[0] == f"'{tmp_path}/s/0-compression=lossy,data=synthetic,policy.forward.scale=1,policy=dual,seed=0'"
    assert not (tmp_path / "s").exists()  # a dry run starts and creates nothing


def test_bad_override_is_refused_before_anything_runs(tmp_path):
    out = sweep("--dry-run", "--out", str(tmp_path), "policy=[")
    assert out.returncode != 0
    assert "bad override" in out.stderr and "policy=[" in out.stderr


def test_tiny_real_sweep_writes_a_run_per_point_then_the_summary(tmp_path):
    out_dir = tmp_path / "sweep"
    tiny = [
        "policy=fixed,dual",
        "policy.forward.scale=2",
        "seed=0",
        "max_iterations=3",
        "limit_eval_batches=1",
        "batch_size=32",
        "eval_batch_size=128",
        "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[16,8]",
        "model.over_arch_layer_sizes=[16,1]",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    out = sweep("--out", str(out_dir), *tiny, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = sorted(p.parent for p in out_dir.glob("*/metrics.json"))
    assert [r.name.split("-", 1)[0] for r in runs] == ["0", "1"]
    for run in runs:
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["iterations"] == 3 and 0 <= metrics["auc"] <= 1
        assert metrics["forward_ratio"] > 1  # lossy compression really ran on the wire
        assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    md = (out_dir / "summary.md").read_text()
    assert "| fixed |" in md and "| dual |" in md
    assert (out_dir / "summary.png").read_bytes()[:4] == b"\x89PNG"
    # re-running the same sweep skips the finished points
    again = sweep("--out", str(out_dir), *tiny, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done already, skipped") == 2
