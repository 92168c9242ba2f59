"""Projections to 1,024 GPUs (python -m dlrm.bench.projection): one node is the one-level cost
model, bytes per rank are the collectives' counts, and the choices scale as their algorithms say."""

from __future__ import annotations

import pytest

from dlrm.bench import projection as pj
from dlrm.performance import cost_model as cm
from dlrm.performance import network as net


def _row(rows: list[pj.Row], config: str, gpus: int) -> pj.Row:
    return next(r for r in rows if r.config == config and r.gpus == gpus)


def test_one_node_of_8_is_the_one_level_model_on_nvlink():
    rows = pj.project(gpus=(8,), inter_gbit=100)
    link = net.Link(pj.INTRA_BYTES_PER_S["a100"], latency_s=pj.LATENCY_S["intra"])
    w = cm.Workload(**{**pj.WORKLOAD.__dict__, "ranks": 8})
    none = cm.iteration_time(w, link)
    assert _row(rows, "none", 8).breakdown.as_dict() == pytest.approx(none.as_dict(), rel=1e-12)
    lossy = cm.CodecCost(pj.RATIOS["lossy"][0], *pj.LOSSY_TPUT)
    lossy_bwd = cm.CodecCost(pj.RATIOS["lossy"][1], *pj.LOSSY_TPUT)
    expected = cm.iteration_time(w, link, lossy, lossy_bwd)
    assert _row(rows, "lossy", 8).ms == pytest.approx(1e3 * expected.total, rel=1e-12)


@pytest.mark.parametrize("gpus", [8, 32, 1024])
def test_uncompressed_bytes_per_rank_are_the_collectives_counts(gpus):
    w = cm.Workload(**{**pj.WORKLOAD.__dict__, "ranks": gpus})
    expected = 2 * w.a2a_bytes() + w.input_dist_bytes() + net.ring_allreduce_bytes(w.dense_params, gpus)
    row = _row(pj.project(gpus=(gpus,)), "none", gpus)
    assert row.bytes_per_rank == pytest.approx(expected, rel=1e-12)
    # across nodes: 8 of every rank's peers share its node (the all-to-alls), one hop in 8 (the ring)
    peers_across = 0 if gpus == 8 else (gpus - 8) / (gpus - 1)
    ring_across = 0 if gpus == 8 else net.ring_allreduce_bytes(w.dense_params, gpus) / 8
    across = (2 * w.a2a_bytes() + w.input_dist_bytes()) * peers_across + ring_across
    assert row.inter_bytes_per_rank == pytest.approx(across, rel=1e-12)


def test_dct_all_gather_grows_with_the_ranks_and_the_reduce_scatter_does_not():
    rows = pj.project(inter_gbit=200)
    gather = [_row(rows, "lossy+dct", n).bytes_per_rank for n in pj.GPUS]
    split = [_row(rows, "lossy+dct (reduce_scatter)", n).bytes_per_rank for n in pj.GPUS]
    assert gather[-1] > 4 * gather[0] and split[-1] < 1.6 * split[0]
    assert gather[-1] > 3 * split[-1]


@pytest.mark.parametrize("rate", pj.INTER_GBIT)
def test_compression_pays_across_nodes_and_auto_stays_near_the_best(rate):
    rows = pj.project(inter_gbit=rate)
    for n in pj.GPUS[1:]:
        assert _row(rows, "lossy", n).ms < _row(rows, "qcomm_fp16", n).ms < _row(rows, "none", n).ms
    for n in pj.GPUS:
        best = min(r.ms for r in rows if r.gpus == n)
        assert _row(rows, "auto+auto", n).ms <= 1.03 * best


def test_faster_nics_shorten_every_multi_node_iteration():
    slow, fast = pj.project(inter_gbit=100), pj.project(inter_gbit=400)
    for a, b in zip(slow, fast, strict=True):
        if a.config != "auto+auto":  # one node never crosses: the same time
            assert a.ms > b.ms if a.gpus > 8 else a.ms == b.ms


def test_the_command_prints_a_table_per_rate_and_draws_the_plot(tmp_path, capsys):
    out = tmp_path / "scaling.png"
    assert pj.main(["--inter-gbit", "200", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "200 Gbit/s per GPU" in text and text.count("| auto+auto |") == 1
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        pj.main(["--inter-gbit", "-1"])
