"""The codec benchmark runs end to end on tiny inputs and reports every bounded codec's bound."""

import json

import pytest
import torch

from compression import bench

FIELDS = {"codec", "mode", "eb", "ratio", "max_abs_error", "bound_held", "compress_MBps",
          "decompress_MBps", "decompress_into_MBps", "bytes_in", "bytes_out",
          "max_error_over_bound"}


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
    assert all(r["ratio"] > 0 and r["compress_MBps"] > 0 and r["decompress_MBps"] > 0
               and r["decompress_into_MBps"] > 0 for r in results)
    assert data["config"]["tables"] == 3 and data["config"]["rows"] == 3 * 64
    assert "| lossy+ids zstd | abs | 0.001 |" in capsys.readouterr().out


def test_input_file_without_ids_skips_the_id_variants(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "batch.pt"
    torch.save({"a": {"values": torch.randn(40, 16, generator=g)},
                "b": {"values": torch.randn(40, 8, generator=g) * 1e-3}}, path)
    data = _run(tmp_path, "--input", str(path), "--codecs", "lossy,none", "--bounds", "1e-3")
    assert {r["codec"] for r in data["results"]} == {"lossy zstd (index sent)", "lossy fixed (index sent)", "none"}
    assert all(r["bound_held"] for r in data["results"] if r["bound_held"] is not None)
    assert "not every table has ids" in capsys.readouterr().err


def test_bad_input_file_names_the_table(tmp_path):
    path = tmp_path / "bad.pt"
    torch.save({"a": {"values": torch.randn(4)}}, path)
    with pytest.raises(ValueError, match="table 'a'"):
        bench.main(["--input", str(path)])
