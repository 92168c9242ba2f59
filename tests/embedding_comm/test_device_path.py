"""The compressed all-to-all on the device code path, on real gloo ranks: the same numbers as the
host path, and host synchronisations per collective that do not grow with the rank count.

The device path (fixed-length coder, payloads framed and checked on the device, lengths read
once per collective) is what runs on a GPU; ``compression.backend=device`` runs it on CPU
tensors (the host path: ``compression.backend=host``), and
:func:`dlrm.bench.host_syncs.counted_reads` counts every host read the dispatcher cannot see there
(see there). The row cache (``compression.forward.cache``) is held to the same: its payloads read
with the collective's."""

from __future__ import annotations

from collections import Counter

import pytest
import test_comm as tc
import torch.distributed as dist
from multiprocess import SharedJob, run_ranks

DEVICE_LOSSY = {
    "name": "lossy",
    "forward": {"codec": "lossy", "eb": 1e-3, "params": {"entropy": False}},
    "backward": {"codec": "lossy", "eb": 1e-3, "params": {"entropy": False}},
    "stats": {"sample_every": 0},
}
# DCT-MP as shipped (forward keep, backward at the forward's positions); sampling off (it reads by design)
DEVICE_DCT_MP = {**tc.shipped("dct_mp"), "stats": {"sample_every": 0}}
# compression=auto as a replayed strategy sets it: every option of the shipped config, one per
# feature, and its fallback (lossy/zstd: on a device, the fixed-length coder). At a bound of 1e-3
# of each block's range, fp16 holds it and bf16 and int8 do not, so their blocks fall back: a
# choice decided on the device from the data.
_AUTO_DIR = {**tc.shipped("auto")["forward"], "eb": 1e-3}
DEVICE_AUTO = {"name": "auto", "forward": _AUTO_DIR, "backward": _AUTO_DIR, "stats": {"sample_every": 0}}
AUTO_CHOICE = {f"f_t{t}": o for t, o in enumerate(["fp16", "lossy/fixed", "none", "bf16", "int8", "lossy/zstd"])}
# the 16-bit casts as shipped (backward dedup: each id's gradient rows summed and kept on its first
# row by the transport on the host path, inside the casts' ops on the device path)
DEVICE_CASTS = {name: {**tc.shipped(name), "stats": {"sample_every": 0}} for name in ("fp16", "bf16")}
SPECS = {"lossy": (DEVICE_LOSSY, {}), "auto": (DEVICE_AUTO, AUTO_CHOICE), "dct_mp": (DEVICE_DCT_MP, {})}


CACHED = {
    **DEVICE_LOSSY,
    "name": "lossy_cached",
    # a bound near the size of the rows' SGD steps: some held rows come back within it (hits), some past it
    "forward": {**DEVICE_LOSSY["forward"], "eb": 0.5, "cache": {"enabled": True, "capacity_rows": 24}},
}
RUNS = {**SPECS, "cache": (CACHED, {}), **{n: (c, {}) for n, c in DEVICE_CASTS.items()}}  # (own tests below)


def _counted(rank: int, ws: int, plan: str, spec: str, hot: int | tuple[int, ...] = 1, steps: int = 3) -> dict:
    """``steps`` training steps on the host backend, then the same on the device backend, counted."""
    from dlrm.embedding_comm import comm_ops
    from dlrm.embedding_comm import dist as output_dists
    from dlrm.telemetry.sync_counter import HostSyncCounter

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

    def counted_receive(pg, info, d, tr):
        calls[f"{d}/receive"] += 1
        with counter.label(f"{d}/receive"):
            return receive(pg, info, d, tr)

    dists = (output_dists.CompressedTwPooledEmbeddingDist, output_dists.CompressedRwPooledEmbeddingDist)
    forwards = {cls: cls.forward for cls in dists}
    for cls in dists:
        cls.forward = counted_dist(cls.forward)
    comm_ops._send, comm_ops._receive = counted_send, counted_receive
    try:
        return _compare_paths(rank, ws, plan, spec, hot, steps, counter, calls)
    finally:  # unwrapped for the next case in this process
        comm_ops._send, comm_ops._receive = send, receive
        for cls, forward in forwards.items():
            cls.forward = forward


def _compare_paths(rank, ws, plan, spec, hot, steps, counter, calls) -> dict:
    from dlrm.bench.host_syncs import counted_reads
    from dlrm.telemetry.comm_stats import comm_stats

    runs, stored = {}, set()
    cfg, choice = RUNS[spec]
    # auto's per-table options (a header each) on a few rows code larger than the rows on the
    # device (the fixed-length coder where the host has zstd): stored there, exact; more rows
    sizes = [72, 64, 56][:ws] if spec == "auto" else [12, 9, 7][:ws]
    for path in ("host", "device"):
        sharder = tc.ours({**cfg, "backend": path})  # compression.backend: every codec's stages, the row cache's
        assert sharder.runtime.backward.codec.backend_choice == path
        sharder.runtime.forward.choice, sharder.runtime.backward.choice = dict(choice), dict(choice)
        model = tc.build(sharder, plan, ws, tc.full_weights(5))
        if path == "host":
            outs = tc.run_steps(model, rank, sizes, steps, hot=hot)
        else:
            counter.counts.clear()
            with counted_reads(counter), counter:
                outs = tc.run_steps(model, rank, sizes, steps, hot=hot)
        stats = comm_stats(model)
        cache = {k: v for k, v in stats.items() if "/cache/" in k}  # the row cache's counts
        stored.update(k for k in stats if "stored_chunks" in k)
        runs[path] = (outs, tc.local_weights(model), cache)
    same = all(a.equal(b) for a, b in zip(runs["host"][0], runs["device"][0], strict=True))
    same_w = all(runs["host"][1][k].equal(v) for k, v in runs["device"][1].items())
    # TorchRec's own (input dist, optimizer) are not ours; the send runs inside the output dist's forward
    syncs = Counter({k.removeprefix("forward/dist/"): n for k, n in counter.by_label.items() if k and n})
    same_cache = runs["host"][2] == runs["device"][2]
    return {
        "same": same,
        "same_weights": same_w,
        "syncs": syncs,
        "calls": dict(calls),
        "cache": runs["device"][2],
        "same_cache": same_cache,
        "stored": stored,  # (a stored chunk is exact: the paths would differ by their codes' sizes)
    }


DEVICE_CASES = [*((spec, "tw", 1) for spec in SPECS), ("lossy", "tw", 2), ("lossy", "rw", 1)]
CACHE_HOT = [1, (1, 1, 2, 1)]
# (plan, spec, hot, steps): every 2-rank case of the three tests below
TWO_RANK_CASES = [
    *((plan, spec, hot, 3) for spec, plan, hot in DEVICE_CASES),
    *(("tw", spec, 1, 3) for spec in sorted(DEVICE_CASTS)),
    *(("tw", "cache", hot, 4) for hot in CACHE_HOT),
]


TWO_RANKS = {case: (_counted, *case) for case in TWO_RANK_CASES}


@pytest.fixture(scope="module")
def counted():
    """The runs of _counted by (ws, case); the 2-rank cases all in one job (starting the ranks costs
    more than a case), the 3-rank ones (make test-scale) one job each as before."""
    job = SharedJob({2: TWO_RANKS})
    return lambda ws, *case: job.results(case) if ws == 2 else run_ranks(_counted, ws, *case)


# each codec with rows deduplicated by id; the lossy codec also with bags of two ids (no ids: the
# device picks the rows, by value) and with row-wise partial sums (by value)
@pytest.mark.parametrize(("spec", "plan", "hot"), DEVICE_CASES)
@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.scale)])  # 3 ranks: make test-scale
def test_device_path_gives_the_host_paths_numbers_with_one_host_sync_per_collective_side(counted, ws, spec, plan, hot):
    for r in counted(ws, plan, spec, hot, 3):
        assert not r["stored"]  # every chunk coded on both paths
        assert r["same"] and r["same_weights"]  # bit for bit: the framing moved, not the values
        calls = {k: n // 2 for k, n in r["calls"].items()}  # the device run's half
        for side, n in r["syncs"].items():
            # one read of every size (send) and one of every payload's head and check (receive),
            # whatever the number of peers: none per chunk
            assert n == calls.get(side, 0), (ws, side, n, r["syncs"])
        # nothing else: the forward reads which chunks have ids with its size exchange (no "forward/dist")
        assert set(r["syncs"]) == {"forward/send", "forward/receive", "backward/send", "backward/receive"}


@pytest.mark.parametrize("spec", sorted(DEVICE_CASTS))
def test_the_casts_sum_duplicate_ids_on_the_device_path_as_the_transport_does_on_the_host(counted, spec):
    """fp16/bf16 as shipped (backward dedup): the host path sums each id's gradient rows and keeps
    the sum on its first row in the transport's stage, the device path inside the casts' ops
    (``Codec.sums_duplicates``); outputs and trained weights are the same bit for bit, and the
    backward reads the host once a side per call (its verdicts, its ids' flags), no more."""
    for r in counted(2, "tw", spec, 1, 3):
        assert not r["stored"] and r["same"] and r["same_weights"]
        calls = {k: n // 2 for k, n in r["calls"].items()}
        assert r["syncs"]["backward/send"] == calls["backward/send"], r["syncs"]
        assert r["syncs"]["backward/receive"] == calls["backward/receive"], r["syncs"]


# bags of one id, and (ws 2) a step of bags of two ids between them: its chunks hold no ids, so
# they go through the codec by value, chosen on the device, and the caches skip that step
@pytest.mark.parametrize(
    ("ws", "hot"), [(2, CACHE_HOT[0]), pytest.param(3, 1, marks=pytest.mark.scale), (2, CACHE_HOT[1])]
)  # 3 ranks: make test-scale
def test_the_row_cache_on_the_device_path_gives_the_host_paths_numbers_with_one_host_sync_per_collective_side(
    counted, ws, hot
):
    # the cache encodes and decodes the forward itself; the backward goes through the codec
    for r in counted(ws, "tw", "cache", hot, 4):
        assert r["same"] and r["same_weights"] and r["same_cache"]
        cache = r["cache"]  # held rows came back within the bound (hits) and past it (moved)
        assert cache["comm/forward/cache/hit_rows"] > 0 and cache["comm/forward/cache/moved_rows"] > 0, cache
        calls = {k: n // 2 for k, n in r["calls"].items()}
        # none per chunk: the forward's sizes with which chunks hold ids and the cache's counts, its
        # heads with the rows each block holds; the backward (no cache) as without it
        assert r["syncs"] == calls, (ws, r["syncs"], calls)


def _fault(rank: int, ws: int, spec: dict = DEVICE_LOSSY) -> str:
    from datetime import timedelta

    from wire_tap import tap

    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    model = tc.build(tc.ours({**spec, "backend": "device"}), "tw", ws, tc.full_weights(8), pg=pg)
    tap(tc.corrupt_rank0_to_rank1)
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


def test_a_corrupted_row_cache_payload_on_the_device_path_is_named_from_the_one_read():
    errors = run_ranks(_fault, 2, CACHED, timeout=120)
    assert errors[1].startswith("CompressedCommError: rank 1 (table_wise)") and "from rank 0" in errors[1]
    assert "row-cached forward payload" in errors[1] and "iteration 1" in errors[1]
    assert "checksum mismatch (adler32)" in errors[1]
    assert errors[0] != "no error"
