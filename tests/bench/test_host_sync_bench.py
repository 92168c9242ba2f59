"""The host-sync benchmark counts a tiny chunk by stage (dlrm.bench.host_syncs)."""

import pytest
import torch

from data.layout import SPARSE_NAMES
from dlrm.bench import host_syncs
from dlrm_compression.backend import DEVICE, HOST, backend_for

TOLIST = torch.Tensor.tolist


def test_bench_counts_a_tiny_chunk_by_stage(capsys):
    assert host_syncs.main(["--rows", "64", "--tables", "3", "--dim", "8", "--trace"]) == 0
    out = capsys.readouterr().out
    # (the codec sums the backward's duplicate-id rows and keeps their first itself: no stage of its own)
    stages = ("forward/bounds", "forward/encode", "forward/decode", "backward/encode", "backward/decode")
    for stage in stages:
        assert f"\n{stage} " in out
    assert "W =  64: 63 peers" in out
    assert "compression/format.py:" in out  # --trace names the lines
    assert "dlrm.embedding_comm.ids:chunk_ids_of:" in out  # the static listing follows
    assert torch.Tensor.tolist is TOLIST  # counted_reads restores the tensor methods


def test_the_bench_counts_the_device_backend_on_cpu_tensors_and_changes_no_default():
    cpu = torch.device("cpu")
    assert backend_for(cpu) is HOST and backend_for(cpu, "device") is DEVICE  # a CPU's default: the host's
    features = SPARSE_NAMES[:3]
    for dc in host_syncs.codecs(features, 8).values():  # the bench's codecs: the device's code
        assert dc.codec.backend_choice == "device" and dc.codec.backend_for(cpu) is DEVICE
    for dc in host_syncs.codecs(features, 8, backend="auto").values():  # as the trainer builds them on a CPU
        assert dc.codec.backend_for(cpu) is HOST
    host_syncs.count_chunk(rows=32, tables=3, dim=4)
    assert backend_for(cpu) is HOST  # nothing global flipped by a count


@pytest.mark.parametrize("tables", [2, 5])
def test_bounds_and_duplicate_ids_take_no_host_sync(tables):
    c = host_syncs.count_chunk(rows=32, tables=tables, dim=4)
    assert {"forward/bounds", "backward/bounds"} <= set(c.labels)  # the stage ran, counted
    assert c.by_label["forward/bounds"] == c.by_label["backward/bounds"] == 0  # was 2 per table
    # duplicate-id gradients: one sort of every table's ids, no torch.unique (was one per table each)
    assert "backward/sum_duplicates" not in c.labels and "backward/keep_first" not in c.labels  # in the codec


def test_one_chunk_of_the_issue_syncs_by_stage_and_op():
    """2,048 rows x 13 tables x dim 64, ids, the fixed-length coder, dual policy. Was forward 41
    and backward 67 per chunk counted at the dispatcher (bounds 26, encode 7, decode 8, duplicate
    ids 13 + 13), plus host reads; then 6 per chunk (the sizes the data decides). Now nothing per
    chunk: the payload is framed with its lengths on the device and the collective reads every
    length once (the size exchange), and every received head, check and ids count once."""
    c = host_syncs.count_chunk(peers=2)
    for d in ("forward", "backward"):
        for stage in ("bounds", "encode", "decode"):
            assert c.by_label[f"{d}/{stage}"] == 0, (d, stage, c.counts)
        assert c.by_label[f"{d}/size_exchange"] == c.by_label[f"{d}/heads"] == 1
    assert "backward/sum_duplicates" not in c.labels and "backward/keep_first" not in c.labels  # in the codec


def test_syncs_per_collective_do_not_grow_with_the_peers():
    one, three = (
        host_syncs.per_direction(host_syncs.count_chunk(rows=64, tables=3, dim=8, peers=p), p) for p in (1, 3)
    )
    assert one == three == {"forward": (0, 2), "backward": (0, 2)}
