"""The cost model's algebra: byte counts, Amdahl limits, monotonicity, the published arithmetic, stage choice."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_runs import REPO

from dlrm.performance import cost_model as cm
from dlrm.performance import network as net

GB = 1e9


def _explicit_a2a_bytes(ranks: int, batch: int, dims: list[int], value_bytes: int = 4) -> float:
    """Mean bytes a rank sends, counted peer by peer over an explicit round-robin table placement."""
    owner = [t % ranks for t in range(len(dims))]
    sent = [0] * ranks
    for src in range(ranks):
        for dst in range(ranks):
            if dst != src:  # a rank's own samples never travel
                sent[src] += batch * sum(d for t, d in enumerate(dims) if owner[t] == src) * value_bytes
    return sum(sent) / ranks


@pytest.mark.parametrize("ranks,batch,dims", [(2, 2048, [64] * 26), (4, 100, [16, 32, 64]), (3, 7, [8] * 5)])
def test_a2a_bytes_match_a_peer_by_peer_count(ranks, batch, dims):
    w = cm.Workload(ranks, batch, tuple(dims))
    assert w.a2a_bytes() == pytest.approx(_explicit_a2a_bytes(ranks, batch, dims))


def test_published_terabyte_setup_sends_13_2_mb_per_rank_and_direction():
    # The Terabyte recipe on 32 GPUs: 2,048 samples per GPU, 26 tables of dim 64, fp32.
    # By hand: 2,048 samples x 26 tables = 53,248 pooled rows x 64 values = 3,407,872 values
    # x 4 B = 13,631,488 B per rank's worth of samples; a rank's share of the tables serves all
    # 32 ranks, and the 1/32 that belongs to its own samples stays home:
    # 13,631,488 x 31 / 32 = 13,205,504 B = 13.2 MB.
    w = cm.Workload(32, 2048, (64,) * 26)
    assert w.a2a_bytes() == 13_205_504
    assert f"{w.a2a_bytes() / 1e6:.1f} MB per rank and direction" == "13.2 MB per rank and direction"
    assert "(13.2 MB per rank and direction)" in (REPO / "docs" / "cost_model.md").read_text()


def test_shared_link_carries_every_ranks_bytes():
    # 4 ranks send 1 MB each. On a link per rank at 100 MB/s that takes 1e6 / 1e8 = 10 ms; on one
    # shared 100 MB/s medium all 4 MB queue: 40 ms, and each rank sees 100 / 4 = 25 MB/s.
    assert net.Link(1e8, shared=False).seconds(1e6, 4) == pytest.approx(0.010)
    assert net.Link(1e8, shared=True).seconds(1e6, 4) == pytest.approx(0.040)
    assert net.Link(1e8, shared=True).per_rank_bytes_per_s(4) == pytest.approx(25e6)


def test_a_shaper_burst_passes_free_at_the_start_of_each_collective():
    link = net.Link(1e7, shared=True, burst_bytes=2**20)
    # 2 ranks x 3 MB = 6,000,000 B on the medium; the 1 MiB bucket (1,048,576 B) passes at once,
    # the other 4,951,424 B drain at 10 MB/s: 0.4951424 s.
    assert link.seconds(3e6, 2) == pytest.approx(0.4951424)
    assert link.seconds(4e5, 2) == 0.0  # 2 x 400 kB = 800,000 B fits in the 1,048,576 B bucket
    assert net.Link(1e7, latency_s=0.01, burst_bytes=2**20).seconds(1.0, 2) == pytest.approx(0.01)


def _ring_allreduce_sent(ranks: int, params: int, value_bytes: int = 4) -> float:
    """Mean bytes a rank sends in a ring all-reduce, played out step by step: the parameters are cut
    into one chunk per rank; N-1 reduce-scatter steps and N-1 all-gather steps, in each of which
    every rank passes one chunk to its right-hand neighbour."""
    chunk = [params // ranks + (1 if c < params % ranks else 0) for c in range(ranks)]
    sent = [0] * ranks
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(ranks - 1):
            for r in range(ranks):
                c = (r - step + (1 if phase == "all-gather" else 0)) % ranks  # the chunk r passes on
                sent[r] += chunk[c] * value_bytes
    return sum(sent) / ranks


@pytest.mark.parametrize("ranks,params", [(4, 1000), (3, 10), (32, 762_177), (1, 50)])
def test_ring_allreduce_bytes_match_a_step_by_step_ring(ranks, params):
    w = cm.Workload(ranks, 1, (1,), dense_params=params)
    assert w.allreduce_bytes() == pytest.approx(_ring_allreduce_sent(ranks, params))


def test_ring_allreduce_of_four_ranks_by_hand():
    # 1,000 fp32 parameters on 4 ranks: chunks of 250 values = 1,000 B; each rank passes on 3 chunks
    # while reducing and 3 while gathering: 6 x 1,000 B = 6,000 B.
    assert cm.Workload(4, 1, (1,), dense_params=1000).allreduce_bytes() == 6000


def _workload(compute_s: float = 0.05) -> cm.Workload:
    return cm.Workload(ranks=8, batch_per_rank=1024, dims=(64,) * 26, dense_params=700_000, compute_s=compute_s)


@settings(max_examples=60, deadline=None)
@given(ratio=st.floats(1.0, 1e4), enc=st.floats(1e8, 1e12), dec=st.floats(1e8, 1e12), gbps=st.floats(0.01, 100.0))
def test_speedup_never_exceeds_the_amdahl_limit(ratio, enc, dec, gbps):
    w, link = _workload(), net.Link(gbps * GB)
    base = cm.iteration_time(w, link)
    codec = cm.CodecCost(ratio, enc, dec)
    new = cm.iteration_time(w, link, codec, codec)
    assert cm.speedup(base, new) <= cm.amdahl_limit(base.a2a_share) + 1e-12


def test_a_free_infinite_ratio_codec_reaches_the_amdahl_limit():
    w, link = _workload(), net.Link(1 * GB)
    base = cm.iteration_time(w, link)
    near_free = cm.CodecCost(1e12, 1e30, 1e30)
    s = cm.speedup(base, cm.iteration_time(w, link, near_free, near_free))
    assert s == pytest.approx(cm.amdahl_limit(base.a2a_share), rel=1e-6)
    fwd_only = cm.speedup(base, cm.iteration_time(w, link, near_free, cm.NO_CODEC))
    assert fwd_only == pytest.approx(1 / (1 - base.a2a_forward / base.total), rel=1e-6)


def test_amdahl_limit_of_the_published_breakdown():
    # 62.6% all-to-all caps any compressor at 2.67x; the forward all-to-all alone at 1.46x
    assert cm.amdahl_limit(0.626) == pytest.approx(2.674, abs=1e-3)
    assert cm.amdahl_limit(0.313) == pytest.approx(1.456, abs=1e-3)
    with pytest.raises(ValueError):
        cm.amdahl_limit(1.0)


@settings(max_examples=60, deadline=None)
@given(b1=st.floats(0.01, 100.0), b2=st.floats(0.01, 100.0), ratio=st.floats(1.01, 100.0), tput=st.floats(1.0, 1000.0))
def test_faster_links_shorten_iterations_and_shrink_the_gain(b1, b2, ratio, tput):
    lo, hi = sorted((b1, b2))
    w = _workload()
    codec = cm.CodecCost(ratio, tput * GB, tput * GB)
    t_lo = cm.iteration_time(w, net.Link(lo * GB), codec, codec).total
    t_hi = cm.iteration_time(w, net.Link(hi * GB), codec, codec).total
    assert t_hi <= t_lo
    s_lo = cm.speedup(cm.iteration_time(w, net.Link(lo * GB)), cm.iteration_time(w, net.Link(lo * GB), codec, codec))
    s_hi = cm.speedup(cm.iteration_time(w, net.Link(hi * GB)), cm.iteration_time(w, net.Link(hi * GB), codec, codec))
    assert s_hi <= s_lo + 1e-12


def test_table_speedup_of_the_published_inputs_by_hand():
    # Feng et al.'s per-table speedup, 1 / (1/CR + B (1/Tc + 1/Td)), with their inputs: CR 10.8,
    # B = 4 GB/s, Huffman at Tc = 60 and Td = 40 GB/s. By hand in fractions: 1/10.8 = 5/54,
    # 4/60 = 1/15, 4/40 = 1/10; 5/54 + 1/15 + 1/10 = (25 + 18 + 27) / 270 = 7/27, so 27/7 = 3.857x.
    assert cm.table_speedup(10.8, 4 * GB, 60 * GB, 40 * GB) == pytest.approx(27 / 7, rel=1e-12)
    # cuSZp-class 332/513 GB/s instead: 0.092593 + 0.012048 + 0.007797 = 0.112438 -> 8.894x
    assert cm.table_speedup(10.8, 4 * GB, 332 * GB, 513 * GB) == pytest.approx(8.894, abs=5e-4)
    # a codec that costs nothing gives the ratio itself
    assert cm.table_speedup(10.8, 4 * GB, math.inf, math.inf) == pytest.approx(10.8)


def test_published_breakdown_arithmetic_gives_1_38x():
    # notes/papers.md §1.4: forward all-to-all 31.3% -> 3.64% of the original time (Terabyte) is 1.382x
    base = cm.from_shares(cm.PUBLISHED_BREAKDOWN, a2a_forward_s=0.313)
    assert base.total == pytest.approx(1.0)
    assert base.a2a_share == pytest.approx(0.626)
    shrink = 0.313 / 0.0364  # the forward all-to-all, codec included, got 8.6x shorter
    new = cm.with_codecs(base, raw_bytes=1.0, forward=cm.CodecCost(ratio=shrink))
    # 1 - 0.313 + 0.0364 = 0.7234 of the time is left: 1 / 0.7234 = 1.38236x
    assert cm.speedup(base, new) == pytest.approx(1.38236, abs=1e-5)
    assert cm.speedup(base, new) == pytest.approx(cm.PUBLISHED_SPEEDUP, abs=0.005)


def test_projection_of_the_published_setup_stays_under_each_cap():
    w = cm.Workload(32, 2048, (64,) * 26)
    codec = cm.CodecCost(20.0, 332 * GB, 513 * GB)
    p = cm.project_published(w, 4 * GB, codec, codec)
    s_fwd = cm.speedup(p["uncompressed"], p["forward_only"])
    s_both = cm.speedup(p["uncompressed"], p["forward_backward"])
    assert 1 < s_fwd < cm.amdahl_limit(0.313) < s_both < cm.amdahl_limit(0.626)
    # the uncompressed forward all-to-all is its 13,205,504 B over 4 GB/s: 3.301376 ms
    assert p["uncompressed"].a2a_forward == pytest.approx(3.301376e-3)


@pytest.mark.parametrize(
    "codec_gbps,fwd_only,both",
    [
        # Per unit of the uncompressed iteration: the forward all-to-all is 0.313 of it, so it moves
        # 0.313 x 4 GB/s worth of raw bytes. At 10.8x the wire part is 0.313 / 10.8 = 0.028981; the codec
        # adds 0.313 x 4 x (1/Tc + 1/Td).
        # cuSZp-class 332/513 GB/s: 0.313 x 4 x (1/332 + 1/513) = 0.006212.
        #   forward only: 1 - 0.313 + 0.028981 + 0.006212 = 0.722193 -> 1.3847x (published: 1.38x)
        #   both ways:    1 - 0.626 + 2 x 0.035193 = 0.444386 -> 2.2503x
        ((332, 513), 1.3847, 2.2503),
        # Huffman 60/40 GB/s: 0.313 x 4 x (1/60 + 1/40) = 0.313 / 6 = 0.052167.
        #   forward only: 0.687 + 0.028981 + 0.052167 = 0.768148 -> 1.3018x
        #   both ways:    0.374 + 2 x 0.081148 = 0.536296 -> 1.8646x
        ((60, 40), 1.3018, 1.8646),
    ],
)
def test_projection_with_the_published_10_8x_ratio_by_hand(codec_gbps, fwd_only, both):
    w = cm.Workload(32, 2048, (64,) * 26)
    codec = cm.CodecCost(10.8, codec_gbps[0] * GB, codec_gbps[1] * GB)
    p = cm.project_published(w, 4 * GB, codec, codec)
    assert cm.speedup(p["uncompressed"], p["forward_only"]) == pytest.approx(fwd_only, abs=1e-4)
    assert cm.speedup(p["uncompressed"], p["forward_backward"]) == pytest.approx(both, abs=1e-4)


# A measured benchmark (docs/cost_model.md, "Measured": 2 ranks on one 2-core VM, loopback throttled
# to 100 Mbit/s by tc tbf with a 1 MiB burst, 2,048 samples per rank, 26 tables of dim 64, Terabyte
# MLPs; median ms per iteration of 3 repeats and the codec ms the probe timed per iteration):
MEASURED_100MBIT = {  # config: (ms per iteration, wire ratio, codec ms per iteration)
    "none": (2733, 1.0, 9),
    "fp16": (1655, 2.0, 21),
    "qcomm_fp16": (1638, 2.0, 7),
    "qcomm_int8": (1230, 3.2, 5),
}


def _measured_setup():
    # Terabyte MLPs: bottom 13-512-256-64: 13x512+512 + 512x256+256 + 256x64+64 = 154,944 parameters;
    # top from 64 + 27x26/2 = 415 inputs, 415-512-512-256-1: 212,992 + 262,656 + 131,328 + 257 = 607,233.
    w = cm.Workload(ranks=2, batch_per_rank=2048, dims=(64,) * 26, dense_params=154_944 + 607_233)
    link = net.Link(100e6 / 8, shared=True, burst_bytes=2**20)  # both ranks on one 12.5 MB/s loopback
    return w, link


def _codec(ratio: float, codec_ms_per_iteration: float, raw: float) -> cm.CodecCost:
    per_direction = codec_ms_per_iteration / 2 / 1e3
    return cm.CodecCost(ratio, encode_bytes_per_s=raw / per_direction)


def test_uncompressed_breakdown_of_the_measured_setup_by_hand():
    w, link = _measured_setup()
    b = cm.iteration_time(w, link)
    # per rank and direction 1/2 x 2,048 x 26 x 64 x 4 = 6,815,744 B; both ranks' 13,631,488 B queue
    # on the medium, 1,048,576 pass in the burst: 12,582,912 B / 12.5e6 B/s = 1.00663296 s
    assert b.a2a_forward == pytest.approx(1.00663296) and b.a2a_backward == pytest.approx(1.00663296)
    # ring all-reduce: 2 x 1/2 x 762,177 x 4 = 3,048,708 B per rank, x 2 ranks - 1,048,576 = 5,048,840 B
    assert b.allreduce == pytest.approx(0.4039072)
    # input dist: 2 ranks x 1/2 x 2,048 x 26 x 12 B = 638,976 B, inside the burst
    assert b.input_dist == 0.0


def test_model_calibrated_on_the_measured_none_run_predicts_the_measured_cast_runs():
    w, link = _measured_setup()
    raw = w.a2a_bytes()
    ms, ratio, codec_ms = MEASURED_100MBIT["none"]
    cal = cm.calibrate_compute(ms / 1e3, cm.iteration_time(w, link, *[_codec(ratio, codec_ms, raw)] * 2))
    for config in ("fp16", "qcomm_fp16", "qcomm_int8"):
        ms, ratio, codec_ms = MEASURED_100MBIT[config]
        predicted = cm.iteration_time(w, link, *[_codec(ratio, codec_ms, raw)] * 2)
        total = predicted.total - predicted.compute + cal.compute
        assert total == pytest.approx(ms / 1e3, rel=0.01), config  # the docs report -0%, +0%, -0%
    # lossy (117x / 293x, 44 ms of codec) measured 658 ms: the model, which overlaps nothing, is an
    # upper bound there (it adds the all-reduce after the all-to-alls; the docs report +15%)
    lossy = cm.iteration_time(w, link, _codec(117, 44, raw), _codec(293, 44, raw))
    assert lossy.total - lossy.compute + cal.compute > 0.658


def test_codec_time_is_added_per_direction():
    # 2 ranks, 1,000 samples each, one table of dim 125: a rank sends 1/2 x 1,000 x 125 x 4 = 250,000 B
    # per direction. Forward: encode at 100 MB/s 2.5 ms + decode at 50 MB/s 5 ms = 7.5 ms;
    # backward: 0.25 ms + 0.25 ms at 1 GB/s each; an infinitely fast link adds no wire time.
    w, link = cm.Workload(2, 1000, (125,)), net.Link(math.inf)
    fwd = cm.CodecCost(ratio=5.0, encode_bytes_per_s=100e6, decode_bytes_per_s=50e6)
    bwd = cm.CodecCost(ratio=3.0, encode_bytes_per_s=1 * GB, decode_bytes_per_s=1 * GB)
    b = cm.iteration_time(w, link, fwd, bwd)
    assert b.codec_forward == pytest.approx(7.5e-3) and b.codec_backward == pytest.approx(0.5e-3)
    assert b.a2a == 0.0 and b.total == pytest.approx(8.0e-3)
    assert cm.iteration_time(w, link, fwd, cm.NO_CODEC).codec_backward == 0.0


def test_calibrated_compute_reproduces_the_measurement_and_rejects_impossible_ones():
    modelled = cm.iteration_time(_workload(compute_s=0.0), net.Link(1 * GB))
    cal = cm.calibrate_compute(modelled.total + 0.123, modelled)
    assert cal.compute == pytest.approx(0.123)
    assert cal.total == pytest.approx(modelled.total + 0.123)
    with pytest.raises(ValueError, match="less than the modelled"):
        cm.calibrate_compute(modelled.total / 2, modelled)


ENTROPY, FIXED = cm.Stages(entropy=True, dedup=True), cm.Stages(entropy=False, dedup=True)
RATIOS = {ENTROPY: 36.0, FIXED: 29.0}
TPUT = {ENTROPY: (60 * GB, 40 * GB), FIXED: (330 * GB, 510 * GB)}


def test_stage_choice_turns_entropy_on_for_slow_links_and_off_for_fast_ones():
    assert cm.choose_stages(RATIOS, TPUT, 0.05 * GB) == ENTROPY  # crossover near 0.18 GB/s
    assert cm.choose_stages(RATIOS, TPUT, 50 * GB) == FIXED
    assert cm.choose_stages(RATIOS, TPUT, math.inf) == FIXED


def test_stage_choice_flips_at_the_crossover_bandwidth():
    a = cm.CodecCost(RATIOS[ENTROPY], *TPUT[ENTROPY])
    b = cm.CodecCost(RATIOS[FIXED], *TPUT[FIXED])
    x = cm.crossover_bandwidth(a, b)
    assert x is not None and x > 0
    assert a.seconds_per_byte(x) == pytest.approx(b.seconds_per_byte(x), rel=1e-12)
    assert cm.choose_stages(RATIOS, TPUT, 0.99 * x) == ENTROPY
    assert cm.choose_stages(RATIOS, TPUT, 1.01 * x) == FIXED


def test_crossover_is_none_when_one_codec_dominates():
    better_and_faster = cm.CodecCost(40.0, 400 * GB, 600 * GB)
    assert cm.crossover_bandwidth(better_and_faster, cm.CodecCost(29.0, 330 * GB, 510 * GB)) is None


def test_stage_choice_over_all_four_combinations_and_per_table():
    tput = {
        cm.Stages(e, d): ((50 if e else 300) * GB * (0.8 if d else 1.0),) * 2
        for e in (True, False)
        for d in (True, False)
    }
    small = {cm.Stages(e, d): (8.0 if e else 4.0) * (50.0 if d else 1.0) for e in (True, False) for d in (True, False)}
    big = {cm.Stages(e, d): (8.0 if e else 4.0) * (1.05 if d else 1.0) for e in (True, False) for d in (True, False)}
    choice = cm.choose_stages_per_table({"small": small, "big": big}, tput, 1 * GB)
    assert choice["small"].dedup  # 50x from duplicates pays for the slower dedup
    assert not choice["big"].dedup  # 5% does not
    assert cm.Stages(True, False).codec_params() == {"entropy": True, "dedup": False}


def test_stage_choice_ties_go_to_fewer_stages():
    same = {cm.Stages(True, True): 10.0, cm.Stages(False, False): 10.0}
    tput = {k: (100 * GB, 100 * GB) for k in same}
    assert cm.choose_stages(same, tput, 1 * GB) == cm.Stages(False, False)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: net.Link(0),
        lambda: net.Link(1e9, burst_bytes=-1),
        lambda: cm.CodecCost(ratio=0),
        lambda: cm.CodecCost(ratio=2, encode_bytes_per_s=-1),
        lambda: cm.Workload(0, 1, (4,)),
        lambda: cm.Workload(2, 1, ()),
        lambda: cm.choose_stages({}, {}, 1e9),
        lambda: cm.choose_stages({ENTROPY: 3.0}, {}, 1e9),
        lambda: cm.from_shares({"a2a_forward": 0.5, "network": 0.5}, 1.0),
    ],
)
def test_bad_inputs_raise_value_errors(bad):
    with pytest.raises(ValueError):
        bad()


def test_harmonic_ratio_weights_by_bytes():
    # 100 bytes at 10x and 100 bytes at 1x travel as 10 + 100 bytes
    assert cm.harmonic_ratio([100, 100], [10, 1]) == pytest.approx(200 / 110)


def test_a_compressed_all_reduce_shrinks_by_its_ratio_and_pays_its_codec():
    # By hand: 2 ranks, 1,000 dense parameters on a 1,000 B/s link per rank: a ring all-reduce
    # sends 2 (2-1)/2 x 1,000 x 4 = 4,000 bytes per rank, 4 s; at a dense ratio of 4, 1 s. The
    # codec encodes the 4,000 fp32 bytes at 4,000 B/s (1 s) and decodes for free.
    w = cm.Workload(ranks=2, batch_per_rank=1, dims=(1,), dense_params=1000)
    link = net.Link(1000.0)
    plain = cm.iteration_time(w, link)
    dense = cm.iteration_time(w, link, dense=cm.CodecCost(4.0, 4000.0))
    assert plain.allreduce == pytest.approx(4.0) and plain.codec_dense == 0.0
    assert dense.allreduce == pytest.approx(1.0) and dense.codec_dense == pytest.approx(1.0)
    # the published breakdown: compressing the all-reduce as well can only help (22.9% of it)
    p = cm.project_published(
        cm.Workload(ranks=32, batch_per_rank=2048, dims=(64,) * 26, dense_params=762_177),
        4e9,
        cm.CodecCost(50.0, 3.32e11, 5.13e11),
        cm.CodecCost(50.0, 3.32e11, 5.13e11),
        dense=cm.CodecCost(10.0, 3.32e11, 5.13e11),
    )
    base = p["uncompressed"]
    assert cm.speedup(base, p["all"]) > cm.speedup(base, p["forward_backward"])
    assert p["all"].allreduce == pytest.approx(base.allreduce / 10)


def test_the_pipelined_input_dist_costs_only_what_the_links_idle_time_cannot_hold():
    # by hand: 2 ms of compute leave the link idle; the all-to-alls hold it 6 ms
    base = cm.Breakdown(compute=0.002, a2a_forward=0.003, a2a_backward=0.003)
    assert cm.exposed_input_dist(0.0015, base) == 0.0  # hidden behind the compute
    assert cm.exposed_input_dist(0.005, base) == pytest.approx(0.003)
    # 2 ranks x 1,000 samples x 10 tables: half the lookups travel, 12 bytes each = 60,000 bytes
    w = cm.Workload(ranks=2, batch_per_rank=1000, dims=(8,) * 10)
    assert w.input_dist_bytes() == 60_000
    # at 10 MB/s the raw input takes 6 ms (4 exposed); coded 6x it takes 1 ms (hidden) plus
    # 1 + 1 ms of coding at 60 MB/s each way
    p = cm.project_input(base, w, 10e6, cm.CodecCost(6.0, 60e6, 60e6))
    assert p["raw"].total == pytest.approx(0.008 + 0.004) and p["raw"].input_dist == pytest.approx(0.004)
    assert p["coded"].total == pytest.approx(0.008 + 0.002) and p["coded"].codec_input == pytest.approx(0.002)
    # on a link 10x faster both fit in the idle time: coding only costs its 2 ms
    fast = cm.project_input(base, w, 100e6, cm.CodecCost(6.0, 60e6, 60e6))
    assert fast["raw"].total == pytest.approx(0.008) and fast["coded"].total == pytest.approx(0.010)
