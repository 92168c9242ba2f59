"""The trainer at 3 and 4 ranks on one host (marker ``scale``: `make test-scale`, not `make test`):
compression=none against stock TorchRec for every sharding option, bounded codecs within their
bounds, every dense_comm choice, auto, hot rows and the row cache, and resume."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from run_artifacts import checkpoint_tensors, scalars
from trainer_runs import losses, train

pytestmark = pytest.mark.scale

WORLDS = [3, 4]
# TorchRec's own sharder with no codec: the QComms path at fp32 both ways has no codec registry
# (torchrec.distributed.fbgemm_qcomm_codec.get_qcomm_codecs_registry returns None), so it is stock
STOCK = [
    "compression=qcomm_fp16",
    "compression.qcomm.forward_precision=fp32",
    "compression.qcomm.backward_precision=fp32",
]
SHARDINGS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "planner", "comm_aware"]
ITERS = 3
SHORT = [f"max_iterations={ITERS}", "loss_log=true", "limit_eval_batches=1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def metrics_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def model_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(run_dir / "checkpoints" / f"step-{ITERS}")["model"]


def assert_sane(run_dir: Path, world: int, iterations: int = ITERS) -> dict:
    """Every iteration's loss finite, the run's metrics for ``world`` ranks defined and finite."""
    m, ls = metrics_of(run_dir), losses(run_dir)
    assert sorted(ls) == list(range(1, iterations + 1)) and all(math.isfinite(v) for v in ls.values()), ls
    assert m["world_size"] == world and m["iterations"] == iterations
    assert 0 < m["auc"] < 1 and 0 < m["logloss"] < 1 and math.isfinite(m["max_abs_error_seen"])
    return m


def assert_predicted_paths(m: dict, paths: tuple[str, ...]) -> None:
    """The traffic model (dlrm.placement.traffic) against the bytes the run counted, per path."""
    measured, predicted = m["wire_bytes_by_path"], m["predicted_wire_bytes_by_path"]
    for path in paths:
        assert predicted[path] == pytest.approx(measured[path], rel=0.1, abs=100), (path, measured, predicted)


# -- compression=none is stock TorchRec, for every sharding option, at 3 and 4 ranks ---------------


# comm_aware prices each config's bytes (presumably none's framing against stock's bare rows; not
# traced). At 4 ranks both plan alike; at 3 they place some tables on other ranks (seen: t_cat_1,
# 10, 17, 25 and more), so stock TorchRec has no twin there and only 4 ranks are compared.
PARITY = [(w, s) for w in WORLDS for s in SHARDINGS if (w, s) != (3, "comm_aware")]


@pytest.mark.parametrize("world, sharding", PARITY)
def test_none_trains_as_stock_torchrec(tmp_path, cache, world, sharding):
    # comm_aware prices a link: fixed here, so that both runs plan alike (it would time the link)
    extra = ["placement.link_mbit=1000"] if sharding == "comm_aware" else []
    common = [*SHORT, f"sharding={sharding}", *extra]
    train(tmp_path / "stock", cache, [*common, *STOCK], nproc=world)
    train(tmp_path / "none", cache, [*common, "compression=none"], nproc=world)
    stock, none = metrics_of(tmp_path / "stock"), metrics_of(tmp_path / "none")
    assert none["sharding_plan"] == stock["sharding_plan"]
    kinds = {desc.split(" ranks=")[0] for desc in none["sharding_plan"].values()}
    if sharding not in ("planner", "comm_aware"):
        assert kinds == {sharding}
    ranks = {r for desc in none["sharding_plan"].values() for r in json.loads(desc.split(" ranks=")[1])}
    assert ranks == set(range(world))  # every rank holds some table
    # bit for bit: every loss, the evaluation, every weight at the end
    assert (tmp_path / "none" / "losses.txt").read_text() == (tmp_path / "stock" / "losses.txt").read_text()
    assert none["auc"] == stock["auc"] and none["logloss"] == stock["logloss"]
    a, b = model_tensors(tmp_path / "stock"), model_tensors(tmp_path / "none")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert_sane(tmp_path / "none", world)
    # our path counted its bytes, and the traffic model predicts each path of them
    paths = [p for p, v in none["wire_bytes_by_path"].items() if v > 0]
    assert {"input", "forward", "backward"} <= set(paths)
    assert_predicted_paths(none, tuple(paths))


# -- bounded codecs within their bounds ---------------------------------------------------------


@pytest.mark.parametrize(
    "world, sharding", [(3, "row_wise"), (3, "planner"), (4, "table_row_wise"), (4, "table_column_wise")]
)
def test_lossy_stays_within_its_bounds(tmp_path, cache, world, sharding):
    run = tmp_path / "run"
    train(run, cache, [*SHORT, f"sharding={sharding}", "compression=lossy", "compression.stats.sample_every=1"], world)
    m = assert_sane(run, world)
    assert m["forward_ratio"] > 1 and m["backward_ratio"] > 1 and m["max_abs_error_seen"] > 0
    over = {t: v for t, v in scalars(run, "comm/").items() if t.endswith("/max_error_over_bound")}
    assert {"comm/forward/max_error_over_bound", "comm/backward/max_error_over_bound"} <= set(over)
    worst = max(v for series in over.values() for v in series.values())
    assert 0 < worst <= 1.0, over  # errors were made (the codec did compress) and none beyond the bound


# -- every dense_comm option, auto, hot rows and the row cache complete and report sanely ----------

DCT = ["dense_comm=dct", "dense_comm.keep=0.05", "dense_comm.min_numel=64"]
AUTO = [
    "compression=auto",
    "dense_comm=auto",
    "compression.strategy.calibrate_iterations=2",
    "compression.strategy.measure_iterations=2",
    "policy=fixed",
]
FEATURES = {
    "dct_allgather": [*DCT, "dense_comm.aggregation=allgather"],
    "dct_reduce_scatter": [*DCT, "dense_comm.aggregation=reduce_scatter"],
    "powersgd": ["dense_comm=powersgd", "dense_comm.start_iter=2"],
    "fp16": ["dense_comm=fp16"],
    "auto": AUTO,
    "hot_rows": [
        "sharding=table_wise",
        "placement.hot_rows=8",
        "placement.sync_codec=backward",
        "compression.stats.sample_every=1",
    ],
    "row_cache": ["sharding=table_wise", "compression.forward.cache.enabled=true"],
}
FEATURE_ITERS = 6  # auto plans from iteration 5 (2 calibrating, 2 measuring)


# each at one of the two sizes (the suite's time): the aggregations and auto at 4 (DCT's all-gather
# bytes grow with the ranks), the hooks, hot rows and the row cache at 3 (uneven table ownership)
WORLD_OF = {
    "dct_allgather": 4,
    "dct_reduce_scatter": 4,
    "auto": 4,
    "powersgd": 3,
    "fp16": 3,
    "hot_rows": 3,
    "row_cache": 3,
}


@pytest.mark.parametrize("world, feature", [(w, f) for f, w in WORLD_OF.items()])
def test_every_option_trains_and_reports_at_more_ranks(tmp_path, cache, world, feature):
    run = tmp_path / "run"
    train(
        run,
        cache,
        [f"max_iterations={FEATURE_ITERS}", "loss_log=true", "limit_eval_batches=1", *FEATURES[feature]],
        world,
    )
    m = assert_sane(run, world, FEATURE_ITERS)
    # the input dist's ids are predicted from the id statistics alone, at any world size
    assert_predicted_paths(m, ("input",))
    if feature.startswith("dct") or feature == "powersgd":
        assert m["dense_comm"] == feature.split("_")[0] and m["dense_ratio"] > 1.5
    if feature == "fp16":  # every bucket in half precision
        assert m["dense_comm"] == "fp16" and m["dense_ratio"] == pytest.approx(2.0, rel=0.01)
    if feature == "auto":
        plans = json.loads((run / "strategy.json").read_text())["plans"]
        assert [p for p in plans if p["choice"] is not None], plans
        # rank 0 decided, every rank applied the same strategy
        applied = [
            re.findall(r"strategy from iteration (\d+): (.*)", (run / f"train_rank{r}.log").read_text())
            for r in range(world)
        ]
        assert applied[0] and all(a == applied[0] for a in applied), applied
    if feature == "hot_rows":
        hot = m["hot_rows"]
        assert hot["sync_codec"] == "backward" and hot["sync_row_ratio"] > 1
        digests = hot["replica_digest_per_rank"]  # crc32 of each rank's replicas
        assert len(digests) == world and len(set(digests)) == 1
        assert m["wire_bytes_by_path"]["replica_sync"] == pytest.approx(hot["sync_bytes_per_iteration"])
    if feature == "row_cache":
        assert 0 < m["cache_hit_share"] <= m["cache_held_share"] < 1 and m["cache_bytes_per_rank"] > 0
    if feature in ("auto", "hot_rows", "row_cache"):  # bounded codecs travelled: within their bounds
        over = [v for t, s in scalars(run, "comm/").items() if t.endswith("/max_error_over_bound") for v in s.values()]
        assert over and max(over) <= 1.0


# -- checkpoint and resume ------------------------------------------------------------------------


# Found here: at 3 ranks, hot rows with the coded sync or beside the row cache resume with the loss
# of iteration 8 differing in the 8th digit (both exact at 2 ranks). Not the hot-row state: with
# the bucket rebuild off, every tensor of checkpoints 5-8 equals the straight run's. The cause:
# DDP all-reduces the first backward of every process in its initial bucket layout and rebuilds the
# buckets after it; gloo's 3-rank all-reduce adds an element's three terms in an order set by its
# offset in the bucket, so the resumed run's first iteration (5) sums some dense gradients in
# another order than the straight run's iteration 5 did (1 ulp in 8-43 elements of 3 dense weights;
# 2 ranks: a+b is exact). Turning the rebuild off (find_unused_parameters=True) costs a graph
# traversal per iteration. The exact sync's case at 3 ranks differs too (checked), below the 8th digit.
RESUME_DIFFERS = pytest.mark.xfail(
    strict=True,
    reason="3 ranks: DDP's first-iteration bucket layout sums the resumed iteration's dense gradients in another order",
)


@pytest.mark.parametrize(
    "world, extra",
    [
        (4, ["sharding=table_row_wise", *DCT, "dense_comm.aggregation=reduce_scatter"]),
        (3, ["sharding=table_wise", "compression.forward.cache.enabled=true"]),
        (3, ["sharding=table_wise", "placement.hot_rows=8"]),
        pytest.param(
            3, ["sharding=table_wise", "placement.hot_rows=8", "placement.sync_codec=backward"], marks=RESUME_DIFFERS
        ),
        pytest.param(
            3,
            ["sharding=table_wise", "compression.forward.cache.enabled=true", "placement.hot_rows=8"],
            marks=RESUME_DIFFERS,
        ),
    ],
    ids=[
        "w4_twrw_dct_reduce_scatter",
        "w3_row_cache",
        "w3_hot_rows",
        "w3_hot_rows_coded_sync",
        "w3_row_cache_and_hot_rows",
    ],
)
def test_resume_continues_with_the_losses_of_an_uninterrupted_run(tmp_path, cache, world, extra):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["loss_log=true", "checkpoint.every=3", "limit_eval_batches=1", *extra]
    train(full, cache, [*common, "max_iterations=8"], world)
    train(part, cache, [*common, "max_iterations=4"], world)  # saved at 3 and 4
    assert (part / "checkpoints" / "latest").read_text() == "step-4"
    train(part, cache, [*common, "max_iterations=8", "resume=true"], world)
    reference, resumed = losses(full), losses(part)
    assert sorted(resumed) == list(range(1, 9))
    assert [resumed[i] for i in range(5, 9)] == [reference[i] for i in range(5, 9)]
    assert metrics_of(part)["iterations"] == 8 and metrics_of(part)["world_size"] == world
