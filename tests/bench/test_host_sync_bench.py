"""The host-sync benchmark counts a tiny chunk by stage (dlrm.bench.host_syncs)."""

import pytest

from compression import dedup
from dlrm.bench import host_syncs


def test_bench_counts_a_tiny_chunk_by_stage(capsys):
    assert host_syncs.main(["--rows", "64", "--tables", "3", "--dim", "8", "--trace"]) == 0
    out = capsys.readouterr().out
    stages = ("forward/bounds", "forward/encode", "forward/decode", "backward/sum_duplicates", "backward/keep_first")
    for stage in stages:
        assert f"\n{stage} " in out
    assert "W =  64: 63 peers" in out
    assert "compression/quantize.py:" in out  # --trace names the lines
    assert "dlrm.embedding_comm.ids:chunk_ids:" in out  # the static listing follows
    assert dedup.HOST_NUMPY  # the CPU shortcut is restored


@pytest.mark.parametrize("tables", [2, 5])
def test_bounds_and_duplicate_ids_take_no_host_sync(tables):
    c = host_syncs.count_chunk(rows=32, tables=tables, dim=4)
    assert {"forward/bounds", "backward/bounds"} <= set(c.labels)  # the stage ran, counted
    assert c.by_label["forward/bounds"] == c.by_label["backward/bounds"] == 0  # was 2 per table
    # duplicate-id gradients: one sort of every table's ids, no torch.unique (was one per table each)
    assert c.by_label["backward/sum_duplicates"] == c.by_label["backward/keep_first"] == 0
