"""The traffic model prices the coded input dist (compression.input=ids) within 10% of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_placement import SYNTHETIC
from trainer_runs import train


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_predicted_input_bytes_of_the_coded_input_match_the_run(tmp_path, cache, sharding):
    run_dir = tmp_path / "run"
    train(run_dir, cache, [*SYNTHETIC, f"sharding={sharding}", "compression=lossy", "compression.input=ids"])
    m = json.loads((run_dir / "metrics.json").read_text())
    measured, predicted = m["wire_bytes_by_path"]["input"], m["predicted_wire_bytes_by_path"]["input"]
    # TorchRec's int64 ids and int32 lengths would be 12 bytes a lookup: 26 x 256 x 12 per rank
    assert 0 < measured < 2 * 26 * 256 * 12 / 4
    assert predicted == pytest.approx(measured, rel=0.1)
