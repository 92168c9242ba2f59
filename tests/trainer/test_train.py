"""The trainer end to end with torchrun: metrics, TensorBoard, resume, restarts, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_artifacts import attempts, checkpoint_tensors, flatten
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainer_runs import REPO, env_for, launch, losses, train, worker_pids

METRIC_KEYS = {
    "auc",
    "logloss",
    "accuracy",
    "iterations",
    "samples_per_s",
    "forward_ratio",
    "backward_ratio",
    "max_abs_error_seen",
    "config_name",
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_two_ranks_write_metrics_and_tensorboard(tmp_path, cache):
    run_dir = tmp_path / "run"
    proc = train(run_dir, cache, ["max_iterations=12", "eval_every=6", "pipeline=true"])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics.keys() >= METRIC_KEYS
    assert metrics["iterations"] == 12 and metrics["world_size"] == 2
    assert 0.0 < metrics["auc"] < 1.0 and metrics["logloss"] > 0 and metrics["samples"] == 391
    assert "test AUC" in proc.stdout and str(run_dir) in proc.stdout
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/auc", "eval/logloss", "eval/accuracy", "test/auc"} <= tags
    assert [e.step for e in events.Scalars("eval/auc")] == [6, 12]
    # the default run compresses with the dual policy: ratios and per-table bounds are logged
    assert {"comm/forward/ratio", "comm/backward/ratio", "comm/forward/eb/cat_0"} <= tags
    assert metrics["forward_ratio"] > 5 and metrics["policy"] == "dual"
    bounds = {t: events.Scalars(t)[-1].value for t in tags if t.startswith("comm/forward/eb/")}
    assert len(set(bounds.values())) == 3  # tight, base and loose table classes
    assert len(events.Scalars("train/loss")) == 12
    # counted on a few steady-state iterations (dlrm.telemetry.host_syncs): lossy's codec syncs
    assert metrics["host_syncs_per_iteration"] > 0
    assert metrics["host_syncs_by_op"]["item"] > 0
    assert sum(metrics["host_syncs_by_op"].values()) == pytest.approx(metrics["host_syncs_per_iteration"])


def test_lossy_keeps_the_test_auc_of_uncompressed_training_on_real_rows(tmp_path, cache):
    # The accuracy bar on the bundled Criteo sample, one full epoch, same seed: within
    # 0.002 AUC of uncompressed at a >= 10x forward wire ratio. SGD (the published recipe's
    # optimizer): under element-wise Adagrad on the MLPs this test split moves by up to 0.007
    # for any perturbation at all, even TorchRec's own fp16 or a 1e-7 bound (README, Results).
    common = ["optimizer=sgd", "policy=fixed", "seed=1"]
    auc = {}
    for name in ("none", "lossy"):
        train(tmp_path / name, cache, [f"compression={name}", *common])
        auc[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert auc["lossy"]["forward_ratio"] >= 10 and auc["lossy"]["backward_ratio"] > 4  # both directions
    assert abs(auc["lossy"]["auc"] - auc["none"]["auc"]) <= 0.002, auc
    assert auc["lossy"]["max_abs_error_seen"] > 0 and auc["none"]["max_abs_error_seen"] == 0


def test_plain_loop_and_pipeline_give_the_same_losses(tmp_path, cache):
    common = ["max_iterations=6", "loss_log=true", "data.shuffle=false"]
    train(tmp_path / "pipe", cache, [*common, "pipeline=true"])
    train(tmp_path / "plain", cache, [*common, "pipeline=false"])
    assert losses(tmp_path / "pipe") == losses(tmp_path / "plain")


def test_resume_continues_with_the_losses_of_an_uninterrupted_run(tmp_path, cache):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["loss_log=true", "checkpoint.every=5", "epochs=2", "batch_size=256", "eval_every=20"]
    train(full, cache, [*common, "max_iterations=22"])  # crosses an epoch boundary (14 per epoch)
    train(part, cache, [*common, "max_iterations=10"])
    assert (part / "checkpoints" / "latest").read_text() == "step-10"
    train(part, cache, [*common, "max_iterations=22", "resume=true"])
    reference, resumed = losses(full), losses(part)
    assert sorted(resumed) == list(range(1, 23))
    assert [resumed[i] for i in range(11, 23)] == [reference[i] for i in range(11, 23)]
    assert json.loads((part / "metrics.json").read_text())["iterations"] == 22


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, cache) -> Path:
    """A 2-rank run of 4 iterations and its checkpoint, trained once: the tests below resume copies of it."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    train(run_dir, cache, ["max_iterations=4"])
    return run_dir


def test_resume_with_another_world_size_names_both_sizes(tmp_path, cache, short_run):
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)
    proc = train(run_dir, cache, ["max_iterations=6", "resume=true"], nproc=1, check=False)
    assert proc.returncode != 0
    assert "written by 2 ranks but this job has 1" in proc.stderr


def test_crash_during_save_leaves_previous_checkpoint_usable(tmp_path, cache, short_run):
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)
    ckpts = run_dir / "checkpoints"
    # What a save killed half-way leaves behind: a temporary directory without DCP's .metadata.
    (ckpts / ".tmp-step-8").mkdir()
    (ckpts / ".tmp-step-8" / "__0_0.distcp").write_bytes(b"partial")
    proc = train(run_dir, cache, ["max_iterations=6", "resume=true"])
    assert "resumed from" in (run_dir / "train_rank0.log").read_text()
    assert json.loads((run_dir / "metrics.json").read_text())["iterations"] == 6
    assert not (ckpts / ".tmp-step-8").exists() and (ckpts / "latest").read_text() == "step-6"
    assert proc.returncode == 0


def test_sigkilled_rank_restarts_from_the_last_checkpoint_and_finishes(tmp_path, cache):
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    total, every = 60, 10
    common = ["loss_log=true", f"checkpoint.every={every}", "batch_size=32", f"max_iterations={total}"]
    output = tmp_path / "torchrun.log"
    agent = launch(run_dir, cache, common, output, max_restarts=1)
    try:
        # Kill rank 1 mid-way between two checkpoints, past the first one: 2-5 iterations after a
        # multiple of 10, so that the restart has iterations to redo and no save is half-way.
        deadline, done = time.monotonic() + 120, 0
        while time.monotonic() < deadline:
            done = max(losses(run_dir), default=0) if (run_dir / "losses.txt").exists() else 0
            if done > every and 2 <= done % every <= 5:
                break
            time.sleep(0.02)
        assert done > every and 2 <= done % every <= 5, f"training did not reach a kill point in time ({done})"
        workers = worker_pids(agent.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        agent.wait(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output.read_text()[-12000:]
    assert json.loads((run_dir / "metrics.json").read_text())["iterations"] == total

    # losses.txt holds both attempts: 1 .. k from the first, then from the restart on.
    first, second = attempts(run_dir)
    killed_at = max(first)
    last_checkpoint = every * (killed_at // every)  # the newest save the first attempt finished
    assert list(first) == list(range(1, killed_at + 1))
    assert list(second) == list(range(last_checkpoint + 1, total + 1))
    redone = sorted(first.keys() & second.keys())
    assert redone == list(range(last_checkpoint + 1, killed_at + 1)) and redone
    assert [second[i] for i in redone] == [first[i] for i in redone]
    assert f"step-{last_checkpoint} at iteration {last_checkpoint}" in (run_dir / "train_rank0.log").read_text()

    # The same run without the kill: the same losses, and the same final weights and optimizer state.
    train(reference, cache, common)
    assert {**first, **second} == losses(reference)
    got = flatten(checkpoint_tensors(run_dir / "checkpoints" / f"step-{total}"))
    want = flatten(checkpoint_tensors(reference / "checkpoints" / f"step-{total}"))
    assert got.keys() == want.keys() and any(".t_cat_" in k for k in got)
    same = [torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v for k, v in want.items()]
    different = [k for k, ok in zip(want, same, strict=True) if not ok]
    assert not different, different[:5]


@pytest.mark.parametrize(
    "override, message",
    [
        ("model=transformer", "Could not find 'model/transformer'"),
        ("sharding.type=diagonal", "sharding.type must be one of"),
        ("no_such_key=1", "no_such_key"),
        ("optimizer.dense.name=lion", "optimizer.dense.name must be one of"),
        # a bound the default dual policy would ignore names the keys that set it
        ("compression.forward.eb=0.02", "policy.forward.bounds.{tight,base,loose} and policy.forward.scale"),
        ("policy.forward.eb=0.02", "kind dual takes no ['eb']"),
        ("comm_timeout_s=0", "config key 'comm_timeout_s' must be a positive number of seconds (got 0)"),
    ],
)
def test_bad_override_fails_with_a_message_naming_it(tmp_path, cache, override, message):
    proc = train(tmp_path / "run", cache, [override, "max_iterations=1"], nproc=1, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout


def test_trains_on_dlrm_preprocess_output_of_real_terabyte_rows(tmp_path, cache):
    rows = (REPO / "tests" / "fixtures" / "day_0_head1000.tsv").read_text().splitlines(keepends=True)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "day_0.tsv").write_text("".join(rows[:800]))
    (raw / "day_1.tsv").write_text("".join(rows[800:]))
    out = tmp_path / "tb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "data.preprocess",
            "--format",
            "terabyte",
            "--out",
            str(out),
            str(raw / "day_0.tsv"),
            str(raw / "day_1.tsv"),
        ],
        cwd=REPO,
        check=True,
        env=env_for(cache),
    )
    run_dir = tmp_path / "run"
    train(
        run_dir,
        cache,
        [
            "data=criteo",
            f"data.processed_dir={out}",
            "data.train_stems=[day_0]",
            "data.val_stems=['day_1[:0.5]']",
            "data.test_stems=['day_1[0.5:]']",
            "batch_size=32",
        ],
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["iterations"] == 13 and metrics["samples"] == 100  # 800 / 64 rounds up; day_1 half
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
