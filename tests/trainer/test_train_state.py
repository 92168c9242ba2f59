"""What a trainer run records and restores, on one shared set of real 2-rank runs: the LR
schedule in TensorBoard, checkpoint pruning, the HPARAMS entry, and the dual policy's iteration
across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_artifacts import events, raw_losses, scalars
from tensorboard.plugins.hparams import plugin_data_pb2
from trainer_runs import losses, train

from dlrm.trainer.checkpoint_format import read_state

TOTAL, STOP, EVERY, KEEP = 26, 12, 4, 3
BASE_LR = 0.02  # configs/optimizer/adagrad.yaml: the fused embedding group (TensorBoard's train/lr) and the MLPs
COMMON = [
    "loss_log=true",
    f"checkpoint.every={EVERY}",
    f"checkpoint.keep={KEEP}",
    # warmup over 4 iterations, constant, decay from 12 over 12 iterations to 0
    "lr_schedule.warmup_steps=4",
    "lr_schedule.decay_start=12",
    "lr_schedule.decay_steps=12",
    # the dual policy's bound multiplier falls from 2.0 in steps of 0.1 every 2 iterations to 1.0 at 20,
    # so it changes after the resume at 12
    "policy=dual",
    "policy.forward.schedule.early_stage=20",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted run of 26 iterations, and one stopped at 12 and resumed to 26."""
    root, cache = tmp_path_factory.mktemp("state"), tmp_path_factory.mktemp("cache")
    full, part = root / "full", root / "part"
    train(full, cache, [*COMMON, f"max_iterations={TOTAL}"])
    train(part, cache, [*COMMON, f"max_iterations={STOP}"])
    train(part, cache, [*COMMON, f"max_iterations={TOTAL}", "resume=true"])
    return {"full": full, "resumed": part}


def test_tensorboard_lr_follows_the_warmup_decay_schedule(runs):
    lr = scalars(runs["full"], "train/lr")["train/lr"]
    assert sorted(lr) == list(range(1, TOTAL + 1))
    # train/lr at step i is the rate iteration i trained with. By hand (warmup W = 4: iteration s
    # trains with s/4 of the base until s = 4): steps 1, 2, 3 show 1/4, 2/4, 3/4; steps 4 .. 11 the
    # base (constant until the decay starts at 12)
    assert [lr[i] for i in range(1, 12)] == pytest.approx(
        [BASE_LR * f for f in (0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1, 1, 1)], rel=1e-6
    )
    # the decay: (12/12)^2, (11/12)^2, ..., (1/12)^2, then 0 from the end of the decay (12 + 12 = 24)
    squares = [BASE_LR * ((12 - j) / 12) ** 2 for j in range(13)]
    decaying = [lr[i] for i in range(11, TOTAL + 1)]
    assert decaying == sorted(decaying, reverse=True)
    assert sorted(set(decaying), reverse=True) == pytest.approx(squares, rel=1e-6, abs=1e-12)
    assert [lr[i] for i in (24, 25, 26)] == [0.0, 0.0, 0.0]


def test_resumed_run_continues_the_lr_schedule(runs):
    full, resumed = (scalars(runs[k], "train/lr")["train/lr"] for k in ("full", "resumed"))
    assert sorted(resumed) == list(range(1, TOTAL + 1))
    assert [resumed[i] for i in range(STOP + 1, TOTAL + 1)] == [full[i] for i in range(STOP + 1, TOTAL + 1)]


@pytest.mark.parametrize("run", ["full", "resumed"])
def test_checkpoint_keep_leaves_the_newest_complete_steps(runs, run):
    ckpts = runs[run] / "checkpoints"
    # saves every 4 iterations and at the end (26): the newest 3 are 20, 24 and 26
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-20", "step-24", "step-26"]
    assert (ckpts / "latest").read_text() == "step-26"
    for step in (20, 24, 26):
        state = read_state(ckpts / f"step-{step}", 0).train_state
        assert state["iteration"] == step and state["world_size"] == 2
        names = sorted(p.name for p in (ckpts / f"step-{step}").iterdir())
        assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one DCP save, nothing beside it


def _hparams_plugin(run_dir: Path) -> tuple[dict, list[str]]:
    """(hparam name -> value, metric tags) from the run's HPARAMS plugin data."""
    hparams, metric_tags = {}, []
    for raw in events(run_dir).PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(raw)
        if data.HasField("session_start_info"):
            for name, value in data.session_start_info.hparams.items():
                hparams[name] = getattr(value, value.WhichOneof("kind"))
        if data.HasField("experiment"):
            metric_tags += [m.name.tag for m in data.experiment.metric_infos]
    return hparams, metric_tags


def test_hparams_hold_the_config_and_the_final_metrics(runs):
    run_dir = runs["full"]
    hparams, metric_tags = _hparams_plugin(run_dir)
    expected = {
        "compression.name": "lossy",
        "policy.name": "dual",
        "seed": 0,
        "batch_size": 64,
        "model.arch": "dlrm",
        "model.embedding_dim": 16,
        "sharding.type": "planner",
        "checkpoint.every": EVERY,
        "checkpoint.keep": KEEP,
        "lr_schedule.decay_steps": 12,
        "policy.forward.schedule.early_stage": 20,
        "optimizer.sparse.name": "rowwise_adagrad",
        "max_iterations": TOTAL,
        "loss_log": True,
    }
    assert {k: hparams.get(k) for k in expected} == expected
    metrics = json.loads((run_dir / "metrics.json").read_text())
    names = {"hparam/auc", "hparam/logloss", "hparam/forward_ratio", "hparam/backward_ratio"}
    assert names <= set(metric_tags)
    final = scalars(run_dir, "hparam/")
    assert set(final) == set(metric_tags)
    for tag in metric_tags:  # every final metric beside the config is metrics.json's
        (value,) = final[tag].values()
        assert value == pytest.approx(metrics[tag.removeprefix("hparam/")], rel=1e-6), tag  # TensorBoard keeps float32
    assert metrics["forward_ratio"] > 1 and 0 < metrics["auc"] < 1


def test_resumed_dual_policy_continues_its_bounds_and_losses(runs):
    full, resumed = runs["full"], runs["resumed"]
    after = range(STOP + 1, TOTAL + 1)
    # the losses after the resume are the uninterrupted run's, bit for bit; a policy restarted at
    # iteration 0 would compress with the doubled early bounds and change them
    reference, got = losses(full), losses(resumed)
    assert sorted(got) == list(range(1, TOTAL + 1))
    assert [got[i] for i in after] == [reference[i] for i in after]
    assert [i for i, _ in raw_losses(resumed)] == [*range(1, STOP + 1), *after]  # nothing redone
    ref_tb, got_tb = scalars(full, "comm/"), scalars(resumed, "comm/")
    eb_tags = sorted(t for t in ref_tb if t.startswith("comm/forward/eb/"))
    assert len(eb_tags) == 26  # one bound per table
    for tag in [*eb_tags, "comm/forward/ratio", "comm/backward/ratio"]:
        assert [got_tb[tag][i] for i in after] == [ref_tb[tag][i] for i in after], tag
    # and the bounds do move after the resume: a multiplier stuck at the start would show
    bounds = [ref_tb["comm/forward/eb/cat_0"][i] for i in after]
    assert bounds[0] > bounds[-1] and len(set(bounds)) >= 4
    assert ref_tb["comm/forward/eb/cat_0"][1] > bounds[0]


def test_default_planner_plan_names_a_torchrec_sharding_type_for_every_table(runs):
    # sharding=planner (the default): TorchRec chooses per table; only tiny tables may be replicated
    # (data_parallel), the rest are sharded and their traffic compressed
    metrics = json.loads((runs["full"] / "metrics.json").read_text())
    kinds = {t: desc.split(" ranks=")[0] for t, desc in metrics["sharding_plan"].items()}
    assert sorted(kinds) == sorted(f"t_cat_{i}" for i in range(26))
    sharded = {"table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"}
    assert set(kinds.values()) <= sharded | {"data_parallel"}
    assert set(kinds.values()) & sharded
    assert metrics["forward_ratio"] > 1 and metrics["backward_ratio"] > 1
