"""Id statistics, the expected-distinct-ids traffic model, and sharding=comm_aware.

The model is checked against figures it does not compute: distinct ids counted in drawn batches,
the distinct rows the real all-to-all deduplicated, and the bytes the trainer's collectives sent
(2 gloo ranks, synthetic Zipf data); the planner against per-rank shard sizes summed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torchrec import EmbeddingBagCollection
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from trainer_runs import train

from data.frequency import FeatureFrequency, estimate_from_batches
from data.loader import criteo_batches
from data.preprocess import prepare_sample
from dlrm.embedding_comm import fixed_bound, make_sharders
from dlrm.performance.network import Link
from dlrm.placement.comm_aware import CHOICES, comm_aware_planner
from dlrm.placement.config import parse_placement_cfg
from dlrm.placement.traffic import Direction, TrafficModel
from dlrm.trainer.datasets import RunData

SYNTHETIC = [
    "data=synthetic",
    "data.rows={train:12000,dev:500,test:500}",
    "data.max_cardinality=5000",
    "batch_size=256",
    "max_iterations=12",
]


def zipf_ids(rng: np.random.Generator, n: int, rows: int, s: float) -> np.ndarray:
    p = np.arange(1, rows + 1, dtype=np.float64) ** -s
    return rng.choice(rows, size=n, p=p / p.sum())


def test_expected_distinct_matches_distinct_ids_of_drawn_batches():
    rng = np.random.default_rng(0)
    for rows, s, top in ((50_000, 1.1, 64), (2_000, 1.6, 16), (30, 0.0, 1024)):
        freq = FeatureFrequency.from_ids(zipf_ids(rng, 400_000, rows, s), top_n=top)
        for b in (64, 2048):
            counted = np.mean([len(np.unique(zipf_ids(rng, b, rows, s))) for _ in range(30)])
            assert freq.expected_distinct(b) == pytest.approx(counted, rel=0.1), (rows, s, b)
    # skipping the hottest ids leaves only the distinct ids past them
    freq = FeatureFrequency.from_ids(zipf_ids(rng, 100_000, 1000, 1.2), top_n=100)
    batches = [zipf_ids(rng, 512, 1000, 1.2) for _ in range(30)]
    hot = set(freq.top_ids[:10].tolist())
    counted = np.mean([len(set(np.unique(b).tolist()) - hot) for b in batches])
    assert freq.expected_distinct(512, skip_top=10) == pytest.approx(counted, rel=0.1)


def test_estimate_from_batches_counts_every_id_of_the_first_batches(tmp_path):
    d = prepare_sample(tmp_path / "sample")
    batches = criteo_batches(d, ["train"], 100, rank=0, world_size=1, shuffle=False, seed=0)
    freqs, rows = estimate_from_batches(b for _, b in zip(range(5), batches, strict=False))
    sparse = np.load(d / "train_sparse.npy")[:500].astype(np.int64)
    assert rows == 500 and len(freqs) == 26
    for f in (0, 5, 20):
        uniq, counts = np.unique(sparse[:, f], return_counts=True)
        assert (freqs[f].lookups, freqs[f].distinct) == (500, len(uniq))
        assert freqs[f].top_counts[0] == counts.max() and freqs[f].top_ids[0] == uniq[np.argmax(counts)]


def test_placement_keys_are_checked():
    assert parse_placement_cfg({"memory_budget": None, "estimate_batches": 4}, "table_wise", 3).estimate_batches == 4
    assert parse_placement_cfg({"memory_budget": 10**9, "hot_rows": 8}, "table_wise", 3).memory_budget == 10**9
    with pytest.raises(ValueError, match=r"placement.memory_budget only applies to sharding=comm_aware"):
        parse_placement_cfg({"memory_budget": 10**9}, "table_wise", 3)
    with pytest.raises(ValueError, match=r"placement.link_mbit only applies to sharding=comm_aware"):
        parse_placement_cfg({"link_mbit": 200}, "table_wise", 3)
    with pytest.raises(ValueError, match=r"placement.sync_every=4 has no effect without placement.hot_rows"):
        parse_placement_cfg({"sync_every": 4}, "comm_aware", 3)
    with pytest.raises(ValueError, match=r"placement.estimate_batches must be an integer >= 1"):
        parse_placement_cfg({"estimate_batches": 0}, "comm_aware", 3)
    with pytest.raises(ValueError, match=r"placement: unknown key\(s\) \['budget'\]"):
        parse_placement_cfg({"budget": 1}, "comm_aware", 3)
    with pytest.raises(ValueError, match=r"placement.hot_rows has no effect under sharding.type=data_parallel"):
        parse_placement_cfg({"hot_rows": "auto"}, "data_parallel", 3)


def _plan(budget: int | None):
    """comm_aware's plan of one large table (200k rows) and five small ones on 2 ranks."""
    sizes = {"big": 200_000, **{f"small{i}": 1_000 for i in range(5)}, "tiny": 4}
    dim, batch = 16, 256
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=n, feature_names=[t]) for t, n in sizes.items()
        ],
        device=torch.device("meta"),
    )
    rng = np.random.default_rng(1)
    freqs = {t: FeatureFrequency.from_ids(zipf_ids(rng, 50_000, n, 1.1)) for t, n in sizes.items()}
    traffic = TrafficModel(2, batch, forward=Direction(True, 8.0, 8.0), backward=Direction(True, 8.0, 8.0))
    planner = comm_aware_planner(
        {"world_size": 2, "compute_device": "cpu", "local_world_size": 2},
        batch,
        list(sizes),
        dim,
        list(CHOICES),
        traffic,
        freqs,
        Link(25e6),
        budget,
        dim // 2,
    )
    sharders = make_sharders(OmegaConf.load("configs/compression/lossy.yaml"), fixed_bound(0.01), fixed_bound(0.01))
    plan = planner.plan(ebc, sharders)
    per_rank = np.zeros(2)
    kinds = {}
    for module_plan in plan.plan.values():
        for t, ps in module_plan.items():
            kinds[t] = ps.sharding_type
            if ps.sharding_spec is None:  # data-parallel: the whole table on every rank
                per_rank += sizes[t] * dim * 4
            else:
                for s in ps.sharding_spec.shards:
                    per_rank[s.placement.rank()] += s.shard_sizes[0] * s.shard_sizes[1] * 4
    return kinds, per_rank


def test_comm_aware_keeps_each_rank_within_the_memory_budget():
    kinds, per_rank = _plan(None)
    # unconstrained: whole tables (split tables cost more bytes), the 4-row table replicated
    assert kinds["big"] == "table_wise" and kinds["tiny"] == "data_parallel"
    assert per_rank.max() >= 200_000 * 16 * 4
    budget = 12_000_000  # the big table alone (12.8 MB) no longer fits on one rank
    kinds, per_rank = _plan(budget)
    assert kinds["big"] in ("row_wise", "column_wise")
    assert per_rank.max() <= budget


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


# comm_aware plans table-wise, data-parallel (and where it balances, column-wise) tables; row-wise
# without compression prices the rest: partial sums and whole gradients, uncompressed.
@pytest.mark.parametrize("sharding, compression", [("comm_aware", "lossy"), ("row_wise", "none")])
def test_predicted_wire_bytes_and_distinct_ids_match_the_run(tmp_path, cache, sharding, compression):
    run_dir = tmp_path / "run"
    # every iteration samples its chunks' distinct rows (the default, every 10th, is for long runs)
    stats = ["compression.stats.sample_every=1"] if compression == "lossy" else []
    train(run_dir, cache, [*SYNTHETIC, f"sharding={sharding}", f"compression={compression}", *stats])
    m = _metrics(run_dir)
    assert m["wire_bytes_per_iteration"] == pytest.approx(sum(m["wire_bytes_per_rank"]))
    assert m["predicted_wire_bytes_per_iteration"] == pytest.approx(m["wire_bytes_per_iteration"], rel=0.1)
    for path, measured in m["wire_bytes_by_path"].items():  # each path, not only the total
        assert m["predicted_wire_bytes_by_path"][path] == pytest.approx(measured, rel=0.1, abs=100), path
    if compression == "lossy":  # distinct ids per (source, destination) chunk, as the all-to-all deduplicated them
        distinct = m["distinct_ids_per_chunk"]
        assert len(distinct) >= 18
        for table, d in distinct.items():
            assert d["predicted"] == pytest.approx(d["measured"], rel=0.1), table
    if sharding == "comm_aware":
        kinds = {t: desc.split(" ranks=")[0] for t, desc in m["sharding_plan"].items()}
        # the 3- and 4-row tables (cat_8, cat_19) are cheaper replicated than sent every iteration
        assert kinds["t_cat_8"] == kinds["t_cat_19"] == "data_parallel"
        assert m["wire_bytes_by_path"]["allreduce"] > 0
        log = (run_dir / "train_rank0.log").read_text()
        assert "comm_aware: rank 0 predicted" in log and "comm_aware: rank 1 predicted" in log


def test_the_trainer_estimates_frequencies_from_its_first_batches_when_meta_has_none(tmp_path, caplog):
    d = prepare_sample(tmp_path / "sample")
    info = json.loads((d / "meta.json").read_text())
    recorded = RunData(d, info, {"train": ["train"]}, 0, 1, 0).frequency(100, 3)
    assert recorded[1] == "counted" and recorded[0][0].lookups == 8000  # meta.json's, all stems
    del info["frequency"]
    with caplog.at_level("INFO", logger="dlrm.trainer.datasets"):
        freqs, source = RunData(d, info, {"train": ["train"]}, 0, 1, 0).frequency(100, 3)
    assert source == "batches" and freqs[0].lookups == 300
    assert "records no id frequencies: estimated from the first 3 training batches (300 rows)" in caplog.text
