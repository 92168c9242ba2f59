"""The cost model's algebra: byte counts, Amdahl limits, monotonicity, the published arithmetic, stage choice."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compression import cost_model as cm

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
    # 31/32 of 2048 samples x 26 tables x 64 dims x 4 bytes
    w = cm.Workload(32, 2048, (64,) * 26)
    assert w.a2a_bytes() == pytest.approx(31 / 32 * 2048 * 26 * 64 * 4)


def test_shared_link_carries_every_ranks_bytes():
    per_rank = cm.Link(1e8, shared=False)
    shared = cm.Link(1e8, shared=True)
    assert shared.seconds(1e6, 4) == pytest.approx(4 * per_rank.seconds(1e6, 4))
    assert shared.per_rank_bytes_per_s(4) == pytest.approx(2.5e7)


def test_a_shaper_burst_passes_free_at_the_start_of_each_collective():
    link = cm.Link(1e7, shared=True, burst_bytes=2**20)
    assert link.seconds(3e6, 2) == pytest.approx((6e6 - 2**20) / 1e7)
    assert link.seconds(4e5, 2) == 0.0  # the whole collective fits in the bucket
    assert cm.Link(1e7, latency_s=0.01, burst_bytes=2**20).seconds(1.0, 2) == pytest.approx(0.01)


def test_ring_allreduce_bytes():
    assert cm.Workload(4, 1, (1,), dense_params=1000).allreduce_bytes() == pytest.approx(2 * 3 / 4 * 4000)


def _workload(compute_s: float = 0.05) -> cm.Workload:
    return cm.Workload(ranks=8, batch_per_rank=1024, dims=(64,) * 26, dense_params=700_000, compute_s=compute_s)


@settings(max_examples=60, deadline=None)
@given(ratio=st.floats(1.0, 1e4), enc=st.floats(1e8, 1e12), dec=st.floats(1e8, 1e12),
       gbps=st.floats(0.01, 100.0))
def test_speedup_never_exceeds_the_amdahl_limit(ratio, enc, dec, gbps):
    w, link = _workload(), cm.Link(gbps * GB)
    base = cm.iteration_time(w, link)
    codec = cm.CodecCost(ratio, enc, dec)
    new = cm.iteration_time(w, link, codec, codec)
    assert cm.speedup(base, new) <= cm.amdahl_limit(base.a2a_share) + 1e-12


def test_a_free_infinite_ratio_codec_reaches_the_amdahl_limit():
    w, link = _workload(), cm.Link(1 * GB)
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
@given(b1=st.floats(0.01, 100.0), b2=st.floats(0.01, 100.0), ratio=st.floats(1.01, 100.0),
       tput=st.floats(1.0, 1000.0))
def test_faster_links_shorten_iterations_and_shrink_the_gain(b1, b2, ratio, tput):
    lo, hi = sorted((b1, b2))
    w = _workload()
    codec = cm.CodecCost(ratio, tput * GB, tput * GB)
    t_lo = cm.iteration_time(w, cm.Link(lo * GB), codec, codec).total
    t_hi = cm.iteration_time(w, cm.Link(hi * GB), codec, codec).total
    assert t_hi <= t_lo
    s_lo = cm.speedup(cm.iteration_time(w, cm.Link(lo * GB)), cm.iteration_time(w, cm.Link(lo * GB), codec, codec))
    s_hi = cm.speedup(cm.iteration_time(w, cm.Link(hi * GB)), cm.iteration_time(w, cm.Link(hi * GB), codec, codec))
    assert s_hi <= s_lo + 1e-12


def test_table_speedup_is_the_published_formula():
    # Feng et al.'s cr_log.py: speedup = 1 / (1/CR + B (1/Tc + 1/Td)), B = 4 GB/s, Huffman 60/40 GB/s
    cr, b, tc, td = 10.8, 4.0, 60.0, 40.0
    assert cm.table_speedup(cr, b * GB, tc * GB, td * GB) == pytest.approx(1 / (1 / cr + b * (1 / tc + 1 / td)))


def test_published_breakdown_arithmetic_gives_1_38x():
    # notes/papers.md §1.4: forward all-to-all 31.3% -> 3.64% of the original time (Terabyte) is 1.382x
    base = cm.from_shares(cm.PUBLISHED_BREAKDOWN, a2a_forward_s=0.313)
    assert base.total == pytest.approx(1.0)
    assert base.a2a_share == pytest.approx(0.626)
    shrink = 0.313 / 0.0364  # the forward all-to-all, codec included, got 8.6x shorter
    new = cm.with_codecs(base, raw_bytes=1.0, forward=cm.CodecCost(ratio=shrink))
    assert cm.speedup(base, new) == pytest.approx(1 / (1 - 0.313 + 0.0364), rel=1e-9)
    assert cm.speedup(base, new) == pytest.approx(cm.PUBLISHED_SPEEDUP, abs=0.005)


def test_projection_of_the_published_setup_stays_under_each_cap():
    w = cm.Workload(32, 2048, (64,) * 26)
    codec = cm.CodecCost(20.0, 332 * GB, 513 * GB)
    p = cm.project_published(w, 4 * GB, codec, codec)
    s_fwd = cm.speedup(p["uncompressed"], p["forward_only"])
    s_both = cm.speedup(p["uncompressed"], p["forward_backward"])
    assert 1 < s_fwd < cm.amdahl_limit(0.313) < s_both < cm.amdahl_limit(0.626)
    # the uncompressed forward all-to-all is raw bytes over the link
    assert p["uncompressed"].a2a_forward == pytest.approx(w.a2a_bytes() / (4 * GB))


def test_codec_time_is_added_per_direction():
    w, link = _workload(compute_s=0.0), cm.Link(math.inf)
    codec = cm.CodecCost(ratio=5.0, encode_bytes_per_s=2 * GB, decode_bytes_per_s=4 * GB)
    b = cm.iteration_time(w, link, codec, cm.NO_CODEC)
    assert b.codec_forward == pytest.approx(w.a2a_bytes() * (1 / (2 * GB) + 1 / (4 * GB)))
    assert b.codec_backward == 0.0 and b.a2a == 0.0


def test_calibrated_compute_reproduces_the_measurement_and_rejects_impossible_ones():
    modelled = cm.iteration_time(_workload(compute_s=0.0), cm.Link(1 * GB))
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
    tput = {cm.Stages(e, d): ((50 if e else 300) * GB * (0.8 if d else 1.0),) * 2
            for e in (True, False) for d in (True, False)}
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


@pytest.mark.parametrize("bad", [
    lambda: cm.Link(0),
    lambda: cm.Link(1e9, burst_bytes=-1),
    lambda: cm.CodecCost(ratio=0),
    lambda: cm.CodecCost(ratio=2, encode_bytes_per_s=-1),
    lambda: cm.Workload(0, 1, (4,)),
    lambda: cm.Workload(2, 1, ()),
    lambda: cm.choose_stages({}, {}, 1e9),
    lambda: cm.choose_stages({ENTROPY: 3.0}, {}, 1e9),
    lambda: cm.from_shares({"a2a_forward": 0.5, "network": 0.5}, 1.0),
])
def test_bad_inputs_raise_value_errors(bad):
    with pytest.raises(ValueError):
        bad()


def test_harmonic_ratio_weights_by_bytes():
    # 100 bytes at 10x and 100 bytes at 1x travel as 10 + 100 bytes
    assert cm.harmonic_ratio([100, 100], [10, 1]) == pytest.approx(200 / 110)
