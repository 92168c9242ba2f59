"""The model's bytes per rank against runs at several world sizes (python -m dlrm.bench.model_check),
on run directories written here with hand-counted bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlrm.bench import model_check


def _run(root: Path, name: str, ws: int, compression: str, by_path: dict[str, float]) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("batch_size: 10\nmodel:\n  embedding_dim: 4\n")
    plan = {f"t{i}": "table_wise ranks=[0]" for i in range(3)}  # 3 tables
    metrics = {"world_size": ws, "compression": compression, "dense_comm": "none", "sharding_plan": plan}
    (run / "metrics.json").write_text(json.dumps({**metrics, "wire_bytes_by_path": by_path}))
    return run


def test_uncompressed_bytes_scale_as_each_rank_keeps_its_own_samples(tmp_path, capsys):
    # W = 4: a rank sends 3/4 of 10 samples x 3 tables x dim 4 x 4 B = 360 B per direction, and
    # 3/4 x 10 x 3 x 12 B = 270 B of ids and lengths; all 4 ranks: 1,440 and 1,080
    run = _run(tmp_path, "w4", 4, "none", {"forward": 1440, "backward": 1500, "input": 1080})
    rows = {r["path"]: r for r in model_check.report([run])}
    assert rows["forward"]["predicted"] == pytest.approx(360) and rows["forward"]["error"] == pytest.approx(0)
    assert rows["backward"]["error"] == pytest.approx(360 / 375 - 1)
    assert rows["input"]["predicted"] == pytest.approx(270)
    assert model_check.main([str(run)]) == 0
    assert "| none+none | 4 | forward | 360 | 360 | +0.0% |" in capsys.readouterr().out


def test_a_compressed_run_is_predicted_from_the_smallest_runs_ratio(tmp_path):
    # W = 2 sends 120 B per rank forward (raw 240: ratio 2); W = 4 raw 360 -> 180 predicted
    ref = _run(tmp_path, "w2", 2, "lossy", {"forward": 240, "backward": 240, "input": 360})
    big = _run(tmp_path, "w4", 4, "lossy", {"forward": 4 * 200, "backward": 4 * 180, "input": 1080})
    rows = {(r["ws"], r["path"]): r for r in model_check.report([big, ref])}
    assert rows[(2, "forward")]["reference"] and rows[(2, "forward")]["error"] == pytest.approx(0)
    assert rows[(4, "forward")]["predicted"] == pytest.approx(180)
    assert rows[(4, "forward")]["error"] == pytest.approx(180 / 200 - 1)
    assert rows[(4, "input")]["predicted"] == pytest.approx(270)


def test_a_directory_without_metrics_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        model_check.main([str(tmp_path)])
    assert f"{tmp_path}: no metrics.json" in capsys.readouterr().err
