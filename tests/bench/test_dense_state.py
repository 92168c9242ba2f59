"""dlrm.bench.dense_state on real 2-rank runs: DCT leaves most MLP entries unmoved by Adagrad and
its residual norm agrees with the hook's own per-rank figure in TensorBoard."""

from __future__ import annotations

import math

from run_artifacts import scalars
from trainer_runs import train

from dlrm.bench.dense_state import summary


def test_dct_moves_fewer_entries_and_reports_its_residuals(tmp_path):
    cache = tmp_path / "cache"
    common = ["max_iterations=4", "log_every=1", "seed=2"]
    train(tmp_path / "none", cache, [*common, "compression=none"])
    dct = ["dense_comm=dct", "dense_comm.keep=0.05", "dense_comm.min_numel=1"]
    train(tmp_path / "dct", cache, [*common, "compression=none", *dct])
    plain, sparse = summary(tmp_path / "none"), summary(tmp_path / "dct")
    assert plain["moved_share"] > 0.5 and plain["residual_norm"] == 0.0
    assert sparse["moved_share"] < plain["moved_share"] / 2
    # the hook logs the largest rank's residual norm: the total over 2 ranks is between it and sqrt(2) x it
    largest = scalars(tmp_path / "dct", "comm/dense/residual_norm")["comm/dense/residual_norm"][4]
    assert largest > 0 and largest * (1 - 1e-5) <= sparse["residual_norm"] <= math.sqrt(2) * largest * (1 + 1e-5)
