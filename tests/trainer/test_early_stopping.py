"""Early stopping on validation AUC: the rule alone, then through the 2-rank trainer (stop, best
checkpoint kept and tested, resume stays stopped, off leaves training unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_artifacts import scalars
from trainer_runs import losses, train

from dlrm.trainer.early_stopping import EarlyStopping


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_stops_after_patience_evaluations_without_a_better_auc():
    stop = EarlyStopping(patience=2, min_delta=0.01)
    assert stop.observe(0.70, 10) and not stop.stopped  # the first pass is the best so far
    assert stop.observe(0.72, 20)
    assert not stop.observe(0.725, 30) and not stop.stopped  # +0.005 is within min_delta
    assert not stop.observe(None, 40) and stop.stopped  # an undefined AUC never improves
    assert stop.metrics(tested_on_best=True) == {
        "best_val_auc": 0.72,
        "best_iteration": 20,
        "stopped_iteration": 40,
        "tested_on": "best",
    }


def test_an_equal_auc_is_no_improvement():
    # lr 0 gives the same AUC at every pass: that must count as no progress
    stop = EarlyStopping(patience=1)
    assert stop.observe(0.7, 1) and not stop.observe(0.7, 2) and stop.stopped


def test_state_round_trips_through_a_checkpoint_dict():
    stop = EarlyStopping(patience=3)
    stop.observe(0.6, 5)
    stop.observe(0.5, 10)
    again = EarlyStopping(patience=3)
    again.load_state_dict(json.loads(json.dumps(stop.state_dict())))
    assert (
        again.state_dict()
        == stop.state_dict()
        == {
            "best_auc": 0.6,
            "best_iteration": 5,
            "since_best": 1,
            "stopped_iteration": None,
        }
    )


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"patience": -1}, "early_stopping.patience must be an integer >= 0, got -1"),
        ({"patience": 2.5}, "early_stopping.patience must be an integer >= 0"),
        ({"patience": 2, "min_delta": "x"}, "early_stopping.min_delta must be a number"),
        ({"patience": 2, "metric": "loss"}, "early_stopping: unknown key(s) ['metric']"),
    ],
)
def test_bad_settings_name_the_key(cfg, message):
    with pytest.raises(ValueError) as e:
        EarlyStopping.from_config(cfg)
    assert message in str(e.value)


def test_off_by_default():
    assert EarlyStopping.from_config({"patience": 0, "min_delta": 0.0}) is None


def test_trainer_stops_keeps_the_best_checkpoint_and_tests_it(tmp_path, cache):
    # min_delta 0.5: no pass after the first can improve, so the best is iteration 2 and training
    # stops 2 passes later (iteration 6) while the weights keep moving.
    common = ["eval_every=2", "loss_log=true", "data.shuffle=false", "seed=3"]
    stopping = [*common, "max_iterations=40", "early_stopping.patience=2", "early_stopping.min_delta=0.5"]
    run, plain, at_best = tmp_path / "stop", tmp_path / "plain", tmp_path / "at_best"
    train(run, cache, stopping)
    train(plain, cache, [*common, "max_iterations=6"])  # off: the same 6 iterations, tested on their end
    train(at_best, cache, [*common, "max_iterations=2"])  # the best step's weights, tested
    got, off, best = (json.loads((d / "metrics.json").read_text()) for d in (run, plain, at_best))
    val = scalars(run, "eval/auc")["eval/auc"]
    assert sorted(val) == [2, 4, 6] and got["best_val_auc"] == pytest.approx(val[2], abs=1e-6)
    assert got["iterations"] == got["stopped_iteration"] == 6 and got["best_iteration"] == 2
    assert got["tested_on"] == "best"
    assert [p.name for p in (run / "checkpoints" / "best").glob("step-*")] == ["step-2"]
    assert losses(run) == losses(plain)  # saving the best changes nothing in training
    assert got["auc"] == best["auc"] and got["logloss"] == best["logloss"]  # tested on iteration 2's weights
    assert got["auc"] != off["auc"]  # ... not on the last ones
    assert "best_iteration" not in off and not (plain / "checkpoints" / "best").exists()
    train(run, cache, stopping)  # resumed: it stays stopped and tests the same weights
    again = json.loads((run / "metrics.json").read_text())
    assert again["iterations"] == 6 and again["auc"] == got["auc"]
