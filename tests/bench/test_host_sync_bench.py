"""The host-sync benchmark counts a tiny chunk by stage (dlrm.bench.host_syncs)."""

import pytest
import torch

from dlrm.bench import host_syncs
from dlrm_compression import base, dedup
from dlrm_compression import format as fmt

TOLIST = torch.Tensor.tolist


def test_bench_counts_a_tiny_chunk_by_stage(capsys):
    assert host_syncs.main(["--rows", "64", "--tables", "3", "--dim", "8", "--trace"]) == 0
    out = capsys.readouterr().out
    stages = ("forward/bounds", "forward/encode", "forward/decode", "backward/sum_duplicates", "backward/keep_first")
    for stage in stages:
        assert f"\n{stage} " in out
    assert "W =  64: 63 peers" in out
    assert "compression/quantize.py:" in out  # --trace names the lines
    assert "dlrm.embedding_comm.ids:chunk_ids_of:" in out  # the static listing follows
    assert dedup.HOST_NUMPY  # the CPU shortcut is restored, and the CPU check, and the tensor methods
    assert fmt._check_for(torch.device("cpu")) == "crc32" and base.HOST_BOUNDS
    assert torch.Tensor.tolist is TOLIST


@pytest.mark.parametrize("tables", [2, 5])
def test_bounds_and_duplicate_ids_take_no_host_sync(tables):
    c = host_syncs.count_chunk(rows=32, tables=tables, dim=4)
    assert {"forward/bounds", "backward/bounds"} <= set(c.labels)  # the stage ran, counted
    assert c.by_label["forward/bounds"] == c.by_label["backward/bounds"] == 0  # was 2 per table
    # duplicate-id gradients: one sort of every table's ids, no torch.unique (was one per table each)
    assert c.by_label["backward/sum_duplicates"] == c.by_label["backward/keep_first"] == 0


def test_one_chunk_of_the_issue_syncs_by_stage_and_op():
    """2,048 rows x 13 tables x dim 64, ids, the fixed-length coder, dual policy. Was forward 41
    and backward 67 counted at the dispatcher (bounds 26, encode 7, decode 8, duplicate ids 13 +
    13), plus host reads. What is left depends on the data, and sizes the payload: encode the
    unique rows (bool_index), the packed words (item) and the exceptions (nonzero); decode reads
    the prefix and header (with the check's verdict), the counts (with what the ids say) and the
    coder's group widths."""
    c = host_syncs.count_chunk()
    want = {
        "bounds": {},
        "encode": {"bool_index": 1, "item": 1, "nonzero": 1},
        "decode": {"host_read": 3},
    }
    for d in ("forward", "backward"):
        for stage, ops in want.items():
            assert f"{d}/{stage}" in c.labels
            assert {op: n for (label, op), n in c.counts.items() if label == f"{d}/{stage}"} == ops, (d, stage)
    assert c.by_label["backward/sum_duplicates"] == c.by_label["backward/keep_first"] == 0
