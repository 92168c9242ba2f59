"""DCT's reduce-scatter aggregation (`dense_comm.aggregation=reduce_scatter`) on 2, 3 and 4 real
gloo ranks: the averaged gradients against an independent torch replay of the two-phase algorithm
from every rank's gradients, keep 1.0 against DDP's plain average, the bytes each rank sends
counted at the collectives against the hook's statistics and against the all-gather's, an exact
resume (sender and owner residuals), and damaged payloads named."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from test_dense_syncs import Bucket

CFG = {"name": "dct", "keep": 0.02, "refresh_every": 3, "refresh_warmup": False, "min_numel": 256}
ITERATIONS = 5
ALLGATHER = {**CFG, "aggregation": "allgather"}  # the default before issue 38, compared with the reduce-scatter


def _model() -> torch.nn.Module:
    # one bucket: a 60,000-entry and a 1,600-entry weight, and two biases under min_numel (sent whole)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 8))


def _gradient(model: torch.nn.Module, rank: int, it: int) -> None:
    g = torch.Generator().manual_seed(100 * it + rank)
    for p in model.parameters():  # heavy-tailed, like gradients: a few large entries
        p.grad = torch.randn(p.shape, generator=g) * torch.rand(p.shape, generator=g) ** 3


class _Counted:
    """The bytes this rank sends through ``dist.all_gather`` and ``dist.all_to_all_single`` (the
    collectives the hook calls), counted from their arguments: an independent wire meter."""

    def __init__(self) -> None:
        self.sent = 0
        self.originals = (dist.all_gather, dist.all_to_all_single)

    def __enter__(self) -> _Counted:
        all_gather, all_to_all_single = self.originals

        def gather(outs, t, group=None, async_op=False):
            self.sent += (len(outs) - 1) * t.numel() * t.element_size()
            return all_gather(outs, t, group=group, async_op=async_op)

        def a2a(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            ws, me = dist.get_world_size(group), dist.get_rank(group)
            splits = input_split_sizes or [inp.numel() // ws] * ws
            self.sent += sum(s for r, s in enumerate(splits) if r != me) * inp.element_size()
            return all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_gather, dist.all_to_all_single = gather, a2a
        return self

    def __exit__(self, *exc) -> None:
        dist.all_gather, dist.all_to_all_single = self.originals


def _run(cfg: dict, rank: int, iterations: range, dense=None) -> dict:
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm

    model = _model()
    if dense is None:
        dense = DenseComm(parse_dense_comm_cfg(cfg))
    dense.prepare(model, dist.group.WORLD)
    grads, outs = [], []
    with _Counted() as counted:
        for it in iterations:
            _gradient(model, rank, it)
            bucket = Bucket(list(model.parameters()))
            grads.append(bucket.buf.clone())
            outs.append(dense.hook(bucket).wait().clone())
    return {
        "dense": dense,
        "grads": grads,
        "outs": outs,
        "counted": counted.sent,
        "wire": dense.stats.state(run=True)[0]["dense/wire_bytes"],
        "residuals": {n: r.clone() for n, r in dense.dct.residuals.items()},
        "owner_residuals": {n: r.clone() for n, r in dense.dct.owner_residuals.items()},
    }


def _resumed(cfg: dict, rank: int, at: int, owner: bool) -> list[torch.Tensor]:
    """Iterations ``at``.. after a checkpoint of this rank's state at ``at`` (as a resume loads it:
    plain data), with the owner residuals restored or not."""
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm

    first = _run(cfg, rank, range(at))["dense"]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert saved["owner_residuals"] and saved["residuals"]  # both kinds are checkpointed
    if not owner:
        saved["owner_residuals"] = {}
    twin = DenseComm(parse_dense_comm_cfg(cfg))
    twin.load_state_dict(saved)
    return _run(cfg, rank, range(at, ITERATIONS), dense=twin)["outs"]


def _damaged(rank: int, phase: int) -> str:
    """The error of iteration 1 when every payload of ``phase`` (1: the all-to-all, 2: the
    all-gather) is damaged on every rank (so that no rank waits on another)."""
    from dlrm.process.instrument import set_payload_hook

    def flip(payload: torch.Tensor, *, src: int, dst: int, direction: str, iteration: int) -> torch.Tensor:
        if iteration == 1 and (dst == -1) == (phase == 2):
            payload = payload.clone()
            payload[payload.numel() // 2] ^= 0x10
        return payload

    set_payload_hook(flip)
    try:
        _run({**CFG, "aggregation": "reduce_scatter"}, rank, range(3))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        set_payload_hook(None)
    return "no error"


def _aggregations(rank: int, ws: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    scatter = {**CFG, "aggregation": "reduce_scatter"}
    out = {name: _run(cfg, rank, range(ITERATIONS)) for name, cfg in (("rs", scatter), ("ag", ALLGATHER))}
    keep_all = {**scatter, "keep": 1.0}
    out["keep_all"] = _run(keep_all, rank, range(2))
    for values in ("bf16", "lossy"):  # coded values: the residuals hold what the coding changed
        out[values] = _run(
            {**scatter, "values": values, "values_eb": 0.01 if values == "lossy" else None}, rank, range(3)
        )
    ddp = []  # DDP's own average of the same gradients (its default hook: divide, all-reduce)
    model = _model()
    for it in range(2):
        _gradient(model, rank, it)
        ddp.append(default_hooks.allreduce_hook(dist.group.WORLD, Bucket(list(model.parameters()))).wait().clone())
    out["ddp"] = ddp
    out["resumed"] = _resumed(scatter, rank, 2, owner=True)
    out["resumed_without_owner"] = _resumed(scatter, rank, 2, owner=False)
    out["damaged"] = [_damaged(rank, phase) for phase in (1, 2)]
    for run in out.values():
        if isinstance(run, dict):
            run.pop("dense")
    return out


# 3 and 4 ranks: make test-scale
@pytest.fixture(
    scope="module", params=[2, pytest.param(3, marks=pytest.mark.scale), pytest.param(4, marks=pytest.mark.scale)]
)
def ranks(request) -> list[dict]:
    from multiprocess import run_ranks

    return run_ranks(_aggregations, request.param, timeout=600)


# -------------------------------------------------------------------------- the reference


def _kth_largest(x: torch.Tensor, keep: float) -> torch.Tensor:
    if keep >= 1.0:
        return torch.zeros(())
    k = max(1, math.ceil(keep * x.numel()))
    return x.abs().sort(descending=True).values[k - 1]


def _reference(grads: list[list[torch.Tensor]], numels: list[int], cfg: dict) -> dict:
    """The two-phase algorithm replayed from every rank's gradients ``grads[rank][iteration]``:
    rank o owns the o-th of W contiguous pieces of every parameter; each rank's per-parameter
    thresholds (refreshed on schedule) select what it sends of each other rank's pieces (its own
    count whole); each owner keeps the ``keep`` largest of each summed piece (all of a parameter
    under ``min_numel``); the average is those, divided by W."""
    ws, n = len(grads), sum(numels)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    pieces = [  # per owner: (start, end, parameter entries) of each non-empty piece
        [
            (s + m * o // ws, s + m * (o + 1) // ws, m)
            for s, m in zip(starts, numels, strict=True)
            if m * (o + 1) // ws > m * o // ws
        ]
        for o in range(ws)
    ]
    sender = [torch.zeros(n) for _ in range(ws)]
    owner = [torch.zeros(n) for _ in range(ws)]
    limits = [torch.zeros(n) for _ in range(ws)]  # each entry's threshold, per rank
    outs = []
    for it in range(len(grads[0])):
        sends = []
        for r in range(ws):
            f = grads[r][it] + (sender[r] + owner[r])
            if it % cfg["refresh_every"] == 0:
                for start, numel in zip(starts, numels, strict=True):
                    piece = f[start : start + numel]
                    big = numel >= cfg["min_numel"]
                    limits[r][start : start + numel] = _kth_largest(piece, cfg["keep"]) if big else 0.0
            send = torch.where(f.abs() >= limits[r], f, 0.0)
            for lo, hi, _ in pieces[r]:
                send[lo:hi] = f[lo:hi]
            sender[r] = f - send
            sends.append(send)
        out = torch.zeros(n)
        for o in range(ws):
            owner[o] = torch.zeros(n)
            for lo, hi, m in pieces[o]:
                total = torch.zeros(hi - lo)
                for r in range(ws):
                    total += sends[r][lo:hi]
                limit = _kth_largest(total, cfg["keep"]) if m >= cfg["min_numel"] else 0.0
                kept = torch.where(total.abs() >= limit, total, 0.0)
                owner[o][lo:hi] = total - kept
                out[lo:hi] = kept / ws
        outs.append(out)
    return {"outs": outs, "sender": sender, "owner": owner}


NUMELS = [60000, 200, 1600, 8]


def _flat(held: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([held[n] for n in ("0.weight", "0.bias", "1.weight", "1.bias")])


def test_reduce_scatter_is_the_two_phase_algorithm_replayed_from_all_ranks_gradients(ranks):
    assert [p.numel() for p in _model().parameters()] == NUMELS
    ref = _reference([r["rs"]["grads"] for r in ranks], NUMELS, CFG)
    for rank, r in enumerate(ranks):
        for it, (got, want) in enumerate(zip(r["rs"]["outs"], ref["outs"], strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=f"rank {rank} iteration {it}")
        torch.testing.assert_close(_flat(r["rs"]["residuals"]), ref["sender"][rank], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(_flat(r["rs"]["owner_residuals"]), ref["owner"][rank], rtol=1e-6, atol=1e-9)
    # every rank applies the same average, and it is sparse: ~keep of the entries, not W x keep
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["rs"]["outs"], ranks[0]["rs"]["outs"], strict=True))
    for o in ranks[0]["rs"]["outs"]:  # ceil(keep x each piece) of the large parameters, the small ones whole
        assert int(o.count_nonzero()) <= CFG["keep"] * (60000 + 1600) + 2 * len(ranks) + 208


@pytest.mark.parametrize("values", ["bf16", "lossy"])
def test_with_coded_values_the_reduce_scatter_conserves_gradient_mass(ranks, values):
    # what every step applied (W x the average) plus every rank's two residuals is the sum of
    # every rank's gradients over the iterations, whatever the values' coding did
    ws = len(ranks)
    truth = sum(g for r in ranks for g in r[values]["grads"])
    applied = ws * sum(ranks[0][values]["outs"])
    left = sum(_flat(r[values]["residuals"]) + _flat(r[values]["owner_residuals"]) for r in ranks)
    torch.testing.assert_close(applied + left, truth, rtol=1e-5, atol=1e-5 * float(truth.abs().max()))
    exact = _reference([r[values]["grads"] for r in ranks], NUMELS, CFG)["outs"]
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0][values]["outs"], exact, strict=True))  # coded


def test_reduce_scatter_keeping_everything_is_ddps_average(ranks):
    for r in ranks:
        for got, ddp in zip(r["keep_all"]["outs"], r["ddp"], strict=True):
            # the same sum in another order (DDP divides first): float rounding, a few ulps of the largest
            torch.testing.assert_close(got, ddp, rtol=0, atol=len(ranks) * 2.0**-23 * float(ddp.abs().max()))
        assert all(float(t.abs().max()) == 0.0 for t in r["keep_all"]["residuals"].values())
        assert all(float(t.abs().max()) == 0.0 for t in r["keep_all"]["owner_residuals"].values())


def test_the_wire_bytes_are_what_the_collectives_send_and_do_not_grow_with_the_ranks(ranks):
    ws = len(ranks)
    for r in ranks:  # the hook's statistics, counted at the collectives' arguments
        assert r["rs"]["wire"] == r["rs"]["counted"] and r["ag"]["wire"] == r["ag"]["counted"]
    rs = sum(r["rs"]["wire"] for r in ranks) / ws / ITERATIONS
    ag = sum(r["ag"]["wire"] for r in ranks) / ws / ITERATIONS
    print(f"\nW={ws}: bytes per rank and iteration: all-gather {ag:.0f}, reduce-scatter {rs:.0f} ({rs / ag:.0%})")
    if ws == 2:
        assert rs <= 1.1 * ag  # the same payload bytes, split in two, plus a second header
    if ws >= 4:
        assert rs <= 0.6 * ag  # the target


def test_a_resumed_reduce_scatter_continues_bit_for_bit_with_both_residuals(ranks):
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], r["rs"]["outs"][2:], strict=True))
        # the owner residuals matter: without them the run goes elsewhere
        assert not all(torch.equal(a, b) for a, b in zip(r["resumed_without_owner"], r["rs"]["outs"][2:], strict=True))


def test_a_damaged_payload_in_either_phase_is_an_error_naming_ranks_bucket_and_iteration(ranks):
    for rank, r in enumerate(ranks):
        first_other = 1 if rank == 0 else 0  # decoded in rank order
        for error in r["damaged"]:
            assert f"rank {rank}: cannot decode the dense gradient payload of bucket 0" in error, error
            assert f"from rank {first_other} at iteration 1" in error and "PayloadError" in error, error


def test_aggregation_is_a_dct_key_checked_by_name():
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm

    assert parse_dense_comm_cfg({"name": "dct"}).aggregation == "reduce_scatter"  # its ratio holds as W grows
    with pytest.raises(ValueError, match=r"dense_comm\.aggregation must be one of allgather, reduce_scatter, auto"):
        parse_dense_comm_cfg({"name": "dct", "aggregation": "ring"})
    with pytest.raises(ValueError, match="aggregation"):
        parse_dense_comm_cfg({"name": "fp16", "aggregation": "reduce_scatter"})  # no sparse payloads to sum
    auto = DenseComm(parse_dense_comm_cfg({"name": "dct", "aggregation": "auto"}))
    assert [auto.dct.aggregation([100_000, 100], ws) for ws in (2, 3, 4, 64)] == ["allgather"] + ["reduce_scatter"] * 3
    assert auto.dct.aggregation([100, 100], 128) == "allgather"  # a piece for every rank needs a parameter of W entries
    # the trainer's small MLPs (64 entries kept of 12,785 at keep 0.005): twice the payload headers
    # (~250 bytes each) would cost more than the reduce-scatter saves; the larger MLPs' (2,313 kept)
    small, large = (
        [416, 32, 512, 16, 11744, 32, 32, 1],
        [6656, 512, 131072, 256, 4096, 16, 187904, 512, 131072, 256, 256, 1],
    )
    assert (auto.dct.aggregation(small, 4), auto.dct.aggregation(large, 4)) == ("allgather", "reduce_scatter")


def _bytes_per_rank(rank: int, ws: int) -> dict:
    scatter = {**CFG, "aggregation": "reduce_scatter"}
    return {name: _run(cfg, rank, range(ITERATIONS))["wire"] for name, cfg in (("rs", scatter), ("ag", ALLGATHER))}


@pytest.mark.scale
def test_at_8_ranks_the_reduce_scatter_sends_a_quarter_of_the_all_gathers_bytes():
    # (W-1) payloads against ~2 (W-1)/W: 2/W = 25% at W = 8 (a minute of 8 processes on 2 cores)
    from multiprocess import run_ranks

    ws = 8
    runs = run_ranks(_bytes_per_rank, ws, timeout=600)
    rs, ag = (sum(r[name] for r in runs) / ws / ITERATIONS for name in ("rs", "ag"))
    print(f"\nW={ws}: bytes per rank and iteration: all-gather {ag:.0f}, reduce-scatter {rs:.0f} ({rs / ag:.0%})")
    assert rs <= 0.3 * ag
