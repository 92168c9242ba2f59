"""The DCT hook's device path on CPU tensors (``dense_comm.backend=device``; the host path:
``dense_comm.backend=host``; each ``.tolist()``/``.cpu()`` counted as a host read by
:func:`dlrm.bench.host_syncs.counted_reads`), on 2 real gloo ranks (3 for the reduce-scatter):
one host synchronisation per bucket (per phase of the reduce-scatter), the same gradients and
residuals as the host path bit for bit, and a damaged payload still a named error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

DCT = {"name": "dct", "keep": 0.005, "refresh_every": 2, "min_numel": 256}


class Bucket:
    """What DDP hands a comm hook, for one bucket of ``params`` (their ``.grad`` as its buffer)."""

    def __init__(self, params: list[torch.nn.Parameter], index: int = 0) -> None:
        self.params, self.i = params, index
        self.buf = torch.cat([p.grad.reshape(-1) for p in params])

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def index(self) -> int:
        return self.i

    def is_last(self) -> bool:
        return True


def _inline_all_gather():
    """Make the payload all-gather finish before the hook chains its decode on it, so that the
    decode runs on this thread, where the counter sees it (gloo otherwise runs it on its own)."""
    original = dist.all_gather

    def all_gather(outs, t, group=None, async_op=False):
        work = original(outs, t, group=group, async_op=async_op)
        if async_op:
            work.wait()
        return work

    dist.all_gather = all_gather
    return original


def _buckets(rank: int, ws: int, values: str, iterations: int, aggregation: str = "allgather") -> dict:
    from dlrm.bench.host_syncs import counted_reads
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm
    from dlrm.telemetry.sync_counter import HostSyncCounter

    original = _inline_all_gather()
    out: dict = {}
    try:
        for path in ("host", "device"):
            torch.manual_seed(rank)
            model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 8))
            cfg = {**DCT, "values": values, "aggregation": aggregation, "backend": path}
            dense = DenseComm(parse_dense_comm_cfg(cfg))
            dense.prepare(model, dist.group.WORLD)
            grads, syncs, events = [], [], []
            for _ in range(iterations):
                for p in model.parameters():
                    p.grad = torch.randn_like(p) * torch.rand_like(p) ** 3
                counter = HostSyncCounter(trace=True)
                if path == "device":
                    with counted_reads(counter), counter:
                        grads.append(dense.hook(Bucket(list(model.parameters()))).wait().clone())
                else:
                    grads.append(dense.hook(Bucket(list(model.parameters()))).wait().clone())
                syncs.append(counter.total)
                events.append(counter.events)
            out[path] = {
                "grads": grads,
                "syncs": syncs,
                "events": events,
                "residuals": dict(dense.residuals),
                "owner_residuals": dict(dense.owner_residuals),
                "state": dense.state_dict(),
            }
    finally:
        dist.all_gather = original
    return out


@pytest.fixture(scope="module", params=["none", "fp16", "bf16"])
def buckets(request) -> list[dict]:
    from multiprocess import run_ranks

    return run_ranks(_buckets, 2, request.param, 4, timeout=300)


def test_a_device_bucket_makes_one_host_sync_the_size_read(buckets):
    # compress, the size all-gather, the payload all-gather and the decode of the other rank's
    # payload, refresh iterations included (0 and 2): only the read of the sizes waits
    for r in buckets:
        assert r["device"]["syncs"] == [1, 1, 1, 1], r["device"]["events"]
        assert all(e.op == "host_read" and "dense_comm/hook.py" in e.where for it in r["device"]["events"] for e in it)


def test_the_device_path_gives_the_host_paths_gradients_and_residuals_bit_for_bit(buckets):
    _same_bits(buckets)


def _same_bits(runs: list[dict]) -> None:
    for r in runs:
        host, device = r["host"], r["device"]
        for a, b in zip(host["grads"], device["grads"], strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        for kind in ("residuals", "owner_residuals"):
            assert host[kind].keys() == device[kind].keys()
            for name in host[kind]:
                assert torch.equal(host[kind][name].view(torch.int32), device[kind][name].view(torch.int32))
        # the checkpointed state is the same plain data (thresholds as floats)
        assert host["state"]["thresholds"] == device["state"]["thresholds"]
        assert all(type(v) is float for v in device["state"]["thresholds"].values())


@pytest.fixture(scope="module", params=["none", "bf16"])
def scattered(request) -> list[dict]:
    from multiprocess import run_ranks

    return run_ranks(_buckets, 3, request.param, 4, "reduce_scatter", timeout=300)


def test_the_reduce_scatter_on_the_device_makes_one_host_sync_per_phase(scattered):
    # phase 1: the all-to-all of each segment's count and width; phase 2: the all-gather of the
    # owner's, with the statistics and the checks of phase 1's payloads
    for r in scattered:
        assert r["device"]["syncs"] == [2, 2, 2, 2], r["device"]["events"]
        assert all(e.op == "host_read" and "dense_comm/hook.py" in e.where for it in r["device"]["events"] for e in it)
        assert r["device"]["owner_residuals"]  # the reduce-scatter ran
    _same_bits(scattered)


def _damaged(rank: int, ws: int, aggregation: str) -> list[str]:
    from dlrm.dense_comm.config import parse_dense_comm_cfg
    from dlrm.dense_comm.hook import DenseComm, DenseCommError
    from dlrm.process.instrument import set_payload_hook

    def flip(payload: torch.Tensor, *, src: int, dst: int, direction: str, iteration: int) -> torch.Tensor:
        if iteration == 1:  # every rank's, so that no rank waits on another
            payload = payload.clone()
            payload[payload.numel() // 2] ^= 0x10
        return payload

    set_payload_hook(flip)
    errors = []
    torch.manual_seed(rank)
    model = torch.nn.Linear(300, 200)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for raise_at in ("next bucket", "check"):
        dense = DenseComm(parse_dense_comm_cfg({**DCT, "aggregation": aggregation, "backend": "device"}))
        dense.prepare(model, dist.group.WORLD)
        try:
            for it in range(3):
                dense.hook(Bucket(list(model.parameters()), index=4)).wait()
                if it == 1 and raise_at == "check":
                    dense.check()
            errors.append("no error")
        except DenseCommError as e:
            errors.append(f"{raise_at}: {e}")
    return errors


@pytest.mark.parametrize("aggregation", ["allgather", "reduce_scatter"])
def test_a_damaged_payload_on_the_device_path_is_an_error_naming_ranks_bucket_and_iteration(aggregation):
    # the reduce-scatter's damaged phase-1 payloads are named at its phase-2 read, in the same bucket
    from multiprocess import run_ranks

    for rank, errors in enumerate(run_ranks(_damaged, 2, aggregation, timeout=300)):
        for error, at in zip(errors, ("next bucket", "check"), strict=True):
            assert error.startswith(f"{at}: rank {rank}: cannot decode the dense gradient payload of bucket 4"), error
            assert f"from rank {1 - rank} at iteration 1" in error and "PayloadError" in error, error
