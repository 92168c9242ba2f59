"""criteo_batches: shapes, equal batch counts per rank, each row once per epoch, seeded order, resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data import layout, shuffle
from data.loader import criteo_batches, dataset_info


@pytest.fixture(params=["explicit", "feistel"])
def order_kind(request, monkeypatch) -> str:
    """Run a test with the in-memory permutation and with the per-position one (big datasets)."""
    if request.param == "feistel":
        monkeypatch.setattr(shuffle, "EXPLICIT_MAX", 0)
    return request.param


def write_indexed_dataset(d: Path, stems: dict[str, int]) -> Path:
    """A dataset whose row g (counted over the stems in order) has dense[:, 0] == g and ids g+f."""
    d.mkdir()
    files, start = [], 0
    for stem, n in stems.items():
        g = np.arange(start, start + n)
        dense = np.zeros((n, 13), np.float32)
        dense[:, 0] = g
        dense[:, 1:] = np.arange(1, 13) / 16
        np.save(layout.array_path(d, stem, "dense"), dense)
        np.save(layout.array_path(d, stem, "sparse"), (g[:, None] + np.arange(26)).astype(np.int32))
        np.save(layout.array_path(d, stem, "labels"), (g % 3 == 0).astype(np.uint8))
        files.append({"stem": stem, "source": "test", "rows": n, "positives": int((g % 3 == 0).sum())})
        start += n
    layout.write_meta(d, layout.base_meta("synthetic", [start + 26] * 26, files, {}, reserved_rare=False))
    return d


def rows_of(batch: Batch) -> list[int]:
    return batch.dense_features[:, 0].long().tolist()


def test_batch_layout(tmp_path):
    d = write_indexed_dataset(tmp_path / "d", {"a": 30})
    batches = list(criteo_batches(d, ["a"], 8, 0, 1, shuffle=True, seed=3))
    b = batches[0]
    assert isinstance(b, Batch) and isinstance(b.sparse_features, KeyedJaggedTensor)
    assert b.dense_features.shape == (8, 13) and b.dense_features.dtype == torch.float32
    assert b.labels.shape == (8,) and b.labels.dtype == torch.float32
    kjt = b.sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert kjt.values().dtype == torch.int64 and kjt.lengths().tolist() == [1] * (26 * 8)
    g = torch.tensor(rows_of(b))
    for f, key in enumerate(kjt.keys()):
        assert kjt[key].values().tolist() == (g + f).tolist()
    assert b.labels.tolist() == (g % 3 == 0).float().tolist()
    assert torch.allclose(b.dense_features[:, 1:], torch.arange(1, 13) / 16)
    assert [len(x.labels) for x in batches] == [8, 8, 8, 6]


@pytest.mark.parametrize(
    "rows, world, bs, drop_last",
    [
        (100, 3, 8, False),
        (100, 4, 8, False),
        (10, 4, 8, False),
        (3, 4, 8, False),
        (97, 2, 16, True),
        (64, 2, 16, False),
        (65, 2, 16, False),
        (65, 2, 16, True),
        (7, 1, 3, False),
        (1000, 5, 7, False),
    ],
)
def test_every_rank_same_batch_count_and_rows_once(tmp_path, rows, world, bs, drop_last, order_kind):
    split = rows // 3
    d = write_indexed_dataset(tmp_path / "d", {"x": split, "y": rows - split})
    per_rank = [
        list(criteo_batches(d, ["x", "y"], bs, r, world, shuffle=True, seed=11, drop_last=drop_last))
        for r in range(world)
    ]
    lens = [len(criteo_batches(d, ["x", "y"], bs, r, world, True, 11, drop_last=drop_last)) for r in range(world)]
    counts = [len(b) for b in per_rank]
    assert len(set(counts)) == 1 and lens == counts
    full, tail = divmod(rows, bs * world)
    tail_kept = tail >= world and not drop_last
    assert counts[0] == full + tail_kept
    seen = [g for batches in per_rank for b in batches for g in rows_of(b)]
    assert len(seen) == len(set(seen)) == full * bs * world + (tail if tail_kept else 0)
    assert set(seen) <= set(range(rows))
    for i in range(full):
        assert all(len(per_rank[r][i].labels) == bs for r in range(world))
    if tail_kept:
        sizes = [len(per_rank[r][-1].labels) for r in range(world)]
        assert sum(sizes) == tail and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_seeded_order_reproducible_and_independent_of_world_size(tmp_path, order_kind):
    d = write_indexed_dataset(tmp_path / "d", {"a": 50, "b": 46})

    def epoch_order(seed: int, epoch: int, world: int, bs: int) -> list[int]:
        ranks = [list(criteo_batches(d, ["a", "b"], bs, r, world, True, seed, epoch=epoch)) for r in range(world)]
        return [g for i in range(len(ranks[0])) for r in range(world) for g in rows_of(ranks[r][i])]

    base = epoch_order(5, 0, 2, 8)
    assert sorted(base) == list(range(96))
    assert epoch_order(5, 0, 2, 8) == base
    assert epoch_order(5, 0, 4, 4) == base  # same global batch of 16, other world size
    assert epoch_order(5, 0, 1, 16) == base
    assert epoch_order(5, 1, 2, 8) != base
    assert epoch_order(6, 0, 2, 8) != base
    assert epoch_order(5, 0, 2, 8) != sorted(base)
    unshuffled = [g for b in criteo_batches(d, ["b", "a"], 10, 0, 1, shuffle=False, seed=0) for g in rows_of(b)]
    assert unshuffled == list(range(50, 96)) + list(range(50))  # stems concatenated in the given order


def test_start_batch_equals_iterating_and_discarding(tmp_path, order_kind):
    d = write_indexed_dataset(tmp_path / "d", {"a": 77})
    full = list(criteo_batches(d, ["a"], 5, 1, 3, True, 2, epoch=4))
    for start in (0, 1, 3, len(full)):
        resumed = criteo_batches(d, ["a"], 5, 1, 3, True, 2, epoch=4, start_batch=start)
        got = list(resumed)
        assert len(resumed) == len(got) == len(full) - start
        for a, b in zip(got, full[start:], strict=True):
            assert torch.equal(a.dense_features, b.dense_features)
            assert torch.equal(a.labels, b.labels)
            assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    with pytest.raises(ValueError, match="start_batch"):
        criteo_batches(d, ["a"], 5, 1, 3, True, 2, start_batch=len(full) + 1)


def test_dataset_info_and_errors(tmp_path):
    d = write_indexed_dataset(tmp_path / "d", {"train": 20, "test": 5})
    info = dataset_info(d)
    assert info["rows"] == {"train": 20, "test": 5} and info["num_embeddings"] == [51] * 26
    assert info["sparse_features"][0] == "cat_0" and len(info["dense_features"]) == 13
    with pytest.raises(layout.DatasetError, match="no stem 'dev'"):
        criteo_batches(d, ["dev"], 4, 0, 1, False, 0)
    np.save(layout.array_path(d, "test", "labels"), np.zeros(4, np.uint8))
    with pytest.raises(layout.DatasetError, match=r"test_labels\.npy: shape"):
        criteo_batches(d, ["test"], 4, 0, 1, False, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(layout.DatasetError, match="not a complete dataset"):
        dataset_info(tmp_path / "empty")


def _gloo_epoch(rank: int, world: int, data_dir: str) -> list[int]:
    """Iterate with one collective per batch, as training does; a rank with fewer batches would hang."""
    seen = []
    for b in criteo_batches(data_dir, ["a", "b"], 4, rank, world, shuffle=True, seed=1, epoch=2):
        n = torch.tensor([len(b.labels)])
        dist.all_reduce(n)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, rows_of(b))
        assert int(n) == sum(len(g) for g in gathered)
        seen.extend(rows_of(b))
    return seen


def test_real_gloo_ranks_cover_the_epoch(tmp_path):
    d = write_indexed_dataset(tmp_path / "d", {"a": 23, "b": 20})  # 43 rows: 3 full global batches + 7
    seen = run_ranks(_gloo_epoch, 3, str(d), timeout=120)
    flat = [g for s in seen for g in s]
    assert sorted(flat) == list(range(43))


def test_stem_row_ranges_split_a_file_into_disjoint_halves(tmp_path):
    from data.loader import parse_stem
    from data.synthetic import generate

    generate(tmp_path / "ds", rows={"day": 101}, seed=3, max_cardinality=50)
    halves = [
        criteo_batches(tmp_path / "ds", [spec], 1000, 0, 1, shuffle=False, seed=0)
        for spec in ("day[:0.5]", "day[0.5:]")
    ]
    whole = next(iter(criteo_batches(tmp_path / "ds", ["day"], 1000, 0, 1, shuffle=False, seed=0)))
    parts = [next(iter(h)) for h in halves]
    assert [len(p.labels) for p in parts] == [50, 51]  # round(101 * 0.5) = 50
    assert torch.equal(torch.cat([p.dense_features for p in parts]), whole.dense_features)
    assert parse_stem("day_23") == ("day_23", 0.0, 1.0)
    for bad in ("day[0.5:0.2]", "day[a:b]", "day[1:2]"):
        with pytest.raises(ValueError, match="stem"):
            parse_stem(bad)
