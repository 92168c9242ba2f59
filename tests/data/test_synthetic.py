"""The synthetic generator: label rate, caps, Zipf skew, learnable labels, same format as real data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data import layout
from data.loader import criteo_batches
from data.preprocess import preprocess
from data.synthetic import HiddenModel, ZipfSampler, generate, kaggle_cardinalities, main, write_tsv

CAP = 20000
SEED = 1


def load(d, stem):
    return tuple(np.load(layout.array_path(d, stem, k)) for k in ("dense", "sparse", "labels"))


def rank_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with average ranks for ties)."""
    order = np.argsort(scores, kind="stable")
    s = scores[order]
    ranks = np.empty(len(s))
    first = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    last = np.r_[first[1:], len(s)]
    avg = (first + last + 1) / 2  # 1-based average rank of each run of ties
    ranks[order] = np.repeat(avg, last - first)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth") / "d"
    meta = generate(d, {"train": 60000, "test": 15000}, seed=SEED, max_cardinality=CAP)
    return d, meta


def test_format_and_caps(synth):
    d, meta = synth
    assert json.loads((d / "meta.json").read_text()) == meta
    assert meta["num_embeddings"] == [min(c, CAP) for c in kaggle_cardinalities()]
    for stem, n in (("train", 60000), ("test", 15000)):
        dense, sparse, labels = load(d, stem)
        assert dense.shape == (n, 13) and dense.dtype == np.float32 and (dense >= 0).all()
        assert sparse.shape == (n, 26) and sparse.dtype == np.int32
        assert labels.shape == (n,) and labels.dtype == np.uint8 and set(np.unique(labels)) == {0, 1}
        assert (sparse >= 0).all() and (sparse < np.array(meta["num_embeddings"])).all()
    assert abs((load(d, "train")[1][:, 21] == 0).mean() - 0.82) < 0.02  # C22 is 82% missing


def test_positive_rate(synth):
    d, meta = synth
    for f in meta["files"]:
        labels = load(d, f["stem"])[2]
        assert f["positives"] == int(labels.sum())
        assert abs(labels.mean() - 0.25) < 0.015


def test_zipf_skew(synth):
    d, meta = synth
    sparse = load(d, "train")[1]
    for f in (2, 3, 11):  # big tables (millions of values in Kaggle, capped here)
        v = sparse[:, f][sparse[:, f] > 0]
        counts = np.sort(np.bincount(v))[::-1]
        assert 0.05 < counts[0] / len(v) < 0.35
        ranks = np.arange(1, 21)
        slope = -np.polyfit(np.log(ranks), np.log(counts[:20]), 1)[0]
        assert abs(slope - meta["synthetic"]["zipf_exponents"][f]) < 0.25
        assert 1.05 <= meta["synthetic"]["zipf_exponents"][f] <= 1.3
    for f in (8, 19):  # 3- and 4-value tables: dominated by one id
        v = sparse[:, f][sparse[:, f] > 0]
        assert np.bincount(v).max() / len(v) > 0.6


def test_zipf_sampler_matches_the_exact_law():
    for n, s, head in ((50, 1.2, 8), (1000, 1.05, 64), (7, 2.0, 4096), (300, 1.0, 16)):
        u = np.random.default_rng(0).random(400_000)
        r = ZipfSampler(n, s, head=head).sample(u)
        assert r.min() >= 1 and r.max() <= n
        pmf = np.arange(1, n + 1, dtype=float) ** -s
        pmf /= pmf.sum()
        emp = np.bincount(r, minlength=n + 1)[1:] / len(u)
        assert np.abs(emp - pmf).max() < 0.005
        assert abs(emp[head:].sum() - pmf[head:].sum()) < 0.01  # tail mass


def test_hidden_model_auc_is_reported_and_learnable(synth):
    d, meta = synth
    hidden = meta["synthetic"]["hidden_model"]
    model = HiddenModel.build(SEED, CAP, (1.05, 1.3), 0.25)
    for stem in ("train", "test"):
        dense, sparse, labels = load(d, stem)
        auc = rank_auc(model.logits(dense, sparse.astype(np.int64)), labels)
        assert abs(auc - hidden[stem]["auc"]) < 2e-3
        assert hidden[stem]["auc"] > 0.75
    # A simple learner that sees only the train rows beats chance clearly on test: summed
    # smoothed log-odds of each id's click rate (naive Bayes style).
    _, s_tr, y_tr = load(d, "train")
    _, s_te, y_te = load(d, "test")
    prior = y_tr.mean()
    score = np.zeros(len(y_te))
    for f in range(26):
        n = np.bincount(s_tr[:, f], minlength=meta["num_embeddings"][f])
        k = np.bincount(s_tr[:, f], weights=y_tr, minlength=meta["num_embeddings"][f])
        rate = (k + 20 * prior) / (n + 20)
        score += np.log(rate / (1 - rate))[s_te[:, f]]
    assert rank_auc(score, y_te) > 0.65


def test_reproducible_and_stems_independent(tmp_path):
    a = generate(tmp_path / "a", {"train": 3000, "dev": 500}, seed=7, max_cardinality=1000)
    generate(tmp_path / "b", {"dev": 500}, seed=7, max_cardinality=1000)
    generate(tmp_path / "c", {"dev": 500}, seed=8, max_cardinality=1000)
    for x, y in zip(load(tmp_path / "a", "dev"), load(tmp_path / "b", "dev"), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(load(tmp_path / "a", "dev")[1], load(tmp_path / "c", "dev")[1])
    assert a["rows"] == {"train": 3000, "dev": 500}
    with pytest.raises(FileExistsError):
        generate(tmp_path / "a", {"dev": 5}, seed=7)


def test_tsv_writer_round_trips_through_the_preprocessor(tmp_path):
    generate(tmp_path / "gen", {"dev": 4000}, seed=3, max_cardinality=5000, chunk_rows=1500)
    write_tsv(tmp_path / "dev.tsv", "dev", 4000, seed=3, max_cardinality=5000, chunk_rows=1500)
    preprocess([tmp_path / "dev.tsv"], tmp_path / "pre")
    g_dense, g_sparse, g_labels = load(tmp_path / "gen", "dev")
    p_dense, p_sparse, p_labels = load(tmp_path / "pre", "dev")
    np.testing.assert_array_equal(g_labels, p_labels)
    np.testing.assert_array_equal(g_dense, p_dense)
    for f in range(26):  # ids differ (hashes sort differently) but name the same partition of rows
        g, p = g_sparse[:, f].astype(np.int64), p_sparse[:, f].astype(np.int64)
        assert np.array_equal(g == 0, p == 0)
        pairs = np.unique(g * 10**6 + p)
        assert len(pairs) == len(np.unique(g)) == len(np.unique(p))


def test_loader_reads_synthetic_data_and_cli(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "cli"), "--rows", "train=300,test=50", "--max-cardinality", "64"]) == 0
    assert "hidden model" in capsys.readouterr().out
    batches = list(criteo_batches(tmp_path / "cli", ["train", "test"], 64, 0, 2, True, 0))
    assert len(batches) == 3 and sum(len(b.labels) for b in batches) == 64 * 2 + 47  # tail 94 split 47/47
    assert main(["--out", str(tmp_path / "cli"), "--rows", "train=10"]) == 1
    assert main(["--out", str(tmp_path / "tsv"), "--rows", "day_0=20", "--tsv"]) == 0
    assert len((tmp_path / "tsv" / "day_0.tsv").read_text().splitlines()) == 20
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--rows", "train:10"])


def test_recorded_frequency_counts_the_written_ids(synth):
    d, meta = synth
    sparse = np.concatenate([load(d, s)[1] for s in ("train", "test")]).astype(np.int64)
    freq = meta["frequency"]
    assert freq["source"] == "synthetic" and len(freq["features"]) == 26
    for f in (0, 2, 8):
        counts = np.bincount(sparse[:, f])
        seen = np.flatnonzero(counts)
        order = seen[np.lexsort((seen, -counts[seen]))]
        entry = freq["features"][f]
        assert (entry["lookups"], entry["distinct"]) == (len(sparse), len(seen))
        n = len(entry["top_ids"])
        assert entry["top_ids"] == order[:n].tolist() and entry["top_counts"] == counts[order[:n]].tolist()
        # the fitted exponent of the big tables is near the generator's (log-spaced fit over the whole range)
        if f == 2:
            assert abs(entry["zipf_s"] - meta["synthetic"]["zipf_exponents"][f]) < 0.3
