"""dlrm-preprocess against rows parsed independently here with plain str.split and math.log."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data import layout
from data.preprocess import SAMPLE_DIR, main, prepare_sample, preprocess
from data.synthetic import write_tsv
from data.tsv import CriteoFormatError, line_spans
from data.vocab import ValueCounter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TB_FILE = FIXTURES / "day_0_head1000.tsv"
STEMS = ["train", "dev", "test"]


def parse_tsv(path: Path) -> list[list[str]]:
    """Rows as lists of 40 strings, the reference parse (no numpy)."""
    rows = [line.rstrip("\n").split("\t") for line in path.read_text().splitlines(keepends=True)]
    assert all(len(r) == 40 for r in rows)
    return rows


def expected_dense(rows: list[list[str]]) -> np.ndarray:
    return np.array([[math.log(max(int(x), 0) + 1) if x else 0.0 for x in r[1:14]] for r in rows], dtype=np.float32)


def expected_ids(
    rows_by_stem: dict[str, list[list[str]]], threshold: int = 0, modulo: int = 0
) -> tuple[dict, list[int]]:
    """Ids by the documented rule: 0 missing, 1 rare (threshold > 0), then kept values in ascending order."""

    def raw(x: str) -> int:
        v = int(x, 16)
        return v % modulo if modulo else v

    out = {s: np.zeros((len(r), 26), dtype=np.int64) for s, r in rows_by_stem.items()}
    sizes = []
    for f in range(26):
        counts = Counter(raw(r[14 + f]) for rows in rows_by_stem.values() for r in rows if r[14 + f])
        kept = sorted(v for v, c in counts.items() if c >= threshold)
        base = 2 if threshold else 1
        index = {v: base + i for i, v in enumerate(kept)}
        sizes.append(base + len(kept))
        for s, rows in rows_by_stem.items():
            for i, r in enumerate(rows):
                x = r[14 + f]
                out[s][i, f] = 0 if not x else index.get(raw(x), 1)
    return out, sizes


@pytest.fixture(scope="module")
def sample_rows() -> dict[str, list[list[str]]]:
    return {s: parse_tsv(SAMPLE_DIR / f"{s}.tsv") for s in STEMS}


def load(d: Path, stem: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.load(layout.array_path(d, stem, k)) for k in ("dense", "sparse", "labels"))


def test_bundled_sample_equals_independent_parse(tmp_path, sample_rows):
    # tmp_path contains "test" (pytest-...), and so does test.tsv: TorchRec's Kaggle parser would
    # treat these as unlabeled; ours must not.
    out = prepare_sample(tmp_path / "sample")
    meta = json.loads((out / "meta.json").read_text())
    ids, sizes = expected_ids(sample_rows)
    assert meta["num_embeddings"] == sizes
    assert meta["sparse_features"] == [f"cat_{i}" for i in range(26)]
    assert meta["dense_features"] == [f"int_{i}" for i in range(13)]
    for s in STEMS:
        rows = sample_rows[s]
        dense, sparse, labels = load(out, s)
        assert dense.dtype == np.float32 and sparse.dtype == np.int32 and labels.dtype == np.uint8
        np.testing.assert_allclose(dense, expected_dense(rows), rtol=1e-6, atol=0)
        np.testing.assert_array_equal(sparse, ids[s])
        np.testing.assert_array_equal(labels, [int(r[0]) for r in rows])
        info = next(f for f in meta["files"] if f["stem"] == s)
        assert info["rows"] == len(rows) == meta["rows"][s]
        assert info["positives"] == sum(int(r[0]) for r in rows)
    assert sum(meta["rows"].values()) == 8000 and meta["bad_rows"]["count"] == 0


def test_prepare_sample_is_idempotent_and_guards_other_data(tmp_path):
    out = prepare_sample(tmp_path / "s")
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert prepare_sample(tmp_path / "s") == out
    assert (out / "meta.json").stat().st_mtime_ns == stamp  # not rebuilt
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "version": 0}))  # an outdated build
    prepare_sample(out)
    assert json.loads((out / "meta.json").read_text())["version"] == layout.FORMAT_VERSION
    other = tmp_path / "other"
    preprocess([SAMPLE_DIR / "dev.tsv"], other)
    with pytest.raises(FileExistsError, match="another dataset"):
        prepare_sample(other)


def test_terabyte_fixture_counts_equal_an_independent_count(tmp_path):
    rows = parse_tsv(TB_FILE)
    meta = preprocess([TB_FILE], tmp_path / "tb", fmt="terabyte")
    assert meta["format"] == "terabyte"
    assert meta["rows"] == {"day_0_head1000": len(rows)} == {"day_0_head1000": 1000}
    assert meta["files"][0]["positives"] == sum(int(r[0]) for r in rows)
    distinct = [len({r[14 + f] for r in rows if r[14 + f]}) for f in range(26)]
    assert meta["num_embeddings"] == [d + 1 for d in distinct]  # + the missing id
    _, sparse, labels = load(tmp_path / "tb", "day_0_head1000")
    assert [len(np.unique(sparse[:, f][sparse[:, f] > 0])) for f in range(26)] == distinct
    assert int(labels.sum()) == sum(int(r[0]) for r in rows)


@pytest.mark.parametrize("threshold, modulo", [(3, 0), (0, 1000), (2, 97)])
def test_frequency_threshold_and_max_ind_range(tmp_path, sample_rows, threshold, modulo):
    meta = preprocess(
        [SAMPLE_DIR / f"{s}.tsv" for s in STEMS], tmp_path / "d", frequency_threshold=threshold, max_ind_range=modulo
    )
    ids, sizes = expected_ids(sample_rows, threshold, modulo)
    assert meta["num_embeddings"] == sizes
    assert meta["reserved_ids"] == {"missing": 0, "rare": 1 if threshold else None}
    for s in STEMS:
        np.testing.assert_array_equal(load(tmp_path / "d", s)[1], ids[s])
    if modulo:
        assert max(sizes) <= modulo + (2 if threshold else 1)


def test_block_boundaries_do_not_change_the_result(tmp_path):
    files = [SAMPLE_DIR / "dev.tsv", SAMPLE_DIR / "test.tsv"]
    preprocess(files, tmp_path / "big")
    preprocess(files, tmp_path / "tiny", block_bytes=100)  # blocks shorter than a line
    for s in ("dev", "test"):
        for a, b in zip(load(tmp_path / "big", s), load(tmp_path / "tiny", s), strict=True):
            np.testing.assert_array_equal(a, b)


def test_gzip_and_crlf_inputs(tmp_path):
    raw = (SAMPLE_DIR / "dev.tsv").read_bytes()
    gz = tmp_path / "devgz.tsv.gz"
    gz.write_bytes(gzip.compress(raw))
    crlf = tmp_path / "devcrlf.tsv"
    crlf.write_bytes(raw.replace(b"\n", b"\r\n"))
    preprocess([SAMPLE_DIR / "dev.tsv", gz, crlf], tmp_path / "d")
    ref = load(tmp_path / "d", "dev")
    for stem in ("devgz", "devcrlf"):
        for a, b in zip(ref, load(tmp_path / "d", stem), strict=True):
            np.testing.assert_array_equal(a, b)


def test_large_hashes_stay_distinct(tmp_path):
    # Hashes above 2^24 that differ by 1 would merge if they passed through float32.
    base = ["0", *["1"] * 13, *["00000001"] * 26]
    lines = []
    for h in ("ffffff03", "ffffff01", "ffffff02", "01000001", "01000000"):
        row = list(base)
        row[14] = h
        lines.append("\t".join(row))
    path = tmp_path / "big.tsv"
    path.write_text("\n".join(lines) + "\n")
    preprocess([path], tmp_path / "d")
    sparse = load(tmp_path / "d", "big")[1]
    assert sparse[:, 0].tolist() == [5, 3, 4, 2, 1]


BAD = {
    "field_count": (lambda r: r[:-1], "39 TAB-separated fields"),
    "bad_int": (lambda r: [*r[:4], "12a", *r[5:]], "field 5 (int_3)"),
    "bad_hex": (lambda r: [*r[:20], "zz12ab34", *r[21:]], "field 21 (cat_6)"),
    "bad_label": (lambda r: ["2", *r[1:]], "field 1 (label)"),
    "float_int": (lambda r: [*r[:2], "260.0", *r[3:]], "field 3 (int_1)"),
}


def write_with_bad_rows(path: Path, bad: dict[int, str]) -> list[list[str]]:
    """The first 60 sample rows with the given 1-based lines corrupted; returns the good rows."""
    rows = parse_tsv(SAMPLE_DIR / "train.tsv")[:60]
    out, good = [], []
    for i, r in enumerate(rows, start=1):
        if i in bad:
            out.append(BAD[bad[i]][0](list(r)))
        else:
            out.append(r)
            good.append(r)
    path.write_text("".join("\t".join(r) + "\n" for r in out))
    return good


@pytest.mark.parametrize("kind", sorted(BAD))
def test_malformed_row_names_file_line_and_field(tmp_path, kind, capsys):
    path = tmp_path / "bad.tsv"
    write_with_bad_rows(path, {17: kind})
    with pytest.raises(CriteoFormatError) as e:
        preprocess([path], tmp_path / "out")
    assert f"{path}:17: " in str(e.value) and BAD[kind][1] in str(e.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.tsv"]  # no temporary directory left over
    assert main(["--format", "kaggle", "--out", str(tmp_path / "out"), str(path)]) == 1
    assert f"{path}:17: " in capsys.readouterr().err


def test_skip_bad_rows_counts_and_reports(tmp_path, capsys):
    path = tmp_path / "bad.tsv"
    good = write_with_bad_rows(path, {3: "bad_hex", 30: "field_count", 59: "bad_int"})
    meta = preprocess([path], tmp_path / "out", skip_bad_rows=True)
    assert meta["bad_rows"]["count"] == 3
    assert [s.split(": ")[0] for s in meta["bad_rows"]["first"]] == [f"{path}:{n}" for n in (3, 30, 59)]
    assert "skipped 3 malformed rows" in capsys.readouterr().err
    assert meta["rows"] == {"bad": 57}
    dense, sparse, labels = load(tmp_path / "out", "bad")
    np.testing.assert_array_equal(labels, [int(r[0]) for r in good])
    np.testing.assert_allclose(dense, expected_dense(good), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(sparse, expected_ids({"bad": good})[0]["bad"])


def test_failed_run_keeps_the_existing_dataset(tmp_path, monkeypatch):
    out = tmp_path / "out"
    preprocess([SAMPLE_DIR / "dev.tsv"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="--overwrite"):
        preprocess([SAMPLE_DIR / "test.tsv"], out)
    bad = tmp_path / "bad.tsv"
    write_with_bad_rows(bad, {50: "bad_int"})
    with pytest.raises(CriteoFormatError):
        preprocess([bad], out, overwrite=True)

    def crash(self, block):  # an interruption in the middle of the write pass
        raise KeyboardInterrupt

    monkeypatch.setattr(layout.NpyWriter, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        preprocess([SAMPLE_DIR / "test.tsv"], out, overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        preprocess([SAMPLE_DIR / "test.tsv"], tmp_path / "new")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv", "out"]


def test_cli_writes_and_refuses_to_clobber(tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["--format", "terabyte", "--out", str(out), "--frequency-threshold", "2", str(TB_FILE)]
    assert main(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["options"] == {"frequency_threshold": 2, "max_ind_range": 0, "skip_bad_rows": False}
    assert main(args) == 1 and "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite", "-q"]) == 0
    assert main(["--format", "kaggle", "--out", str(tmp_path / "x"), str(tmp_path / "missing.tsv")]) == 1
    assert "missing.tsv: no such file" in capsys.readouterr().err
    dev = str(SAMPLE_DIR / "dev.tsv")
    dup = ["--format", "kaggle", "--out", str(tmp_path / "y"), dev, dev]
    assert main(dup) == 1 and "stem" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def test_value_counter_matches_a_plain_count():
    rng = np.random.default_rng(0)
    counter, ref = ValueCounter(), Counter()
    for i in range(300):
        n = int(rng.integers(0, 400))
        pool = 5 if i % 3 == 0 else 10**6  # small and large vocabularies, empty chunks too
        vals = (rng.zipf(1.3, n) % pool).astype(np.uint64) + np.uint64(2**63 - 7)  # beyond float precision
        counter.add(vals)
        ref.update(int(v) for v in vals)
    values, counts = counter.result()
    assert values.tolist() == sorted(ref) and counts.tolist() == [ref[v] for v in sorted(ref)]


def same_dataset(a: Path, b: Path) -> None:
    """Equal arrays byte for byte, and equal meta.json but for the clock."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name.endswith(".npy"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    for m in (meta_a, meta_b):
        del m["created"], m["seconds"]
    assert meta_a == meta_b


def test_workers_write_the_same_bytes_on_the_real_sample(tmp_path):
    files = [SAMPLE_DIR / f"{s}.tsv" for s in STEMS]
    preprocess(files, tmp_path / "one")
    # Spans of ~50 kB: train.tsv alone is cut into 36, each block shorter than many lines.
    preprocess(files, tmp_path / "two", workers=2, span_bytes=50_000, block_bytes=4096)
    same_dataset(tmp_path / "one", tmp_path / "two")


def test_workers_write_the_same_bytes_on_generated_files_with_bad_rows(tmp_path):
    files = []
    for stem, rows, seed in (("day_0", 3000, 1), ("day_1", 2000, 2), ("day_2", 1500, 3)):
        path = tmp_path / f"{stem}.tsv"
        write_tsv(path, stem, rows, seed=seed, max_cardinality=3000)
        files.append(path)
    lines = files[0].read_bytes().split(b"\n")
    for n in (2, 1234, 2999):  # 1-based lines made malformed, spread over the spans
        lines[n - 1] = lines[n - 1].replace(b"\t", b"\tx", 1)
    files[0].write_bytes(b"\n".join(lines))
    gz = tmp_path / "day_3.tsv.gz"  # one span whatever the workers: gzip cannot be entered midway
    gz.write_bytes(gzip.compress(b"".join(files[2].read_bytes().splitlines(keepends=True)[:200])))
    files.append(gz)
    kw = dict(fmt="terabyte", frequency_threshold=2, max_ind_range=2500, skip_bad_rows=True)
    one = preprocess(files, tmp_path / "one", **kw)
    three = preprocess(files, tmp_path / "three", workers=3, span_bytes=30_000, **kw)
    same_dataset(tmp_path / "one", tmp_path / "three")
    assert one["bad_rows"] == three["bad_rows"]
    assert [s.split(": ")[0] for s in three["bad_rows"]["first"]] == [f"{files[0]}:{n}" for n in (2, 1234, 2999)]
    assert three["rows"]["day_0"] == 2997 and three["rows"]["day_1"] == 2000


def test_workers_name_the_true_line_of_a_malformed_row(tmp_path, capsys):
    path = tmp_path / "bad.tsv"
    rows = parse_tsv(SAMPLE_DIR / "train.tsv")[:3000]
    rows[2716] = BAD["bad_hex"][0](list(rows[2716]))  # line 2717, deep inside a later span
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    with pytest.raises(CriteoFormatError) as one:
        preprocess([path], tmp_path / "out")
    with pytest.raises(CriteoFormatError) as two:
        preprocess([path], tmp_path / "out", workers=2, span_bytes=40_000)
    assert str(two.value) == str(one.value) and f"{path}:2717: field 21 (cat_6)" in str(two.value)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.tsv"]  # no temporary directory left
    assert main(["--format", "kaggle", "--workers", "2", "--out", str(tmp_path / "out"), str(path)]) == 1
    assert f"{path}:2717: " in capsys.readouterr().err


@pytest.mark.parametrize("tail", [b"\n", b""])
def test_line_spans_cut_at_line_starts_and_cover_the_file(tmp_path, tail):
    body = b"".join(b"x" * n + b"\n" for n in (3, 0, 50, 1, 1, 200, 7)) + b"last" + tail
    path = tmp_path / "f.tsv"
    path.write_bytes(body)
    starts = {0} | {i + 1 for i, c in enumerate(body) if c == 10}
    for parts in (1, 2, 3, 5, 8, 40, 400):
        spans = line_spans(path, parts)
        assert 1 <= len(spans) <= parts
        assert spans[0][0] == 0 and spans[-1][1] is None
        assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(spans))  # contiguous, non-empty
        assert {a for a, _ in spans} <= starts
    assert len(line_spans(path, 40)) >= 4


def _independent_frequency(ids_by_stem: dict[str, np.ndarray], feature: int) -> list[tuple[int, int]]:
    """(id, count) of one feature over every stem, most frequent first, ties by id (plain Counter)."""
    counts = Counter(int(i) for ids in ids_by_stem.values() for i in ids[:, feature])
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


@pytest.mark.parametrize("threshold", [0, 3])
def test_frequency_statistics_equal_an_independent_count_of_the_real_rows(tmp_path, sample_rows, threshold):
    out = tmp_path / "d"
    preprocess([SAMPLE_DIR / f"{s}.tsv" for s in STEMS], out, frequency_threshold=threshold, top_ids=7)
    meta = json.loads((out / "meta.json").read_text())
    ids, _ = expected_ids(sample_rows, threshold)
    freq = meta["frequency"]
    assert (freq["source"], freq["top_n"], len(freq["features"])) == ("counted", 7, 26)
    for f, entry in enumerate(freq["features"]):
        ranked = _independent_frequency(ids, f)
        assert entry["lookups"] == sum(len(r) for r in sample_rows.values())
        assert entry["distinct"] == len(ranked)
        assert entry["singletons"] == sum(1 for _, c in ranked if c == 1)
        assert entry["top_ids"] == [i for i, _ in ranked[:7]]
        assert entry["top_counts"] == [c for _, c in ranked[:7]]


def test_cli_top_ids(tmp_path):
    assert (
        main(["--format", "kaggle", "--out", str(tmp_path / "d"), "--top-ids", "3", "-q", str(SAMPLE_DIR / "dev.tsv")])
        == 0
    )
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert all(len(f["top_ids"]) == min(3, f["distinct"]) for f in meta["frequency"]["features"])
    assert max(len(f["top_ids"]) for f in meta["frequency"]["features"]) == 3
