"""compression=auto / dense_comm=auto: its config, the per-block codec that applies a plan within the
policy's bounds, and the whole cycle on real gloo ranks (the timeline and its greedy choice:
tests/performance/test_search.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from trainer_runs import losses, train

import dlrm_compression as compression
from dlrm.performance.network import Link
from dlrm.performance.search import Option, Timeline, Unit, choose
from dlrm.strategy.config import parse_strategy_cfg
from dlrm_compression.base import CodecContext

MB = 1e6


def test_min_gain_is_a_fraction_below_one():
    for bad in (1.0, -0.1, True, "3%"):
        with pytest.raises(ValueError, match=r"compression\.strategy\.min_gain"):
            parse_strategy_cfg({"min_gain": bad}, None)
    assert parse_strategy_cfg({"min_gain": 0}, None).min_gain == 0.0


def test_the_per_block_codec_never_lets_a_cast_exceed_a_block_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g) * 0.1
    codec = compression.get_codec("per_block")
    # fp16's worst case on these blocks is ~2^-11 x 0.4 ~ 2e-4: fine for 1e-3, not for 1e-6
    bounds = [1e-3, 1e-6, 1e-3, 0.05]
    choice = ["fp16", "fp16", "int8", "none"]
    payload = codec.encode(x, bounds, blocks=[8] * 4, context=CodecContext(choice=choice))
    assert codec.groups(payload) == ["fp16", "lossy", "lossy", "none"]  # int8 needs range/510 <= 1e-3 too
    y = codec.decode(payload)
    err = (y - x).abs().view(256, 4, 8).amax(dim=(0, 2))
    assert all(e <= b for e, b in zip(err.tolist(), bounds, strict=True))
    assert torch.equal(y[:, 24:], x[:, 24:])  # none is exact
    bad = payload.clone()
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(compression.PayloadError):
        codec.decode(bad)


def test_one_codec_for_every_block_travels_as_that_codecs_own_payload():
    """Once a strategy is chosen most chunks use one codec: no second header, copy or checksum."""
    x = torch.randn(128, 24, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 20, (128, 3), generator=torch.Generator().manual_seed(2))
    codec = compression.get_codec("per_block")
    for name in ("none", "fp16"):
        alone = compression.get_codec(name).encode(x, [0.01] * 3, ids, blocks=[8] * 3)
        payload = codec.encode(x, [0.01] * 3, ids, blocks=[8] * 3, context=CodecContext(choice=[name] * 3))
        assert torch.equal(payload, alone)
        assert codec.groups(payload) == [name] * 3
        assert torch.equal(codec.decode(payload, ids), compression.get_codec(name).decode(alone, ids))
        bad = payload.clone()
        bad[len(bad) // 2] ^= 0x01
        with pytest.raises(compression.PayloadError, match="checksum"):
            codec.decode(bad, ids)


def test_the_per_block_device_path_decides_the_fallback_on_the_device_and_decodes_from_one_read():
    """compression=auto as on a GPU: groups fixed by the choice, each block's option (its choice,
    or the fallback where that could exceed its bound) decided on the device; the same values as
    the host path, no host sync to encode or decode once the head is read, the check held."""
    from dlrm.bench.host_syncs import counted_reads
    from dlrm.telemetry.sync_counter import HostSyncCounter
    from dlrm_compression import format as fmt
    from dlrm_compression.base import CodecContext

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 30, (96, 5), generator=g)
    table = torch.randn(30, 40, generator=g) * 0.1
    x = torch.cat([table[ids[:, b], 8 * b : 8 * b + 8] for b in range(5)], 1)  # rows equal per id
    options = {"options": ["none", "fp16", "bf16", "lossy/fixed"], "fallback": "lossy/fixed"}
    # the host path (the CPU's shortcuts), and the device's code run on CPU tensors
    on_host = compression.get_codec("per_block", backend="host", **options)
    codec = compression.get_codec("per_block", backend="device", **options)
    # fp16 holds 1e-3 on these blocks (~2^-11 x 0.4) but not 1e-6; bf16 (~2^-8 x 0.4) not 1e-3
    bounds, widths = [1e-3, 1e-6, 1e-3, 0.0, 1e-3], [8] * 5
    choice = ["fp16", "fp16", "bf16", "none", "lossy/fixed"]
    host = on_host.encode(x, bounds, ids, blocks=widths, context=CodecContext(choice=choice))
    want = on_host.decode(host, ids)
    assert on_host.groups(host) == ["fp16", "lossy", "lossy", "none", "lossy"]
    enc, dec = HostSyncCounter(), HostSyncCounter()
    eb = torch.tensor(bounds, dtype=torch.float64)
    with counted_reads(enc), enc:
        late = codec.encode_deferred(x, eb, ids, blocks=widths, context=CodecContext(choice=choice))
    assert isinstance(late, fmt.Deferred)
    [payload] = fmt.settle([late])
    assert codec.groups(payload) == on_host.groups(host)

    def read(p):
        extra, state = codec.prepare_decode(p, ids, CodecContext(choice=choice)) or (None, None)
        [head] = fmt.read_heads([p], [extra], [codec.head_size(len(widths))])
        head.state = state
        return head

    head = read(payload)
    with counted_reads(dec), dec:
        got = codec.decode(payload, ids, head=head)
    assert torch.equal(got, want) and torch.equal(codec.decode(payload, ids), want)  # read or not
    assert enc.total == dec.total == 0, (enc.by_op, dec.by_op)
    bad = payload.clone()
    bad[bad.numel() - 9] ^= 0x04  # in the last group's payload
    with pytest.raises(compression.PayloadError, match="checksum"):
        codec.decode(bad, ids, head=read(bad))


# --------------------------------------------------------------------------- on real ranks


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


AUTO = [
    "compression=auto",
    "dense_comm=auto",
    "compression.strategy.calibrate_iterations=2",
    "compression.strategy.measure_iterations=2",
    "max_iterations=14",
    "loss_log=true",
    "policy=fixed",
]


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory, cache) -> Path:
    """An AUTO run, trained once: the first test checks it and replays it, another prices its first plan."""
    run = tmp_path_factory.mktemp("auto")
    train(run, cache, AUTO)
    return run


def test_auto_decides_for_every_rank_settles_once_and_a_replay_reproduces_the_losses(tmp_path, cache, auto_run):
    first, replay = auto_run, tmp_path / "replay"
    saved = json.loads((first / "strategy.json").read_text())["plans"]
    assert saved and saved[0]["calibrated_from"] == 0 and saved[0]["from_iteration"] == 4
    # the first plan was timed on the run's first iterations: the next 2 re-make it, drift or not
    assert saved[0]["settled"] is False and saved[0]["timed_iterations"] == [3, 4]
    assert saved[1]["settled"] is True and saved[1]["from_iteration"] == 6 and saved[1]["timed_iterations"] == [5, 6]
    assert saved[1]["units"] == saved[0]["units"]  # the codecs are not measured again
    plan = [p for p in saved if p["choice"] is not None][-1]
    units_of = {u["name"]: u for u in plan["units"]}
    assert set(plan["choice"]) == set(units_of) and "dense" in units_of
    assert {n.split("/")[0] for n in plan["choice"] if n not in ("dense", "input")} == {"forward", "backward"}
    assert "input" in units_of  # compression.input: auto (auto.yaml's default)
    # every rank applied the same plan (rank 0 decides and broadcasts)
    applied = [
        re.findall(r"strategy from iteration (\d+): (.*)", (first / f"train_rank{r}.log").read_text()) for r in (0, 1)
    ]
    assert applied[0] and applied[0] == applied[1]
    metrics = json.loads((first / "metrics.json").read_text())
    assert metrics["strategy"] and metrics["predicted_iteration_ms"] > 0
    # the choice never loosened a bound: every sampled error (of the payloads as sent) within it
    assert metrics["max_abs_error_seen"] > 0  # something lossy travelled (the fallback, at least)
    from run_artifacts import scalars

    over = {t: v for t, v in scalars(first, "comm/").items() if t.endswith("/max_error_over_bound")}
    assert over and all(v <= 1.0 for series in over.values() for v in series.values())
    # the saved strategy replayed from its file: the same codecs at the same iterations
    train(replay, cache, [*AUTO, f"compression.strategy_file={first / 'strategy.json'}"])
    assert losses(replay) == losses(first)
    assert not (replay / "strategy.json").exists() or json.loads((replay / "strategy.json").read_text())["plans"] == []


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_a_plan_of_none_everywhere_costs_and_computes_what_compression_none_does(tmp_path, cache, sharding):
    """Every table at ``none`` travels as TorchRec's own all-to-all: the same losses as stock
    TorchRec (compression=none), and the same bytes on the wire (ratio 1, no framing)."""
    common = ["max_iterations=6", "loss_log=true", f"sharding={sharding}", "policy=fixed"]
    train(tmp_path / "none", cache, [*common, "compression=none"])
    features = [f"cat_{i}" for i in range(26)]
    plan = {
        "calibrated_from": 0,
        "from_iteration": 0,
        "choice": {f"{d}/{f}": "none" for d in ("forward", "backward") for f in features},
    }
    (tmp_path / "none.json").write_text(json.dumps({"plans": [plan]}))
    train(
        tmp_path / "auto", cache, [*common, "compression=auto", f"compression.strategy_file={tmp_path / 'none.json'}"]
    )
    assert losses(tmp_path / "auto") == losses(tmp_path / "none")
    metrics = json.loads((tmp_path / "auto" / "metrics.json").read_text())
    assert metrics["forward_ratio"] == 1.0 and metrics["backward_ratio"] == 1.0


def test_calibrated_options_choose_by_the_link(auto_run):
    # the units as a real run calibrated them, priced on a slow and on an infinite link
    plan = json.loads((auto_run / "strategy.json").read_text())["plans"][0]
    real = [
        Unit(u["name"], u["name"].split("/")[0], u["raw_bytes"], tuple(Option(**o) for o in u["options"]))
        for u in plan["units"]
    ]
    exact = {u.name: "none" for u in real}
    slow = choose(real, Timeline(Link(1e5), ranks=2, between=plan["compute_ms"] / 1e3), start=exact)
    # (the input's raw bytes may still fit in the link's idle time: tested on its own)
    big = [u for u in real if u.raw_bytes > 4096 and u.stage != "input"]
    assert big and all(slow[u.name] in ("lossy/zstd", "lossy/fixed", "dct") for u in big)
    free = choose(real, Timeline(Link(math.inf), ranks=2), start=exact)
    # with the link free, only options cheaper to run than copying the bytes ("none") can win
    for u in real:
        chosen = u.option(free[u.name])
        assert chosen.encode_s + chosen.decode_s <= u.option("none").encode_s + u.option("none").decode_s


def test_while_auto_calibrates_the_wire_carries_the_fixed_defaults_and_the_plan_times_steady_iterations(
    tmp_path, cache
):
    """While auto calibrates and measures, its options are tried on the side: what travels is the
    all-to-alls' bounded fallback (lossy) and dense_comm.fallback (dct), so each of those
    iterations sends the bytes that a `compression=lossy dense_comm=dct` run of the same seed
    sends; and the plan's compute comes from the measuring iterations only."""
    common = ["max_iterations=7", "loss_log=true", "policy=fixed"]
    auto = [
        "compression=auto",
        "dense_comm=auto",
        "compression.strategy.calibrate_iterations=3",
        "compression.strategy.measure_iterations=2",
    ]
    train(tmp_path / "auto", cache, [*common, *auto])
    train(tmp_path / "fixed", cache, [*common, "compression=lossy", "dense_comm=dct"])
    from run_artifacts import scalars

    plan = json.loads((tmp_path / "auto" / "strategy.json").read_text())["plans"][0]
    assert plan["calibrated_from"] == 0 and plan["from_iteration"] == 5
    assert plan["timed_iterations"] == [4, 5]  # after the 3 calibrating iterations, none of them
    got, ref = scalars(tmp_path / "auto", "comm/"), scalars(tmp_path / "fixed", "comm/")
    for path in ("forward", "backward", "dense"):
        a, b = got[f"comm/{path}/wire_bytes"], ref[f"comm/{path}/wire_bytes"]
        for it in range(1, plan["from_iteration"] + 1):
            assert a[it] == pytest.approx(b[it], rel=0.01), (path, it, a[it], b[it])
