"""Hot-row replication (placement.hot_rows): the split of a batch, the replicas' synchronisation on
real gloo ranks, the choice of sizes, and real 2-rank training runs (same losses as without
replication, exact resume, the memory budget)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from run_artifacts import checkpoint_tensors, flatten
from torch.distributed.checkpoint import FileSystemReader
from torchrec.datasets.utils import Batch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from trainer_runs import losses, train

from data.frequency import FeatureFrequency
from dlrm.embedding_comm.config import parse_compression_cfg
from dlrm.placement.config import parse_placement_cfg
from dlrm.placement.hot_choice import Wire, choose_auto, price
from dlrm.placement.hot_rows import HOT_SUFFIX, HotSplit
from dlrm.placement.hot_sync import HotRowOptimizer
from dlrm.placement.replication import choose_sizes, wire_of
from dlrm.placement.traffic import Direction, ReplicaSync, Shard, TablePlacement, TrafficModel
from dlrm.trainer.checkpoint_format import SEAL, read_state

# --- the data path -------------------------------------------------------------------------------


def test_hot_plus_cold_pooled_rows_equal_the_whole_bags():
    torch.manual_seed(0)
    table = torch.randn(50, 4)
    lengths = torch.tensor([1, 3, 0, 2, 1, 4], dtype=torch.int32)
    values = torch.tensor([7, 7, 3, 9, 1, 7, 3, 7, 9, 9, 0])
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths, stride=3)
    hot_ids = torch.tensor([7, 9, 42])  # slot 0 is id 7; 42 never occurs
    batch = Batch(dense_features=torch.zeros(3, 1), sparse_features=kjt, labels=torch.zeros(3))
    split = HotSplit({"b": hot_ids})(batch).sparse_features
    assert split.keys() == ["a", "b", "b" + HOT_SUFFIX]
    parts, whole = split.to_dict(), kjt.to_dict()
    assert torch.equal(parts["a"].values(), whole["a"].values())

    def pooled(rows: torch.Tensor, jt) -> torch.Tensor:
        bag = torch.nn.EmbeddingBag.from_pretrained(rows, mode="sum")
        return bag(jt.values(), jt.offsets()[:-1])

    cold, hot = parts["b"], parts["b" + HOT_SUFFIX]
    assert not set(cold.values().tolist()) & {7, 9}
    assert torch.allclose(pooled(table, cold) + pooled(table[hot_ids], hot), pooled(table, whole["b"]))


# --- the replicas' optimizer ------------------------------------------------------------------

ROWS, DIM, LR, STEPS = 6, 4, 0.05, 3


def _grads(rank: int, step: int) -> torch.Tensor:
    """Each rank's dense gradient at a step: rows 0-2 on both ranks, row 3+rank on one, row 5 never."""
    g = torch.Generator().manual_seed(100 * step + rank)
    out = torch.randn(ROWS, DIM, generator=g)
    out[5] = 0
    out[4 - rank] = 0  # rank 0 touches row 3, rank 1 row 4
    return out


def _train_replicas(rule: str, sync_every: int, steps: int) -> torch.Tensor:
    """One process stands in for both ranks: it steps with their mean gradient (the gloo sum across
    ranks is checked by the training runs below, whose replicas must agree bit for bit)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(ROWS, DIM))
    _step(HotRowOptimizer({"hot.f": w}, rule, lr=LR, eps=1e-8, sync_every=sync_every), w, range(steps))
    return w.detach().clone()


def _step(opt: HotRowOptimizer, w: torch.nn.Parameter, steps: range) -> None:
    for step in steps:
        grad = (_grads(0, step) + _grads(1, step)) / 2
        touched = grad.abs().sum(1).nonzero().flatten()
        w.grad = torch.sparse_coo_tensor(touched.unsqueeze(0), grad[touched], (ROWS, DIM))
        opt.step()
        w.grad = None


def _reference(rule: str, mean_grads: list[torch.Tensor]) -> torch.Tensor:
    """TorchRec's and torch's own optimizers on the ranks' mean gradient (TorchRec divides by the
    world size in its backward all-to-all)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(ROWS, DIM))
    make = {
        "sgd": lambda: torch.optim.SGD([w], lr=LR),
        "adagrad": lambda: torch.optim.Adagrad([w], lr=LR, eps=1e-8),
        "rowwise_adagrad": lambda: RowWiseAdagrad([w], lr=LR, eps=1e-8),
    }[rule]()
    for g in mean_grads:
        w.grad = g.clone()
        make.step()
    return w.detach()


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "rowwise_adagrad"])
def test_replica_updates_follow_the_embedding_optimizer_on_the_mean_gradient(rule):
    got = _train_replicas(rule, 1, STEPS)
    expected = _reference(rule, [(_grads(0, s) + _grads(1, s)) / 2 for s in range(STEPS)])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    torch.manual_seed(0)
    assert torch.equal(got[5], torch.randn(ROWS, DIM)[5])  # a row no rank touched never moves


def test_pending_gradients_survive_a_checkpoint_between_syncs():
    uninterrupted = _train_replicas("rowwise_adagrad", 3, 5)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(ROWS, DIM))
    before = HotRowOptimizer({"hot.f": w}, "rowwise_adagrad", lr=LR, eps=1e-8, sync_every=3)
    _step(before, w, range(4))  # one sync after step 3, step 4 pending
    saved = {k: v for k, v in before.state_dict().items()}, before.pending_state()
    after = HotRowOptimizer({"hot.f": w}, "rowwise_adagrad", lr=LR, eps=1e-8, sync_every=3)
    after.load_state_dict(saved[0])
    after.load_pending_state(saved[1])
    _step(after, w, range(4, 5))
    assert torch.equal(w.detach(), uninterrupted)


def test_sync_every_k_applies_the_accumulated_gradient_once_per_k_steps():
    got = _train_replicas("rowwise_adagrad", 2, STEPS)  # one sync after step 2, step 3 still pending
    summed = sum((_grads(0, s) + _grads(1, s)) / 2 for s in range(2))
    torch.testing.assert_close(got, _reference("rowwise_adagrad", [summed]), rtol=1e-6, atol=1e-7)


# --- choosing the sizes --------------------------------------------------------------------------


def _freq(weights: np.ndarray, lookups: int = 1_000_000) -> FeatureFrequency:
    counts = np.maximum(np.round(weights / weights.sum() * lookups), 1).astype(np.int64)
    return FeatureFrequency.from_counts(np.arange(len(counts)), counts, top_n=256)


def test_priced_saving_matches_the_bytes_sampled_batches_no_longer_send():
    freq = _freq(np.arange(1, 5001, dtype=np.float64) ** -1.1)
    rng = np.random.default_rng(0)
    p = freq.probabilities()
    batch, hot, dim, ratio = 512, 64, 16, 3.0
    draws = [rng.choice(len(p), size=batch, p=p / p.sum()) for _ in range(300)]
    # per batch, one peer: each direction's chunk no longer carries the distinct hot rows but gains
    # the emptied bags' zero row; the input dist no longer carries the hot ids (int64)
    rows = [len(np.unique(d[d < hot])) - (d < hot).any() for d in draws]
    ids = [(d < hot).sum() for d in draws]
    sampled = np.mean([2 * r * 4 * dim / ratio + 8 * i for r, i in zip(rows, ids, strict=True)])
    both = Direction(dedup=True, ratio_ids=ratio, ratio_rows=ratio)
    q = price(freq, hot, Wire(lookups=batch, world=2, dim=dim, forward=both, backward=both))
    assert q.saved == pytest.approx(sampled, rel=0.004)  # the zero row: the old formula was 0.9% over


@pytest.mark.parametrize("padded", [True, False])  # the exact sync pads to the largest rank's rows
def test_traffic_model_of_replication_matches_simulated_batches(padded):
    freq = _freq(np.arange(1, 5001, dtype=np.float64) ** -1.1)
    p = freq.probabilities() / freq.probabilities().sum()
    batch, hot, every, dim, ws = 256, 200, 2, 16, 2
    sync = ReplicaSync(every, row_ratio=1.0 if padded else 7.0, slot_bytes=8 if padded else 2, padded=padded)
    model = TrafficModel(ws, batch, hot={"t": hot}, sync=sync)
    table = TablePlacement("t", "table_wise", len(p), dim, (Shard(0, 0, len(p), dim),))
    rng = np.random.default_rng(1)
    draws = rng.choice(len(p), size=(600, ws, every * batch), p=p)  # per sync: each rank's k batches
    first = draws[:, 0, :batch]  # one batch of the rank that is not the owner
    cold_ids = [np.unique(d[d >= hot]) for d in first]
    rows = np.mean([len(c) + (d < hot).any() for c, d in zip(cold_ids, first, strict=True)])
    input_bytes = np.mean([batch * 4 + (d >= hot).sum() * 8 for d in first])
    touched = np.array([[len(np.unique(r[r < hot])) for r in sync_draws] for sync_draws in draws])
    sent = touched.max(axis=1) if padded else touched[:, 0]
    sync_bytes = np.mean((ws - 1) * (sent * sync.row_bytes(dim) + sync.prefix_bytes + 8) / every)
    assert model.chunk_rows("t", freq) == pytest.approx(rows, rel=0.02)
    assert model.table(table, freq)[1, 0] == pytest.approx(input_bytes, rel=0.01)
    assert model.replica_sync([table], {"t": freq}) == pytest.approx(sync_bytes, rel=0.02)


def test_auto_replicates_skewed_tables_not_flat_ones_and_says_why(caplog):
    zipf, flat = _freq(np.arange(1, 20001, dtype=np.float64) ** -1.2), _freq(np.ones(20000))
    both = Direction(dedup=True, ratio_ids=4.0, ratio_rows=4.0)
    wire = Wire(lookups=2048, world=2, dim=64, forward=both, backward=both, row_bytes=260)
    with caplog.at_level(logging.INFO, logger="dlrm.placement.hot_choice"):
        chosen = choose_auto(["t_zipf", "t_flat"], [zipf, flat], wire, free_bytes=float("inf"))
    assert set(chosen) == {"t_zipf"} and chosen["t_zipf"].hot > 0
    assert "t_flat not replicated: no size pays" in caplog.text


def test_auto_stays_within_the_memory_budget():
    tables = [f"t{i}" for i in range(4)]
    freqs = [_freq(np.arange(1, 20001, dtype=np.float64) ** -s) for s in (1.0, 1.1, 1.2, 1.3)]
    wire = Wire(lookups=2048, world=2, dim=64, forward=Direction(True), backward=Direction(True), row_bytes=260)
    free = 40 * 260
    chosen = choose_auto(tables, freqs, wire, free_bytes=free, verbose=False)
    unbounded = choose_auto(tables, freqs, wire, free_bytes=float("inf"), verbose=False)
    assert 0 < sum(q.memory for q in chosen.values()) <= free < sum(q.memory for q in unbounded.values())


def test_the_coded_sync_prices_fewer_bytes_than_the_exact_one_and_replicates_more():
    freq = _freq(np.arange(1, 20001, dtype=np.float64) ** -1.2)
    both = (Direction(True, 4.0, 4.0), Direction(True, 4.0, 4.0))
    exact = wire_of(both, 2048, 2, 64, 1, 260)
    coded = wire_of(both, 2048, 2, 64, 1, 260, sync_codec="backward")
    q_e, q_c = price(freq, 64, exact), price(freq, 64, coded)
    assert q_c.saved == q_e.saved and q_c.sync < q_e.sync
    hot = [choose_auto(["t"], [freq], w, float("inf"), verbose=False)["t"].hot for w in (exact, coded)]
    assert hot[1] > hot[0]


@pytest.mark.parametrize(
    "cfg, key",
    [({"hot_rows": -1}, "placement.hot_rows"), ({"hot_rows": [1, 2]}, "placement.hot_rows"),
     ({"sync_every": 0}, "placement.sync_every"), ({"memory_budget": "big"}, "placement.memory_budget"),
     ({"hot_row": 4}, "unknown key")],
)  # fmt: skip
def test_bad_placement_config_names_the_key(cfg, key):
    with pytest.raises(ValueError, match=key):
        parse_placement_cfg(cfg, "table_wise", num_tables=3)


# --- real 2-rank training runs -------------------------------------------------------------------

ITERS, STOP, ROOM = 12, 7, 8
COMMON = ["compression=none", "sharding=table_wise", "loss_log=true", f"max_iterations={ITERS}"]
ROW_BYTES = 16 * 4 + 4  # SMALL's embedding_dim=16, row-wise Adagrad's one float of state per row


def _table_bytes_per_rank(base: Path, cache: Path) -> list[int]:
    """Each rank's table rows (weights and row-wise Adagrad state), from the base run's plan and
    the dataset's table sizes."""
    (meta,) = cache.glob("criteo_sample-*/meta.json")
    info = json.loads(meta.read_text())
    rows = {f"t_{f}": n for f, n in zip(info["sparse_features"], info["num_embeddings"], strict=True)}
    plan = json.loads((base / "metrics.json").read_text())["sharding_plan"]
    per_rank = [0, 0]
    for table, where in plan.items():
        per_rank[int(where.split("ranks=[")[1].rstrip("]"))] += rows[table] * ROW_BYTES
    return per_rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root, cache = tmp_path_factory.mktemp("hot"), tmp_path_factory.mktemp("cache")
    out: dict[str, Any] = {name: root / name for name in ("base", "hot", "resumed")}
    train(out["base"], cache, COMMON)
    out["tables"] = _table_bytes_per_rank(out["base"], cache)
    out["budget"] = max(out["tables"]) + ROOM * ROW_BYTES  # fewer rows than auto wants at compression=none
    hot = [*COMMON, "placement.hot_rows=auto", f"placement.memory_budget={out['budget']}", "checkpoint.every=1"]
    train(out["hot"], cache, hot)
    train(out["resumed"], cache, [*hot, f"max_iterations={STOP}"])
    train(out["resumed"], cache, [*hot, "resume=true"])
    return out


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())["hot_rows"]


def test_replication_with_sync_every_1_trains_as_without(runs):
    base, hot = losses(runs["base"]), losses(runs["hot"])
    assert sorted(hot) == list(range(1, ITERS + 1))
    np.testing.assert_allclose([hot[i] for i in hot], [base[i] for i in hot], rtol=1e-5, atol=1e-6)
    m = _metrics(runs["hot"])
    digests = m["replica_digest_per_rank"]  # crc32 of every replica's bytes, gathered from each rank
    assert len(digests) == 2 and digests[0] == digests[1]
    assert m["tables"] and m["sync_bytes_per_iteration"] > 0


def test_auto_keeps_tables_and_replicas_within_the_memory_budget(runs):
    m, replicas = _metrics(runs["hot"]), sum(_metrics(runs["hot"])["tables"].values()) * ROW_BYTES
    assert m["replica_bytes_per_rank"] == replicas and 0 < replicas <= ROOM * ROW_BYTES
    assert m["memory_bytes_per_rank"] == [t + replicas for t in runs["tables"]]
    assert max(m["memory_bytes_per_rank"]) <= runs["budget"]


def test_resume_restores_replicas_and_their_optimizer_exactly(runs):
    full, resumed = losses(runs["hot"]), losses(runs["resumed"])
    # bit for bit at 2 ranks (a loss 1 ulp apart at iteration STOP + 2 was a resume that stepped the
    # hot-row optimizer once more and left zero gradients behind); at 3 ranks see test_scale.py
    assert [resumed[i] for i in range(1, ITERS + 1)] == [full[i] for i in range(1, ITERS + 1)]
    # and the replicas and their row-wise Adagrad state end where the uninterrupted run's do
    ends = [flatten(checkpoint_tensors(runs[r] / "checkpoints" / f"step-{ITERS}")) for r in ("hot", "resumed")]
    hot_keys = [k for k in ends[0] if "sparse_arch.hot.weights" in k]
    assert len(hot_keys) == 2 * len(_metrics(runs["hot"])["tables"])  # each weight and its momentum
    assert [k for k in hot_keys if not torch.equal(ends[1][k], ends[0][k])] == []
    # the sync's step count (the coded sync's policy iteration) is the uninterrupted run's: loading
    # the checkpoint's optimizer state takes no step of the hot-row optimizer
    finals = [runs[r] / "checkpoints" / f"step-{ITERS}" for r in ("hot", "resumed")]
    counts = [read_state(step, 0).parts["hot_rows"]["steps"] for step in finals]
    assert counts[1] == counts[0] == ITERS


def test_a_checkpoint_keeps_one_copy_of_the_replicas(runs):
    step = runs["hot"] / "checkpoints" / f"step-{ITERS}"
    metadata = FileSystemReader(str(step)).read_metadata()
    weights = [k for k in metadata.storage_data if ".sparse_arch.hot.weights." in k.fqn]
    assert len(weights) == 2 * len(_metrics(runs["hot"])["tables"])  # each weight and its momentum, once
    # every byte of the rank files is an indexed item: no rank wrote a second copy beside the one indexed
    stored = sum(p.stat().st_size for p in step.glob("*.distcp"))
    items = [info for index, info in metadata.storage_data.items() if not index.fqn.startswith(SEAL)]
    assert stored == sum(info.length for info in items)


def test_explicit_hot_rows_beyond_the_memory_budget_is_refused():
    spec = parse_placement_cfg({"hot_rows": 64, "memory_budget": 10**6}, "table_wise", num_tables=2)
    freqs = [_freq(np.arange(1, 1001, dtype=np.float64) ** -1.0)] * 2
    wire = Wire(lookups=512, world=2, dim=16, row_bytes=ROW_BYTES)
    assert choose_sizes(spec, ["t0", "t1"], freqs, wire, free_bytes=128 * ROW_BYTES) == {"t0": 64, "t1": 64}
    with pytest.raises(ValueError, match=r"placement.hot_rows=64 needs .* placement.memory_budget"):
        choose_sizes(spec, ["t0", "t1"], freqs, wire, free_bytes=128 * ROW_BYTES - 1)


def test_export_serves_the_trained_replicas_not_the_tables_stale_rows(runs, tmp_path):
    from dlrm.precision.export import hot_ids_of, load_dlrm_state, main

    step = runs["hot"] / "checkpoints" / f"step-{ITERS}"
    hot_ids, state = hot_ids_of(step), load_dlrm_state(step)
    assert {f: len(ids) for f, ids in hot_ids.items()} == {
        f.removeprefix("t_"): n for f, n in _metrics(runs["hot"])["tables"].items()
    }
    # the tables' own copies of the hot rows are stale: they never trained
    f = next(iter(hot_ids))
    stale = state[f"sparse_arch.embedding_bag_collection.embedding_bags.t_{f}.weight"][hot_ids[f]]
    assert not torch.equal(stale.float(), state[f"sparse_arch.hot.weights.{f}"])
    main([str(runs["hot"]), "--out", str(tmp_path), "--precision", "fp32"])
    got = json.loads((tmp_path / "export.json").read_text())
    trained = json.loads((runs["hot"] / "metrics.json").read_text())
    # the fp32 model rebuilt from the checkpoint scores the test split as the trainer did (replicas and all)
    assert got["fp32_auc"] == pytest.approx(trained["auc"], abs=1e-6) and got["auc"] == got["fp32_auc"]


def test_resume_with_other_hot_rows_is_refused_naming_the_key(runs, tmp_path):
    import shutil

    from dlrm.placement.replication import Replication
    from dlrm.trainer.checkpoint import CheckpointError

    # a checkpoint with replicas, resumed without them: refused before any tensor is read
    run_dir = tmp_path / "run"
    shutil.copytree(runs["hot"] / "checkpoints", run_dir / "checkpoints")
    proc = train(run_dir, tmp_path / "cache", [*COMMON, "resume=true"], check=False)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "holds state of ['hot_rows'], which this run does not have" in proc.stderr
    # as many rows of other ids (other statistics), or other counts: refused too
    ids = torch.tensor([3, 1])
    mine = Replication(
        {"a": ids},
        HotSplit({"a": ids}),
        HotRowOptimizer({"hot.a": torch.nn.Parameter(torch.zeros(2, 4))}, "sgd", lr=LR, eps=1e-8, sync_every=1),
    )
    buf = io.BytesIO()
    torch.save(mine.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # as a resume loads it
    with pytest.raises(CheckpointError, match=r"as many rows, other ids.*placement\.hot_rows"):
        mine.load_state_dict({**saved, "hot_ids": {"a": [1, 3]}})
    with pytest.raises(CheckpointError, match=r"replicates hot rows \{'a': 3\} but this run replicates \{'a': 2\}"):
        mine.load_state_dict({**saved, "hot_ids": {"a": [3, 1, 2]}})
    mine.load_state_dict(saved)


@pytest.mark.parametrize(
    "name, dedup", [("none", (False, False)), ("lossy", (True, True)), ("fp16", (True, True)), ("qcomm_fp16", (0, 0))]
)
def test_auto_prices_the_all_to_all_as_the_trainer_runs_it(name, dedup):
    from omegaconf import OmegaConf

    from dlrm.embedding_comm import build_sharders, compression_runtime, fixed_bound
    from dlrm.placement.codec_ratio import priced_directions

    # the shipped config groups, as Hydra composes them (fp16's forward leaves dedup at its default)
    group = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs" / "compression" / f"{name}.yaml")
    spec = parse_compression_cfg(group)
    bounds = (fixed_bound(0.01), fixed_bound(0.01)) if name == "lossy" else (None, None)
    runtime = compression_runtime(build_sharders(spec, *bounds))
    freqs = [_freq(np.arange(1, 1001, dtype=np.float64) ** -1.0)]
    directions = priced_directions(spec, runtime, ["a"], freqs, batch=256, dim=16, seed=0)
    wire = wire_of(directions, batch_size=256, world=2, dim=16, sync_every=1, row_bytes=68)
    assert (wire.forward.dedup, wire.backward.dedup) == tuple(bool(d) for d in dedup)


# --- the coded replica sync (placement.sync_codec=backward) in real 2-rank runs -----------------

LOSSY = ["compression=lossy", "sharding=table_wise", "loss_log=true", f"max_iterations={ITERS}", "placement.hot_rows=8"]
LOSSY += ["compression.stats.sample_every=1"]  # every chunk's rows counted, for the distinct-id predictions


@pytest.fixture(scope="module")
def coded_runs(tmp_path_factory) -> dict[str, Path]:
    root, cache = tmp_path_factory.mktemp("coded"), tmp_path_factory.mktemp("cache")
    out = {name: root / name for name in ("exact", "backward")}
    for name, run_dir in out.items():
        train(run_dir, cache, [*LOSSY, f"placement.sync_codec={name}"])
    return out


def test_coded_sync_trains_close_to_the_exact_sync_with_identical_replicas(coded_runs):
    exact, coded = losses(coded_runs["exact"]), losses(coded_runs["backward"])
    assert sorted(coded) == list(range(1, ITERS + 1))
    # The replicas' summed gradients are within 0.01 of each table's gradient range per rank (the
    # backward policy's bound, the same relative error the lossy backward all-to-all puts on every
    # sharded row), compounding over 12 iterations of row-wise Adagrad: measured up to 1.7e-3
    # relative (iteration 11), so 5e-3; the first loss is before any update and must be equal.
    assert coded[1] == exact[1]
    np.testing.assert_allclose([coded[i] for i in coded], [exact[i] for i in coded], rtol=5e-3)
    m, e = _metrics(coded_runs["backward"]), _metrics(coded_runs["exact"])
    assert m["sync_codec"] == "backward" and e["sync_codec"] == "exact" and e["sync_row_ratio"] == 1.0
    assert len(set(m["replica_digest_per_rank"])) == 1  # identical replicas on both ranks
    assert m["sync_row_ratio"] > 1 and m["sync_bytes_per_iteration"] < e["sync_bytes_per_iteration"]
    by_path = json.loads((coded_runs["backward"] / "metrics.json").read_text())["wire_bytes_by_path"]
    assert by_path["replica_sync"] == pytest.approx(m["sync_bytes_per_iteration"])


def _assert_predicted_wire_bytes_match(run_dir: Path) -> None:
    """metrics.json's traffic model (with only cold ids in the all-to-alls, the emptied bags' zero
    row, and the replica sync) against what the run counted, where the prediction uses no ratio
    measured in the same run: the input dist's ids, the exact sync's rows, the distinct rows of
    each chunk. (The all-to-alls' and the coded sync's bytes divide by the ratios this run measured;
    the all-to-alls priced before training are checked in test_codec_ratio.py.)"""
    m = json.loads((run_dir / "metrics.json").read_text())
    measured, predicted = m["wire_bytes_by_path"], m["predicted_wire_bytes_by_path"]
    assert measured["replica_sync"] > 0
    exact = m["hot_rows"]["sync_codec"] == "exact"
    for path in ("input", "allreduce", *(["replica_sync"] if exact else [])):
        rel = 0.05 if path == "replica_sync" else 0.02  # the sync's touched rows: a sample of 12 iterations
        assert predicted[path] == pytest.approx(measured[path], rel=rel, abs=100), path
    for table, d in m["distinct_ids_per_chunk"].items():  # a few rows per chunk: half a row of slack
        assert d["predicted"] == pytest.approx(d["measured"], rel=0.1, abs=0.5), table


@pytest.mark.parametrize("sync", ["exact", "backward"])
def test_predicted_wire_bytes_count_cold_ids_and_the_coded_or_exact_sync(coded_runs, sync):
    _assert_predicted_wire_bytes_match(coded_runs[sync])


def test_predicted_wire_bytes_of_uncompressed_replication_match(runs):
    _assert_predicted_wire_bytes_match(runs["hot"])
