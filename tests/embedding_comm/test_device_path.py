"""The compressed all-to-all on the device code path, on real gloo ranks: the same numbers as the
host path, and host synchronisations per collective that do not grow with the rank count.

The device path (fixed-length coder, payloads framed and checked on the device, lengths read
once per collective) is what runs on a GPU; :func:`dlrm.bench.host_syncs.device_paths` turns
it on for CPU tensors, and its counter sees every host read (see there)."""

from __future__ import annotations

from collections import Counter

import pytest
import test_comm as tc
import torch.distributed as dist
from multiprocess import run_ranks

DEVICE_LOSSY = {
    "name": "lossy",
    "forward": {"codec": "lossy", "eb": 1e-3, "params": {"entropy": False}},
    "backward": {"codec": "lossy", "eb": 1e-3, "params": {"entropy": False}},
    "stats": {"sample_every": 0},
}


def _counted(rank: int, ws: int, plan: str, hot: int) -> dict:
    """Three training steps on the host path, then the same on the device path, counted."""
    from dlrm.bench.host_syncs import device_paths
    from dlrm.embedding_comm import comm_ops
    from dlrm.embedding_comm import dist as output_dists
    from dlrm_compression.host_syncs import HostSyncCounter

    counter, calls = HostSyncCounter(), Counter()
    send, receive = comm_ops._send, comm_ops._receive

    def counted_send(pg, info, d, chunks):
        calls[f"{d}/send"] += 1
        with counter.label(f"{d}/send"):
            return send(pg, info, d, chunks)

    def counted_dist(forward):  # the output dist's forward: its own reads (e.g. the chunks' ids), then the send
        def run(self, *args, **kwargs):
            with counter.label("forward/dist"):
                return forward(self, *args, **kwargs)

        return run

    for cls in (output_dists.CompressedTwPooledEmbeddingDist, output_dists.CompressedRwPooledEmbeddingDist):
        cls.forward = counted_dist(cls.forward)

    def counted_receive(pg, info, d, tr):
        calls[f"{d}/receive"] += 1
        with counter.label(f"{d}/receive"):
            return receive(pg, info, d, tr)

    comm_ops._send, comm_ops._receive = counted_send, counted_receive
    runs = {}
    for path in ("host", "device"):
        model = tc.build(tc.ours(DEVICE_LOSSY), plan, ws, tc.full_weights(5))
        if path == "host":
            outs = tc.run_steps(model, rank, [12, 9, 7][:ws], 3, hot=hot)
        else:
            counter.counts.clear()
            with device_paths(counter), counter:
                outs = tc.run_steps(model, rank, [12, 9, 7][:ws], 3, hot=hot)
        runs[path] = (outs, tc.local_weights(model))
    same = all(a.equal(b) for a, b in zip(runs["host"][0], runs["device"][0], strict=True))
    same_w = all(runs["host"][1][k].equal(v) for k, v in runs["device"][1].items())
    # TorchRec's own (input dist, optimizer) are not ours; the send runs inside the output dist's forward
    syncs = Counter({k.removeprefix("forward/dist/"): n for k, n in counter.by_label.items() if k and n})
    return {"same": same, "same_weights": same_w, "syncs": syncs, "calls": dict(calls)}


# rows deduplicated by id; bags of two ids (no ids: the device picks the rows, by value); partial sums by value
@pytest.mark.parametrize(("plan", "hot"), [("tw", 1), ("tw", 2), ("rw", 1)])
@pytest.mark.parametrize("ws", [2, 3])
def test_device_path_gives_the_host_paths_numbers_with_one_host_sync_per_collective_side(ws, plan, hot):
    for r in run_ranks(_counted, ws, plan, hot):
        assert r["same"] and r["same_weights"]  # bit for bit: the framing moved, not the values
        calls = {k: n // 2 for k, n in r["calls"].items()}  # the device run's half
        for side, n in r["syncs"].items():
            # one read of every size (send) and one of every payload's head and check (receive),
            # whatever the number of peers: none per chunk
            assert n == calls.get(side, 0), (ws, side, n, r["syncs"])
        # nothing else: the forward reads which chunks have ids with its size exchange (no "forward/dist")
        assert set(r["syncs"]) == {"forward/send", "forward/receive", "backward/send", "backward/receive"}


def _fault(rank: int, ws: int) -> str:
    from datetime import timedelta

    from dlrm.bench.host_syncs import device_paths
    from dlrm.process.instrument import set_payload_hook

    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    with device_paths():
        model = tc.build(tc.ours(DEVICE_LOSSY), "tw", ws, tc.full_weights(8), pg=pg)
        set_payload_hook(tc.corrupt_rank0_to_rank1)
        try:
            tc.run_steps(model, rank, [8, 8], 3)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_corrupted_payload_on_the_device_path_is_named_from_the_one_read():
    errors = run_ranks(_fault, 2, timeout=120)
    assert errors[1].startswith("CompressedCommError: rank 1 (table_wise)") and "from rank 0" in errors[1]
    assert "tables ['t0', 't2', 't4']" in errors[1] and "iteration 1" in errors[1]
    assert "checksum mismatch (adler32)" in errors[1]
    assert errors[0] != "no error"
