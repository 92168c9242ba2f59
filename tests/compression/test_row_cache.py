"""The row cache (deterministic LRU by id) and the probe that measures what a forward row cache
would save (compression.stats.cache_probe), against brute-force references."""

from __future__ import annotations

import io
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch
from trainer_runs import losses, train

from dlrm.embedding_comm import fixed_bound
from dlrm.embedding_comm.cache_probe import CacheProbe
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.config import DirectionSpec, parse_compression_cfg
from dlrm.embedding_comm.stats import CommStats, derive
from dlrm_compression.row_cache import RowCache


def test_eviction_drops_the_least_recently_stored_ids_smallest_id_first_within_a_call():
    c = RowCache(2, capacity_rows=3)
    c.store(torch.tensor([9, 5, 1]), torch.arange(6.0).view(3, 2))  # one call: recency 1 < 5 < 9
    assert c.ids() == [1, 5, 9]
    c.store(torch.tensor([1]), torch.tensor([[2.0, 3.0]]))  # 5 < 9 < 1
    c.store(torch.tensor([7]), torch.tensor([[7.0, 7.0]]))  # 4 held: 5 goes
    assert c.ids() == [9, 1, 7]
    held, rows = c.lookup(torch.tensor([1, 5, 7]))
    assert held.tolist() == [True, False, True]
    assert rows.tolist() == [[2.0, 3.0], [0.0, 0.0], [7.0, 7.0]]
    c.store(torch.tensor([4, 2, 8, 6]), torch.zeros(4, 2))  # more than the capacity: 2 is not kept
    assert c.ids() == [4, 6, 8]
    with pytest.raises(ValueError, match="capacity_rows"):
        RowCache(2, capacity_rows=-1)


class ReferenceLRU:
    """The documented rule, one id at a time: a store makes its ids the most recent in ascending
    order, then the least recent go while more than ``capacity`` are held."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.rows = capacity, OrderedDict()

    def store(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        for i, r in sorted(zip(ids.tolist(), rows.unbind(0), strict=True), key=lambda p: p[0]):
            self.rows[i] = r.clone()
            self.rows.move_to_end(i)
        while self.capacity and len(self.rows) > self.capacity:
            self.rows.popitem(last=False)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)  # NaN payloads compared bit for bit


@pytest.mark.parametrize("capacity", [0, 1, 7, 40])
def test_vectorised_cache_matches_a_one_id_at_a_time_lru_over_random_streams(capacity):
    g = torch.Generator().manual_seed(capacity)
    widths = [8, 4, 8]  # one cache per table block, each of its own width
    caches = [RowCache(w, capacity_rows=capacity) for w in widths]
    refs = [ReferenceLRU(capacity) for _ in widths]
    for step in range(60):
        for w, cache, ref in zip(widths, caches, refs, strict=True):
            n = int(torch.randint(0, 60, (1,), generator=g))  # empty calls and calls past the capacity too
            ids = torch.randperm(90, generator=g)[:n] * 1000003  # unsorted, spread ids
            rows = torch.randn(n, w, generator=g)
            rows[torch.rand(n, w, generator=g) < 0.05] = float("nan")
            slots, held = cache.find(ids)
            expect_held = [i in ref.rows for i in ids.tolist()]
            assert held.tolist() == expect_held and bool((slots[held] >= 0).all()) and bool((slots[~held] == -1).all())
            if held.any():  # what is held reads back exactly, NaN included
                want = torch.stack([ref.rows[i] for i in ids[held].tolist()])
                assert torch.equal(_bits(cache.gather(slots)[held]), _bits(want))
            cache.store(ids, rows, slots if step % 2 else None)
            ref.store(ids, rows)
            assert cache.ids() == list(ref.rows), (capacity, step)
            assert len(cache) == len(ref.rows) <= (capacity or 10**9)
            if ref.rows:
                held_rows = cache.rows(torch.tensor(list(ref.rows)))
                assert torch.equal(_bits(held_rows), _bits(torch.stack(list(ref.rows.values()))))


def test_zero_rows_change_nothing():
    c = RowCache(4, capacity_rows=3)
    c.store(torch.tensor([3, 1]), torch.ones(2, 4))
    slots, held = c.find(torch.empty(0, dtype=torch.int64))
    assert slots.shape == held.shape == (0,) and c.gather(slots).shape == (0, 4)
    c.store(torch.empty(0, dtype=torch.int64), torch.empty(0, 4))
    assert c.ids() == [1, 3]
    empty = RowCache(4)
    assert empty.lookup(torch.tensor([1]))[0].tolist() == [False] and empty.gather(torch.tensor([-1])).shape == (1, 4)


def _allocated(obj: object) -> int:
    """Bytes of every tensor and array an object holds, summed independently of its own count."""
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor | np.ndarray))


def test_nbytes_is_the_memory_allocated_capacity_rows_and_index():
    c = RowCache(16, capacity_rows=100)
    spare = 16 * 4 + 8 + 16  # row 0 and its tick (written where nothing is held), the index's end key and row
    assert c.nbytes == _allocated(c.caches) - spare == 0
    c.store(torch.arange(10), torch.zeros(10, 16))
    assert c.nbytes == _allocated(c.caches) - spare >= 100 * 16 * 4  # the row table is allocated up to the capacity
    for step in range(30):  # full, evicting: the allocation stays at the capacity
        c.store(torch.arange(step * 7, step * 7 + 40), torch.zeros(40, 16))
        assert c.nbytes == _allocated(c.caches) - spare
    assert c.caches._rows.shape[0] == 1 + 100 and len(c) == 100
    held = c.caches._index.numel() - 2  # ids and their rows (the end key aside)
    assert c.nbytes == 100 * 16 * 4 + 8 * (held + c.caches._ticks.numel() - 1 + c.caches._free.numel())


def _brute_force_hits(steps, eb, decode):
    """Per step, (held, hit) counts from a plain dict of the last decoded row per id."""
    held_rows: dict[int, torch.Tensor] = {}
    out = []
    for chunk, ids in steps:
        decoded = decode(chunk, ids)
        seen, held, hit = set(), 0, 0
        for r, i in enumerate(ids[:, 0].tolist()):
            if i in seen:
                continue
            seen.add(i)
            if i in held_rows:
                held += 1
                if float((chunk[r] - held_rows[i]).abs().max()) <= eb:
                    hit += 1
                    continue
            held_rows[i] = decoded[r].clone()
        out.append((held, hit))
    return out


def test_probe_counts_rows_within_the_bound_of_what_the_receiver_decoded():
    eb, dim = 0.01, 8
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(eb))
    g = torch.Generator().manual_seed(1)
    table = torch.randn(60, dim, generator=g)
    steps = []
    for _ in range(12):
        ids = torch.randint(0, 60, (40, 1), generator=g)
        # rows drift by 0.4 eb per step (drift accumulates past the bound unless compared with
        # the decoded value), a few jump
        table += 0.4 * eb * torch.sign(torch.randn(60, dim, generator=g))
        table[torch.randint(0, 60, (5,), generator=g)] += 5 * eb
        steps.append((table[ids[:, 0]].clone(), ids))
    probe, stats = CacheProbe(), CommStats()
    for chunk, ids in steps:
        payload = dc.encode(chunk, [dim], [eb], ids)
        probe.observe(dc, chunk, ids, payload, ["f"], [dim], [eb], 1, stats)
    expected = _brute_force_hits(steps, eb, lambda c, i: dc.codec.decode(dc.encode(c, [dim], [eb], i), i))
    assert stats.sums["forward/cache_probe/held_rows"] == sum(h for h, _ in expected)
    assert stats.sums["forward/cache_probe/hit_rows/f"] == sum(h for _, h in expected)
    assert 0 < stats.sums["forward/cache_probe/hit_rows"] < stats.sums["forward/cache_probe/held_rows"]
    # the delta scheme holds the same ids (eviction follows ids alone), codes moved rows smaller,
    # and what its destination would hold stays within the bound
    assert stats.sums["forward/cache_delta_probe/held_rows"] == stats.sums["forward/cache_probe/held_rows"]
    assert stats.sums["forward/cache_delta_probe/cached_bytes"] < stats.sums["forward/cache_probe/cached_bytes"]
    assert stats.maxes["forward/cache_delta_probe/max_error_over_bound"] <= 1 + 1e-4
    d = derive(stats.sums, stats.maxes)
    assert (
        d["comm/forward/cache_probe_hit"]
        == stats.sums["forward/cache_probe/hit_rows"] / stats.sums["forward/cache_probe/unique_rows"]
    )


def test_probe_prices_unchanged_rows_at_about_a_bit():
    eb, dim = 0.01, 16
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(eb))
    chunk = torch.randn(64, dim, generator=torch.Generator().manual_seed(2))
    ids = torch.arange(64).view(64, 1)
    probe, stats = CacheProbe(capacity_rows=64), CommStats()
    payload = dc.encode(chunk, [dim], [eb], ids)
    probe.observe(dc, chunk, ids, payload, ["f"], [dim], [eb], 1, stats)
    first = stats.sums["forward/cache_probe/cached_bytes"]
    probe.observe(dc, chunk, ids, payload, ["f"], [dim], [eb], 1, stats)  # nothing moved: all hit
    second = stats.sums["forward/cache_probe/cached_bytes"] - first
    assert first >= payload.numel() and stats.sums["forward/cache_probe/hit_rows"] == 64
    # the block's flag byte, a 64-bit bitmap and the payload of one zero row (a block with no
    # misses still carries one)
    one_row = dc.encode(torch.zeros(1, dim), [dim], [eb], torch.full((1, 1), -1)).numel()
    assert second == 1 + 64 / 8 + one_row < payload.numel() / 5


def test_probe_reports_what_the_row_cache_does_on_the_same_chunks():
    """The probe's delta scheme against a real sender and receiver of the row cache, fed the same
    chunks: rows held and hit, bytes, the receiver's error and the memory must be the cache's."""
    from dlrm.embedding_comm.forward_cache import ForwardCache

    eb, widths, feats = 0.01, [8, 4], ["a", "b"]
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(eb))
    g = torch.Generator().manual_seed(3)
    tables = [torch.randn(80, w, generator=g) for w in widths]
    probe, stats = CacheProbe(capacity_rows=24), CommStats()
    sender, receiver = ForwardCache(capacity_rows=24), ForwardCache(capacity_rows=24)
    held = hit = unique = sent = 0
    worst = 0.0
    for _ in range(10):
        ids = torch.randint(0, 80, (48, 2), generator=g)
        tables[0] += 0.004 * torch.randn(80, 8, generator=g)  # mostly within the bound
        tables[1] += 0.03 * torch.randn(80, 4, generator=g)  # mostly past it
        chunk = torch.cat([t[ids[:, k]] for k, t in enumerate(tables)], dim=1)
        bounds = [eb, eb]
        probe.observe(dc, chunk, ids, dc.encode(chunk, widths, bounds, ids), feats, widths, bounds, 1, stats)
        payload, _, counts = sender.encode(dc, chunk, ids, feats, widths, bounds, dst=1)
        got = receiver.decode(dc, payload, ids, feats, widths, src=0)
        held, hit, unique = held + counts["held_rows"], hit + counts["hit_rows"], unique + counts["unique_rows"]
        sent += payload.numel()
        worst = max(worst, float((got - chunk).abs().max()) / eb)
    p = "forward/cache_delta_probe"
    assert 0 < hit < held < unique  # the stream has hits, moved rows and fresh rows
    assert (stats.sums[f"{p}/held_rows"], stats.sums[f"{p}/hit_rows"], stats.sums[f"{p}/unique_rows"]) == (
        held,
        hit,
        unique,
    )
    assert stats.sums[f"{p}/cached_bytes"] == sent
    assert stats.maxes[f"{p}/max_error_over_bound"] == pytest.approx(worst, rel=1e-6)
    assert stats.maxes[f"{p}/mirror_bytes"] == receiver.nbytes


def test_cache_probe_config_is_validated_by_key():
    base = {"forward": {"codec": "lossy"}, "backward": {"codec": "lossy"}}
    spec = parse_compression_cfg({**base, "stats": {"cache_probe": {"enabled": True, "capacity_rows": 10}}})
    assert spec.cache_probe_rows == 10
    assert parse_compression_cfg(base).cache_probe_rows is None
    with pytest.raises(ValueError, match=r"compression\.stats\.cache_probe\.capacity_rows"):
        parse_compression_cfg({**base, "stats": {"cache_probe": {"enabled": True, "capacity_rows": -1}}})
    with pytest.raises(ValueError, match=r"compression\.stats\.cache_probe"):
        parse_compression_cfg({**base, "stats": {"cache_probe": {"enable": True}}})


def test_probe_in_a_two_rank_run_measures_without_changing_training(tmp_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    common = ["max_iterations=8", "loss_log=true", "sharding=table_wise"]
    train(tmp_path / "plain", cache, common)
    train(tmp_path / "probe", cache, [*common, "compression.stats.cache_probe.enabled=true"])
    plain, probe = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in ("plain", "probe"))
    assert losses(tmp_path / "plain") == losses(tmp_path / "probe")
    assert plain["forward_ratio"] == probe["forward_ratio"] and "cache_probe_hit_share" not in plain
    assert 0 < probe["cache_probe_hit_share"] <= probe["cache_probe_held_share"] < 1
    assert probe["cache_probe_gain"] > 1 and probe["cache_probe_bytes_per_rank"] > 0
    assert probe["cache_delta_probe_gain"] > 1


def test_every_held_row_stays_within_the_bound_of_its_exact_value_with_several_blocks():
    eb, widths = 0.02, [4, 4, 4]
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(eb))
    g = torch.Generator().manual_seed(3)
    tables = torch.randn(3, 30, 4, generator=g)
    probe, stats = CacheProbe(capacity_rows=24), CommStats()
    for step in range(10):
        ids = torch.randint(0, 30, (24, 3), generator=g)
        tables[1] += 0.7 * eb * torch.randn(30, 4, generator=g)  # block 1 drifts, 0 and 2 stay
        chunk = torch.cat([tables[k][ids[:, k]] for k in range(3)], dim=1)
        bounds = [eb] * 3
        payload = dc.encode(chunk, widths, bounds, ids)
        probe.observe(dc, chunk, ids, payload, ["a", "b", "c"], widths, bounds, 1, stats)
        mirrors = [(scheme, key[3], m) for scheme, fc in probe.shadows.items() for key, m in fc.caches.items()]
        assert len(mirrors) == 6  # per scheme, one per block
        for scheme, k, mirror in mirrors:
            uid = torch.unique(ids[:, k])
            held, rows = mirror.lookup(uid)
            assert held.all() and len(mirror) <= 24, (scheme, k)  # this batch's ids were just sent
            err = (rows - tables[k][uid]).abs().max()
            assert err <= eb * (1 + 1e-5), (scheme, k, step, float(err))
    assert stats.sums["forward/cache_probe/hit_rows/a"] > stats.sums["forward/cache_probe/hit_rows/b"]


def _observe(probe: CacheProbe, dc: DirectionCodec, steps: list, eb: float) -> CommStats:
    stats = CommStats()
    for chunk, ids in steps:
        payload = dc.encode(chunk, [4, 4], [eb, eb], ids)
        probe.observe(dc, chunk, ids, payload, ["a", "b"], [4, 4], [eb, eb], 1, stats)
    return stats


def test_a_probe_restored_from_its_checkpoint_state_counts_what_the_uninterrupted_probe_counts():
    eb = 0.02
    dc = DirectionCodec(DirectionSpec("lossy", params={"entropy": True}), "forward", fixed_bound(eb))
    g = torch.Generator().manual_seed(5)
    tables = torch.randn(2, 40, 4, generator=g)
    steps = []
    for _ in range(8):
        ids = torch.randint(0, 40, (32, 2), generator=g)
        tables += 0.5 * eb * torch.randn(2, 40, 4, generator=g)
        steps.append((torch.cat([tables[k][ids[:, k]] for k in range(2)], dim=1), ids))
    whole = _observe(CacheProbe(capacity_rows=24), dc, steps, eb)
    head = _observe(CacheProbe(capacity_rows=24), dc, steps[:4], eb)
    first = CacheProbe(capacity_rows=24)
    _observe(first, dc, steps[:4], eb)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed = CacheProbe(capacity_rows=24)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    tail = _observe(resumed, dc, steps[4:], eb)
    cold = _observe(CacheProbe(capacity_rows=24), dc, steps[4:], eb)
    for key in ("forward/cache_probe/hit_rows", "forward/cache_delta_probe/cached_bytes"):
        assert tail.sums[key] == whole.sums[key] - head.sums[key], key
    assert cold.sums["forward/cache_probe/hit_rows"] < tail.sums["forward/cache_probe/hit_rows"]  # it can tell
