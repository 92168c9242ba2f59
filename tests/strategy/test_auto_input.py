"""compression.input=auto through the trainer (2 gloo ranks): the strategy decides whether the
input all-to-all codes its ids, every rank switches at the same batch, and training is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_artifacts import scalars
from trainer_runs import losses, train

from dlrm.embedding_comm.config import parse_compression_cfg

FEATURES = [f"cat_{i}" for i in range(26)]
NONE = {f"{d}/{f}": "none" for d in ("forward", "backward") for f in FEATURES}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_auto_on_the_loopback_leaves_the_input_raw_and_trains_as_with_input_none(tmp_path, cache):
    common = [
        "compression=auto",
        "compression.strategy.calibrate_iterations=2",
        "compression.strategy.measure_iterations=2",
        "max_iterations=8",
        "loss_log=true",
        "policy=fixed",
    ]
    run = tmp_path / "auto"
    train(run, cache, common)  # compression.input: auto (auto.yaml's default)
    plan = json.loads((run / "strategy.json").read_text())["plans"][0]
    unit = next(u for u in plan["units"] if u["name"] == "input")
    coded = next(o for o in unit["options"] if o["name"] == "ids")
    assert unit["stage"] == "input" and unit["raw_bytes"] > 0 and coded["ratio"] > 2  # measured on the side
    # the loopback moves the raw input in a fraction of the iteration's idle link time: no coding
    assert plan["choice"]["input"] == "none" and plan["fallback"]["input"] == "none"
    m = json.loads((run / "metrics.json").read_text())
    assert "input: none" in m["strategy"]
    sent = scalars(run, "comm/input/")
    assert sent["comm/input/wire_bytes"] == sent["comm/input/raw_bytes"]  # raw all the way
    # the same plan replayed with the input dist stock (compression.input=none): the same losses
    replay = tmp_path / "replay"
    train(replay, cache, [*common, "compression.input=none", f"compression.strategy_file={run / 'strategy.json'}"])
    assert losses(replay) == losses(run) and len(losses(run)) == 8


def test_a_plan_that_codes_the_input_switches_every_rank_at_one_batch_and_trains_bit_identically(tmp_path, cache):
    """From iteration 3 the plan says ``ids``: TorchRec's pipeline has the next batch's input dist
    in flight, which still travels raw; every call started after the switch travels coded."""
    common = ["compression=auto", "max_iterations=8", "loss_log=true", "policy=fixed", "sharding=table_wise"]
    plans = {
        "raw": [{"calibrated_from": 0, "from_iteration": 0, "choice": {**NONE, "input": "none"}}],
        "switch": [
            {"calibrated_from": 0, "from_iteration": 0, "choice": {**NONE, "input": "none"}},
            {"calibrated_from": 3, "from_iteration": 3, "choice": {**NONE, "input": "ids"}},
        ],
    }
    got = {}
    for name, saved in plans.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"plans": saved}))
        train(tmp_path / name, cache, [*common, f"compression.strategy_file={tmp_path / f'{name}.json'}"])
        got[name] = (losses(tmp_path / name), scalars(tmp_path / name, "comm/input/"))
    (ref, raw), (switched, coded) = got["raw"], got["switch"]
    assert switched == ref and len(ref) == 8  # lossless: the same batches reach the tables
    before, after = coded["comm/input/wire_bytes"], raw["comm/input/wire_bytes"]
    assert set(before) == set(after)
    early = [it for it in before if it <= 3]
    late = [it for it in before if it >= 5]
    assert early and late
    assert all(before[it] == after[it] for it in early)  # raw until the switch
    assert all(0 < before[it] < after[it] / 4 for it in late), (before, after)  # coded after it
    metrics = json.loads((tmp_path / "switch" / "metrics.json").read_text())
    assert "input: ids" in metrics["strategy"]


def test_input_auto_needs_the_strategy():
    with pytest.raises(ValueError, match=r"compression.input=auto is decided by compression=auto"):
        parse_compression_cfg(
            {"name": "x", "input": "auto", "forward": {"codec": "lossy"}, "backward": {"codec": "lossy"}}
        )
    spec = parse_compression_cfg(
        {"name": "a", "input": "auto", "forward": {"codec": "per_block"}, "backward": {"codec": "per_block"}}
    )
    assert spec.input == "auto" and spec.auto
