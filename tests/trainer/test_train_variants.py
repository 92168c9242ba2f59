"""The trainer with the other model (DCNv2) and with every sharding option, as real 2-rank runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from run_artifacts import checkpoint_tensors
from trainer_runs import losses, train

N_TABLES = 26  # the bundled Criteo sample's categorical features
DIM = 16  # trainer_runs.SMALL's embedding dim


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_dcnv2_model_trains_its_cross_network_through_the_trainer(tmp_path, cache):
    run_dir = tmp_path / "run"
    train(
        run_dir,
        cache,
        [
            "model=dcnv2",
            "model.dcn_num_layers=2",
            "model.dcn_low_rank_dim=8",
            "max_iterations=6",
            "checkpoint.every=3",
            "loss_log=true",
        ],
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["config_name"] == "criteo_sample-dcnv2-lossy" and metrics["iterations"] == 6
    assert metrics["forward_ratio"] > 1 and all(math.isfinite(v) for v in losses(run_dir).values())
    assert metrics["logloss"] < math.log(2) and 0 < metrics["auc"] < 1  # better than a coin's 0.693
    before = checkpoint_tensors(run_dir / "checkpoints" / "step-3")["model"]
    after = checkpoint_tensors(run_dir / "checkpoints" / "step-6")["model"]
    # A low-rank cross network over the dense output and the 26 pooled embeddings stacked:
    # (1 + 26) x 16 = 432 inputs, rank 8, two layers; the top MLP reads those 432 values (DLRM's
    # dot interaction would give it 16 + 27 x 26 / 2 = 367).
    cross = {k.rsplit("crossnet.", 1)[1]: v for k, v in after.items() if ".inter_arch.crossnet." in k}
    assert {k: tuple(v.shape) for k, v in cross.items()} == {
        "W_kernels.0": (432, 8),
        "W_kernels.1": (432, 8),
        "V_kernels.0": (8, 432),
        "V_kernels.1": (8, 432),
        "bias.0": (432,),
        "bias.1": (432,),
    }
    (top,) = [v for k, v in after.items() if k.endswith("over_arch.model.0._mlp.0._linear.weight")]
    assert tuple(top.shape) == (32, 432)
    # and training moves it: every cross-network kernel changed between iterations 3 and 6
    for k, v in after.items():
        if ".crossnet." in k and "kernels" in k:
            assert not torch.equal(v, before[k]), k


# The sixth option, `planner` (TorchRec's choice per table, the default), is checked on the
# shared default run of tests/trainer/test_train_state.py.
SHARDINGS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"]


def plan_of(metrics: dict) -> dict[str, tuple[str, list[int]]]:
    """table -> (sharding type, ranks) from metrics.json's sharding_plan."""
    out = {}
    for table, desc in metrics["sharding_plan"].items():
        kind, ranks = desc.split(" ranks=")
        out[table] = (kind, json.loads(ranks))
    return out


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_every_sharding_option_shards_every_table_so_and_compresses_its_traffic(tmp_path, cache, sharding):
    run_dir = tmp_path / "run"
    train(run_dir, cache, [f"sharding={sharding}", "max_iterations=2"])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    plan = plan_of(metrics)
    assert sorted(plan) == sorted(f"t_cat_{i}" for i in range(N_TABLES))
    assert {kind for kind, _ in plan.values()} == {sharding}
    ranks = {table: r for table, (_, r) in plan.items()}
    if sharding == "table_wise":  # one owner per table, and both ranks own some
        assert all(len(r) == 1 for r in ranks.values()) and {r[0] for r in ranks.values()} == {0, 1}
    if sharding in ("row_wise", "table_row_wise"):  # rows split over both ranks of the one host
        assert all(r == [0, 1] for r in ranks.values())
    if sharding in ("column_wise", "table_column_wise"):  # 16 columns in shards of min_partition 8
        assert all(len(r) == DIM // 8 for r in ranks.values())
    # lossy (the default) compressed what crossed between the ranks, both ways
    assert metrics["forward_ratio"] > 1 and metrics["backward_ratio"] > 1
    assert metrics["max_abs_error_seen"] > 0 and metrics["iterations"] == 2
