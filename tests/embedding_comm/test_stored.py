"""Never more bytes than raw: a chunk whose payload would be no smaller than its rows travels
stored (the rows as they are behind an 80-byte header, still checked), on real gloo ranks, on
both backends, by id (the backward's duplicate-id sums included) and by value (row-wise partial
sums, one payload for every peer), and DCT-MP's forward positions after a stored forward.

A bound of 1e-30 makes every value an exception of the lossy codec (its payload about twice the
rows); a DCT-MP forward keeping every entry sends positions and values (more than the rows)."""

from __future__ import annotations

import pytest
import test_comm as tc
from multiprocess import SharedJob, run_ranks

TINY = {
    "name": "lossy",
    "forward": {"codec": "lossy", "eb": 1e-30},
    "backward": {"codec": "lossy", "eb": 1e-30},
    "stats": {"sample_every": 1},
}
DCT_ALL = {  # DCT-MP keeping every entry: positions and values, more than the rows
    **tc.shipped("dct_mp"),
    "forward": {**tc.shipped("dct_mp")["forward"], "params": {"keep": 1.0, "values": "none"}},
}
HEADER = 80  # a stored chunk's header (one block, one section)


def _run(rank: int, ws: int, cfg: dict, plan: str, backend: str) -> dict:
    from dlrm.telemetry.comm_stats import comm_stats

    weights = tc.full_weights(3)
    exact = tc.build(tc.ours(tc.NONE), plan, ws, weights)
    want = tc.run_steps(exact, rank, [10] * ws, 3, integer=True)  # integer gradients: sums exact in any order
    model = tc.build(tc.ours({**cfg, "backend": backend}), plan, ws, weights)
    got = tc.run_steps(model, rank, [10] * ws, 3, integer=True)
    stats = comm_stats(model)
    w_want, w_got = tc.local_weights(exact), tc.local_weights(model)
    return {
        "outputs": [(a - b).abs().max().item() for a, b in zip(want, got, strict=True)],
        "weights": max((w_want[k] - v).abs().max().item() for k, v in w_got.items()),
        "stats": stats,
    }


def _normal(rank: int, ws: int) -> dict:
    from dlrm.telemetry.comm_stats import comm_stats

    model = tc.build(tc.ours({**TINY, "forward": {"codec": "lossy", "eb": 1e-3}}), "tw", ws, tc.full_weights(3))
    tc.run_steps(model, rank, [10] * ws, 2)
    return comm_stats(model)


BACKENDS = ["host", "device"]


CASES: dict = {("tiny", plan, b): (_run, TINY, plan, b) for plan in ("tw_cw", "rw") for b in BACKENDS}
CASES |= {("dct_mp", b): (_run, DCT_ALL, "tw", b) for b in BACKENDS} | {"normal": (_normal,)}


@pytest.fixture(scope="module")
def runs() -> SharedJob:
    """Each test's run (by case), all in one job of 2 ranks: starting the ranks costs more than the runs."""
    return SharedJob({2: CASES})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("plan", "exactly"), [("tw_cw", True), ("rw", False)])
def test_a_payload_larger_than_its_rows_travels_stored(runs, plan, exactly, backend):
    results = runs["tiny", plan, backend]
    for d in ("forward", "backward"):  # (a chunk of row-wise zero partial sums codes smaller by value)
        assert any(r["stats"].get(f"comm/{d}/stored_chunks", 0) >= 1 for r in results), d
    for r in results:
        s = r["stats"]
        for d in ("forward", "backward"):
            if f"comm/{d}/raw_bytes" not in s:
                continue  # this rank sent nothing that way
            # each chunk at most its rows and the stored header (and the size word of the exchange)
            calls = s[f"comm/{d}/calls"]
            assert s[f"comm/{d}/wire_bytes"] <= s[f"comm/{d}/raw_bytes"] + (HEADER + 8) * calls, s
            assert s[f"comm/{d}/max_abs_error"] == 0.0  # what the sender checks it sent: the rows
        # the rows as they are: the run of the uncompressed path (row-wise partial sums are added
        # in another order there)
        tolerance = 0.0 if exactly else 1e-6
        assert max(r["outputs"]) <= tolerance and r["weights"] <= tolerance, r


@pytest.mark.parametrize("backend", BACKENDS)
def test_dct_mp_after_a_stored_forward_sends_every_gradient(runs, backend):
    for r in runs["dct_mp", backend]:
        s = r["stats"]
        if "comm/forward/raw_bytes" in s:
            assert s["comm/forward/stored_chunks"] >= 1, s
        assert max(r["outputs"]) == 0.0 and r["weights"] == 0.0, r  # every entry kept, both ways


def test_a_coded_payload_smaller_than_its_rows_is_sent_coded(runs):
    for s in runs["normal"]:
        if "comm/forward/raw_bytes" in s:
            assert "comm/forward/stored_chunks" not in s and s["comm/forward/ratio"] > 2, s
        assert s.get("comm/backward/stored_chunks", 0) >= 1  # the backward's bound of 1e-30: stored


def _fault(rank: int, ws: int, backend: str) -> str:
    from datetime import timedelta

    import torch.distributed as dist
    from wire_tap import tap

    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    model = tc.build(tc.ours({**TINY, "backend": backend}), "tw", ws, tc.full_weights(8), pg=pg)
    tap(tc.corrupt_rank0_to_rank1)  # one byte flipped in the rows of a stored chunk
    try:
        tc.run_steps(model, rank, [8, 8], 3)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_corrupted_stored_chunk_is_refused_and_named(backend):
    errors = run_ranks(_fault, 2, backend, timeout=120)
    assert errors[1].startswith("CompressedCommError: rank 1 (table_wise)") and "from rank 0" in errors[1]
    assert "tables ['t0', 't2', 't4']" in errors[1] and "iteration 1" in errors[1]
    assert "checksum" in errors[1], errors[1]
    assert errors[0] != "no error"
