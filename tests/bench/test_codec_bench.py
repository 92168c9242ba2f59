"""The codec benchmark runs end to end on tiny inputs; its ratios, errors and bound checks mean what
they say (checked against byte counts and bounds worked out independently)."""

import json

import pytest
import torch

import dlrm_compression as compression
from dlrm.bench import codec as bench
from dlrm.bench.criteo_like import criteo_like_batch

FIELDS = {
    "codec",
    "mode",
    "eb",
    "ratio",
    "max_abs_error",
    "bound_held",
    "compress_MBps",
    "decompress_MBps",
    "decompress_into_MBps",
    "bytes_in",
    "bytes_out",
    "max_error_over_bound",
}


def _run(tmp_path, *argv):
    out = tmp_path / "bench.json"
    assert bench.main([*argv, "--repeats", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_generated_batch_reports_every_codec_and_bounds_hold(tmp_path, capsys):
    data = _run(tmp_path, "--rows", "64", "--tables", "3", "--dim", "8", "--clock", "cpu")
    results = data["results"]
    assert all(set(r) == FIELDS for r in results)
    labels = {r["codec"] for r in results}
    assert labels == {v.label for v in bench.VARIANTS}  # every baseline runs on CPU
    lossy = [r for r in results if r["bound_held"] is not None]
    assert {(r["mode"], r["eb"]) for r in lossy} == {(m, e) for m in ("abs", "rel") for e in bench.BOUNDS}
    assert all(r["bound_held"] and r["max_error_over_bound"] <= 1.0 for r in lossy)
    assert all(
        r["ratio"] > 0 and r["compress_MBps"] > 0 and r["decompress_MBps"] > 0 and r["decompress_into_MBps"] > 0
        for r in results
    )
    assert data["config"]["tables"] == 3 and data["config"]["rows"] == 3 * 64
    assert "| lossy+ids zstd | abs | 0.001 |" in capsys.readouterr().out


def test_input_file_without_ids_skips_the_id_variants(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "batch.pt"
    torch.save(
        {"a": {"values": torch.randn(40, 16, generator=g)}, "b": {"values": torch.randn(40, 8, generator=g) * 1e-3}},
        path,
    )
    data = _run(tmp_path, "--input", str(path), "--codecs", "lossy,none", "--bounds", "1e-3")
    assert {r["codec"] for r in data["results"]} == {"lossy zstd (index sent)", "lossy fixed (index sent)", "none"}
    assert all(r["bound_held"] for r in data["results"] if r["bound_held"] is not None)
    assert "not every table has ids" in capsys.readouterr().err


def test_bad_input_file_names_the_table(tmp_path):
    path = tmp_path / "bad.pt"
    torch.save({"a": {"values": torch.randn(4)}}, path)
    with pytest.raises(ValueError, match="table 'a'"):
        bench.main(["--input", str(path)])


# ---------------------------------------------------------------- what the reported numbers mean

ROWS, TABLES, DIM = 64, 3, 8  # the generated batch of the runs below (seed 0)
RAW_PER_TABLE = ROWS * DIM * 4  # 2,048 fp32 bytes per table payload
# The payload container of one table with one block and one section (compression/format.py):
# 24-byte prefix (magic 4, version/codec/dtype/flags 4, header length 4, total length 8, crc32 4)
# + 20 bytes rows/cols/blocks/sections (8 + 4 + 4 + 4) + one block's width and bound (4 + 8)
# + 4 codec info words (16) + one section length (8) = 80 bytes, already a multiple of 8.
HEADER = 24 + 20 + 12 + 16 + 8


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One benchmark of every codec on the generated Criteo-like batch, and that batch."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    argv = ["--rows", str(ROWS), "--tables", str(TABLES), "--dim", str(DIM), "--clock", "cpu", "--repeats", "1"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    tables = criteo_like_batch(rows=ROWS, tables=TABLES, dim=DIM, seed=0)
    return rows, [t["values"] for t in tables.values()]


def _row(rows, codec, mode="-", eb=None):
    (row,) = [r for r in rows if r["codec"] == codec and r["mode"] == mode and r["eb"] == eb]
    return row


def test_cast_ratios_are_raw_bytes_over_payload_bytes(generated):
    rows, _ = generated
    none, fp16, bf16 = _row(rows, "none"), _row(rows, "fp16"), _row(rows, "bf16")
    # none sends the 2,048 raw bytes plus the header: 2,048 / 2,128 = 0.962 (1.0 less the header);
    # fp16 and bf16 send 1,024 bytes plus the header: 2,048 / 1,104 = 1.855 (2.0 less the header)
    assert none["bytes_in"] == TABLES * RAW_PER_TABLE == 6144
    assert none["bytes_out"] == TABLES * (RAW_PER_TABLE + HEADER) == 6384
    assert none["ratio"] == pytest.approx(2048 / 2128, rel=1e-12)
    for cast in (fp16, bf16):
        assert cast["bytes_out"] == TABLES * (RAW_PER_TABLE // 2 + HEADER) == 3312
        assert cast["ratio"] == pytest.approx(2048 / 1104, rel=1e-12)


def test_cast_errors_are_those_of_rounding_to_the_wire_dtype(generated):
    rows, values = generated
    largest = max(float(v.abs().max()) for v in values)
    assert _row(rows, "none")["max_abs_error"] == 0.0
    # round to nearest: at most half a unit in the last place, 2^-11 of |x| for fp16 (10 stored
    # mantissa bits; plus 2^-25 below its smallest normal), 2^-8 of |x| for bf16 (7 bits)
    fp16, bf16 = _row(rows, "fp16")["max_abs_error"], _row(rows, "bf16")["max_abs_error"]
    assert 0 < fp16 <= largest * 2**-11 + 2**-25
    assert 0 < bf16 <= largest * 2**-8
    assert bf16 > fp16


def test_bounded_rows_report_a_max_error_within_the_bound(generated):
    rows, values = generated
    ranges = [float(v.max() - v.min()) for v in values]  # each table's value range
    bounded = [r for r in rows if r["bound_held"] is not None]
    lossy_labels = {v.label for v in bench.VARIANTS if v.codec == "lossy"}
    assert sum(r["codec"] in lossy_labels for r in bounded) == len(lossy_labels) * 2 * len(bench.BOUNDS)
    for r in bounded:
        if r["mode"] == "abs":
            bounds = [r["eb"]] * TABLES
            assert r["max_error_over_bound"] == pytest.approx(r["max_abs_error"] / r["eb"])
        else:  # rel: eb times each table's range
            bounds = [r["eb"] * span for span in ranges]
            assert r["max_error_over_bound"] >= r["max_abs_error"] / max(bounds) * (1 - 1e-9)
        assert r["bound_held"] is True and r["max_error_over_bound"] <= 1.0, r
        assert r["max_abs_error"] <= max(bounds), r
        if r["codec"] in lossy_labels:  # it spends its bound: not lossless, half the bound used somewhere
            assert r["max_abs_error"] >= 0.5 * min(bounds), r


def test_bound_held_is_false_when_the_error_exceeds_the_bound(monkeypatch):
    # a codec that ignores its bound (sends fp16) must be reported as breaking it at 1e-4 abs
    tables = criteo_like_batch(rows=ROWS, tables=TABLES, dim=DIM, seed=0)
    for t in tables.values():
        t["values"] = t["values"] * 100  # |x| up to ~4: fp16 rounding errors reach ~1e-3
    real = compression.get_codec

    def lying(name, **params):
        codec = real("fp16")
        codec.bounded = True
        return codec

    monkeypatch.setattr(compression, "get_codec", lying)
    rows = bench.benchmark(tables, 1, [bench.Variant("liar", "lossy", {})], [1e-4], log=lambda m: None)
    abs_row = next(r for r in rows if r.mode == "abs")
    assert abs_row.max_abs_error > 1e-4
    assert abs_row.bound_held is False and abs_row.max_error_over_bound == pytest.approx(abs_row.max_abs_error / 1e-4)


def test_lossy_compresses_more_than_fp16_on_the_criteo_like_batch(generated):
    rows, _ = generated
    fp16 = _row(rows, "fp16")["ratio"]
    lossy = [r for r in rows if r["codec"].startswith("lossy")]
    assert len(lossy) == 4 * 2 * len(bench.BOUNDS)  # 4 lossy variants x abs/rel x 3 bounds
    assert all(r["ratio"] > fp16 for r in lossy), [(r["codec"], r["mode"], r["eb"], r["ratio"]) for r in lossy]
    # a looser bound never costs ratio, and duplicate ids sent as ids beat sending the row index
    for mode in ("abs", "rel"):
        zstd = [_row(rows, "lossy+ids zstd", mode, eb)["ratio"] for eb in sorted(bench.BOUNDS)]
        assert zstd == sorted(zstd)
        for eb in bench.BOUNDS:
            assert (
                _row(rows, "lossy+ids zstd", mode, eb)["ratio"]
                > _row(rows, "lossy zstd (index sent)", mode, eb)["ratio"]
            )


def test_hand_made_batch_reports_the_rounding_error_and_ratio_worked_out_by_hand(tmp_path):
    # 1 + 2^-12 lies a quarter of an fp16 step (2^-10 near 1) above 1.0 and rounds down to it, so
    # every value comes back 2^-12 = 0.000244140625 too small; bf16 (step 2^-7) does the same.
    path = tmp_path / "batch.pt"
    torch.save({"a": {"values": torch.full((1000, 16), 1 + 2**-12)}}, path)
    data = _run(tmp_path, "--input", str(path), "--codecs", "fp16,bf16,none")
    rows = {r["codec"]: r for r in data["results"]}
    assert rows["fp16"]["max_abs_error"] == rows["bf16"]["max_abs_error"] == 2**-12
    assert rows["none"]["max_abs_error"] == 0.0
    # 1,000 x 16 x 4 = 64,000 raw bytes; fp16 sends 32,000 + the 80-byte header: 64,000 / 32,080
    assert rows["fp16"]["ratio"] == pytest.approx(64000 / 32080, rel=1e-12)  # 1.995, 2.0 less the header
    assert rows["none"]["ratio"] == pytest.approx(64000 / 64080, rel=1e-12)
