"""compression.forward.cache: the sender's mirror and the receiver's cache, codec level and in
real 2-rank training runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm.embedding_comm import fixed_bound
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.config import DirectionSpec
from dlrm.embedding_comm.forward_cache import ForwardCache


def _contents(fc: ForwardCache, role: str) -> dict:
    return {
        k[2:]: (c.ids(), c.rows(torch.tensor(c.ids(), dtype=torch.int64)))
        for k, c in sorted(fc.caches.items())
        if k[0] == role
    }


def test_receiver_decodes_within_the_bound_and_holds_what_the_sender_mirrors():
    widths, feats = [8, 8, 4], ["a", "b", "c"]
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(0.01))
    g = torch.Generator().manual_seed(0)
    tables = [torch.randn(50, w, generator=g) for w in widths]
    sender, receiver = ForwardCache(capacity_rows=16), ForwardCache(capacity_rows=16)
    plain = cached = 0
    for step in range(30):
        ids = torch.randint(0, 50, (32, 3), generator=g)
        tables[0] += 0.004 * torch.randn(50, 8, generator=g)  # a: mostly within the bound
        tables[1] += 0.05 * torch.randn(50, 8, generator=g)  # b: mostly past it (differences)
        chunk = torch.cat([t[ids[:, k]] for k, t in enumerate(tables)], dim=1)
        if step == 7:
            chunk[3, 2] = float("nan")  # non-finite values travel exactly, whole
        bounds = [0.01, 0.01, 0.0 if step == 9 else 0.01]  # a zero bound: exact, no differences
        payload, mine, _ = sender.encode(dc, chunk, ids, feats, widths, bounds, dst=1)
        got = receiver.decode(dc, payload, ids, feats, widths, src=0)
        assert torch.equal(got.nan_to_num(7.0), mine.nan_to_num(7.0))
        c = 0
        for k, w in enumerate(widths):
            err = (got[:, c : c + w] - chunk[:, c : c + w]).abs().nan_to_num(0.0)
            assert float(err.max()) <= bounds[k], (step, k)
            c += w
        assert _contents(sender, "send").keys() == _contents(receiver, "recv").keys()
        for key, (sid, srows) in _contents(sender, "send").items():
            rid, rrows = _contents(receiver, "recv")[key]
            assert sid == rid and torch.equal(srows.nan_to_num(7.0), rrows.nan_to_num(7.0)), (step, key)
            assert len(sid) <= 16
        plain += dc.encode(chunk, widths, bounds, ids).numel()
        cached += payload.numel()
    assert cached < plain  # the cache pays on these drifting rows


def _roundtrip(sender: ForwardCache, receiver: ForwardCache, dc, chunk, ids, widths, bounds):
    feats = [f"t{k}" for k in range(len(widths))]
    payload, mine, counts = sender.encode(dc, chunk, ids, feats, widths, bounds, dst=1)
    got = receiver.decode(dc, payload, ids, feats, widths, src=0)
    assert torch.equal(got.nan_to_num(7.0), mine.nan_to_num(7.0))
    for key, (sid, srows) in _contents(sender, "send").items():
        rid, rrows = _contents(receiver, "recv")[key]
        assert sid == rid and torch.equal(srows.nan_to_num(7.0), rrows.nan_to_num(7.0)), key
    return got, counts


def _within(got: torch.Tensor, exact: torch.Tensor, bound: float) -> bool:
    """Every element within the bound, and non-finite values exactly where they were."""
    same = (got == exact) | (got.isnan() & exact.isnan())
    return bool((same | ((got - exact).abs() <= bound)).all())


def test_rows_next_to_nan_held_rows_stay_within_the_bound_and_nan_rows_are_always_resent():
    nan, eb = float("nan"), 0.01
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(eb))
    sender, receiver = ForwardCache(), ForwardCache()
    ids = torch.tensor([[0, 0], [1, 1], [2, 2]])
    steps = [
        [[nan, 1.0, 5.0, 5.0], [2.0, 3.0, 5.0, 5.0], [4.0, 4.0, 5.0, 5.0]],  # NaN held from now on
        [[0.5, 1.0, 5.0, 5.0], [2.0, 3.0, 5.0, 5.0], [4.0, 4.5, 5.0, 5.0]],  # finite again; row 2 moved
        [[nan, 1.0, 5.0, 5.0], [2.0, 3.5, 5.0, 5.0], [4.0, 4.5, 5.0, 5.0]],
        [[nan, 1.0, 5.0, 5.0], [2.0, 3.5, 5.0, 5.0], [4.0, 4.5, 5.0, 5.0]],  # unchanged NaN row: resent
        [[0.5, 1.0, nan, 5.0], [2.0, 3.0, 5.0, 5.0], [4.0, 4.0, 5.0, 5.0]],
    ]
    for step, rows in enumerate(steps):
        chunk = torch.tensor(rows)
        got, counts = _roundtrip(sender, receiver, dc, chunk, ids, [2, 2], [eb, eb])
        assert _within(got, chunk, eb), (step, got.tolist())
        nan_rows = sum(int(chunk[:, c : c + 2].isnan().any(dim=1).sum()) for c in (0, 2))
        if step:  # every id is held from step 1: the NaN rows are never hits
            assert counts["hit_rows"] <= counts["unique_rows"] - nan_rows, step


def test_a_chunk_with_zero_rows_passes_and_changes_no_cache():
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(0.01))
    widths = [8, 4, 8]
    sender, receiver = ForwardCache(capacity_rows=4), ForwardCache(capacity_rows=4)
    g = torch.Generator().manual_seed(5)
    tables = [torch.randn(10, w, generator=g) for w in widths]
    for rows in (6, 0, 6, 0):
        ids = torch.randint(0, 10, (rows, 3), generator=g)
        chunk = torch.cat([t[ids[:, k]] for k, t in enumerate(tables)], dim=1)  # equal ids, equal rows
        before = _contents(sender, "send")
        got, counts = _roundtrip(sender, receiver, dc, chunk, ids, widths, [0.01] * 3)
        assert got.shape == (rows, sum(widths)) and _within(got, chunk, 0.01)
        if rows == 0:
            assert counts["unique_rows"] == 0
            after = _contents(sender, "send")
            assert after.keys() == before.keys() and all(after[k][0] == before[k][0] for k in after)


def test_a_chunk_that_is_not_fp32_is_refused_naming_the_key():
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(0.01))
    ids = torch.arange(6).reshape(3, 2)
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(TypeError, match=r"compression\.forward\.cache"):
            ForwardCache().encode(dc, torch.zeros(3, 8, dtype=dtype), ids, ["a", "b"], [4, 4], [0.01] * 2, 1)


def _allocated(fc: ForwardCache) -> int:
    """Every tensor the caches hold, summed apart from ForwardCache.nbytes: each structure's rows
    and index, less its spare row (row 0 and its tick, which no id holds), the index's end key
    and, where its blocks differ in width, the padding of the narrower ones' rows."""
    total = 0
    for g in fc.groups.values():
        total += sum(v.nbytes for v in vars(g).values() if isinstance(v, torch.Tensor | np.ndarray))
        item = g._rows.element_size()
        padding = sum(a * (g.dim - w) * item for a, w in zip(g._alloc, g.widths, strict=True))
        total -= g._rows.shape[1] * item + 8 + 16 + padding
    return total


CACHED = {
    "name": "lossy_cached",
    "forward": {"codec": "lossy", "eb": 2e-3, "cache": {"enabled": True, "capacity_rows": 24}},
    "backward": {"codec": "lossy", "eb": 1e-3},
    "stats": {"sample_every": 1},
}


def _cached_training(rank: int, ws: int) -> dict:
    import torch.distributed as dist
    from test_comm import (
        FEATURES,
        batch,
        build,
        columns,
        full_weights,
        gather_weights,
        grad_weights,
        ours,
        reference_out,
    )

    from dlrm.telemetry.comm_stats import comm_stats

    sharder = ours(CACHED)
    model = build(sharder, "tw_cw", ws, full_weights())
    fc = sharder.runtime.forward_cache
    worst = 0.0
    for step in range(12):
        w = gather_weights(model)
        kjt = batch(rank, step % 3, 16)  # ids come back every 3 steps
        out = model(kjt)
        ref = reference_out(w, kjt)
        for f in FEATURES:
            err = float((out.detach()[:, columns(f)].double() - ref[:, columns(f)].double()).abs().max())
            assert err <= 2e-3 * (1 + 1e-6), f"rank {rank} step {step} {f}: {err}"
            worst = max(worst, err / 2e-3)
        # every other step trains nothing, so rows come back unchanged (hits) as well as moved
        scale = 1.0 if step % 2 == 0 else 0.0
        (out * grad_weights(rank, step, 16) * scale).sum().backward()
        # what every sender mirrors for a peer is what that peer holds from it
        mine = {k: (c.ids(), c.rows(torch.tensor(c.ids(), dtype=torch.int64))) for k, c in fc.caches.items()}
        everyone: list = [None] * ws
        dist.all_gather_object(everyone, mine)
        for (role, peer, f, k), (ids, rows) in mine.items():
            if role == "send":
                theirs = everyone[peer][("recv", rank, f, k)]
                assert ids == theirs[0] and torch.equal(rows, theirs[1]), (step, f, k)
                assert len(ids) <= 24
    stats = comm_stats(model, reset=False)
    # evaluation neither uses nor changes the caches
    before = {k: c.ids() for k, c in fc.caches.items()}
    with torch.no_grad():
        model(batch(rank, 5, 16))
    assert {k: c.ids() for k, c in fc.caches.items()} == before
    return {"worst": worst, "stats": stats, "allocated": _allocated(fc)}


def test_two_ranks_bound_held_and_mirrors_equal_caches_every_iteration():
    from multiprocess import run_ranks

    results = run_ranks(_cached_training, 2)
    for r in results:
        s = r["stats"]
        assert r["worst"] > 0.1  # errors really there
        # rows came back unchanged (hits) and moved (differences); evicted ones came back fresh
        assert s["comm/forward/cache/hit_rows"] > 0 and s["comm/forward/cache/moved_rows"] > 0
        assert s["comm/forward/cache/held_rows"] < s["comm/forward/cache/unique_rows"]
        assert r["stats"]["comm/forward/max_error_over_bound"] <= 1.0
        # the memory allocated (row tables at their capacity, index arrays), counted apart
        assert r["stats"]["comm/forward/cache_bytes"] == r["allocated"] > 0


def test_cache_is_refused_where_it_cannot_apply():
    from dlrm.embedding_comm.config import excluded_sharding_types, parse_compression_cfg
    from dlrm.trainer.sharding import check_supported

    base = {"forward": {"codec": "lossy"}, "backward": {"codec": "lossy"}}
    on = {"enabled": True}
    assert parse_compression_cfg({**base, "forward": {"codec": "lossy", "cache": on}}).forward.cache_rows == 0
    with pytest.raises(ValueError, match=r"compression\.backward\.cache"):
        parse_compression_cfg({**base, "backward": {"codec": "lossy", "cache": on}})
    with pytest.raises(ValueError, match=r"compression\.forward\.cache needs"):
        parse_compression_cfg({**base, "forward": {"codec": "fp16", "cache": on}})
    # row-wise sharding sends partial sums (no ids): the planner is kept off it, a config that
    # names it is refused, naming the keys
    cached = {**base, "forward": {"codec": "lossy", "cache": on}}
    spec = parse_compression_cfg(cached)
    assert "table_wise" in spec.sharding_types and not {"row_wise", "table_row_wise"} & set(spec.sharding_types)
    with pytest.raises(ValueError, match=r"compression\.forward\.cache cannot apply to \['row_wise'\]"):
        parse_compression_cfg({**cached, "sharding_types": ["table_wise", "row_wise"]})
    with pytest.raises(ValueError, match=r"sharding\.type=row_wise cannot be used with compression\.forward\.cache"):
        check_supported({"type": "row_wise"}, spec.sharding_types, excluded_sharding_types(spec))
    with pytest.raises(ValueError, match=r"sharding\.type=row_wise is not among .*compression\.sharding_types"):
        check_supported({"type": "row_wise"}, ("table_wise",))
    check_supported({"type": "planner"}, spec.sharding_types, excluded_sharding_types(spec))
    with pytest.raises(ValueError, match=r"compression\.forward\.cache\.capacity_rows"):
        parse_compression_cfg({**base, "forward": {"codec": "lossy", "cache": {"enabled": True, "capacity_rows": -2}}})


CACHED_RUN = ["loss_log=true", "sharding=table_wise", "compression.forward.cache.enabled=true", "max_iterations=12"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[Path, Path]:
    """(data cache, run dir) of the uninterrupted cached run both resume tests compare with: trained once."""
    from trainer_runs import train

    cache, plain = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("plain")
    train(plain, cache, CACHED_RUN)  # saves only at the end
    return cache, plain


def test_checkpoints_leave_the_cached_training_unchanged_and_resume_exact(tmp_path, plain):
    from trainer_runs import losses, train

    cache, plain_run = plain
    saved, part = tmp_path / "saved", tmp_path / "part"
    common = [*CACHED_RUN, "checkpoint.every=4"]
    train(saved, cache, common)
    train(part, cache, [*common, "max_iterations=6"])  # saved at 4 and 6
    train(part, cache, [*common, "resume=true"])
    reference = losses(plain_run)
    assert losses(saved) == reference
    assert losses(part) == reference


def test_resumed_run_repeats_the_uninterrupted_one_with_the_cache(tmp_path, plain):
    import json

    from trainer_runs import losses, train

    cache, full = plain
    part = tmp_path / "part"
    common = [*CACHED_RUN, "checkpoint.every=5"]
    train(part, cache, [*common, "max_iterations=5"])
    train(part, cache, [*common, "max_iterations=12", "resume=true"])
    reference, resumed = losses(full), losses(part)
    assert [resumed[i] for i in range(6, 13)] == [reference[i] for i in range(6, 13)]
    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["cache_bytes_per_rank"] > 0 and metrics["max_abs_error_seen"] > 0
    # the cache reports under its own names, not the probe's
    assert 0 < metrics["cache_hit_share"] <= metrics["cache_held_share"] < 1
    assert not [k for k in metrics if "probe" in k], metrics
