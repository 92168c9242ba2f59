"""The coded hot-row sync (placement.sync_codec=backward): the wire format of one rank's payload,
and the sync on real gloo ranks (identical replicas, each summed gradient within the codec's bound
of the exact sum, the bytes counted as sent)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from dlrm.bench.host_syncs import counted_reads
from dlrm.embedding_comm.bounds import fixed_bound
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.config import CompressionSpec, DirectionSpec
from dlrm.placement import hot_wire
from dlrm.placement.config import PlacementSpec, parse_placement_cfg
from dlrm.placement.hot_sync import HotRowOptimizer
from dlrm.placement.hot_wire import HotWireError, SyncWire, bound_class
from dlrm.placement.replication import setup_replication
from dlrm.telemetry.sync_counter import HostSyncCounter
from dlrm_compression import format as fmt
from dlrm_compression import ops

EB = 0.01  # the backward policy's value: a fraction of each table's range (rel), as fixed.yaml's
DIM = 8


def _codec(mode: str = "rel", backend: str = "auto") -> DirectionCodec:
    """The backward codec, its stages on ``backend`` (``"device"``: the device's code on CPU tensors)."""
    spec = DirectionSpec(codec="lossy", mode=mode, dedup=True, params={"entropy": "auto", "level": 1})
    return DirectionCodec(spec, "backward", fixed_bound(EB), backend)


# --- one rank's payload ---------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, width", [([30000, 2768], 2), ([30000, 2769], 4)])
def test_slots_travel_as_int16_when_every_slot_fits_else_int32(sizes, width):
    wire = SyncWire(_codec(), ["a", "b"], sizes, DIM)
    last = sum(sizes) - 1  # the highest slot: 32767 fits int16, 32768 does not
    slots = [torch.tensor([0, 5, 29999]), torch.tensor([30000, last])]
    rows = [torch.randn(3, DIM), torch.randn(2, DIM)]
    payload = wire.encode(slots, rows, iteration=0)
    assert int(payload[5]) == width  # the prefix's slot width byte
    got_slots, got_rows = wire.decode(payload, src=0)
    assert got_slots.tolist() == torch.cat(slots).tolist()
    assert got_rows.shape == (5, DIM)
    fits = SyncWire(_codec(), ["a", "b"], [30000, 2768], DIM)
    narrow = fits.encode([slots[0], torch.tensor([30000, 32767])], rows, 0)
    assert payload.numel() - narrow.numel() == (width - 2) * 5  # 5 slots, nothing else wider


def test_decoded_rows_are_within_each_tables_bound():
    wire = SyncWire(_codec(), ["a", "b"], [500, 500], DIM)
    rows = [torch.randn(200, DIM) * 1e-3, torch.randn(300, DIM) * 10]  # ranges four orders apart
    _, got = wire.decode(wire.encode([torch.arange(200), torch.arange(500, 800)], rows, 0), src=0)
    for part, exact in zip(got.split([200, 300]), rows, strict=True):
        bound = EB * float(exact.max() - exact.min())  # rel: the fraction of the table's own range
        assert 0 < float((part - exact).abs().max()) <= bound
    assert 2 * wire.coded_row_bytes < wire.raw_row_bytes == 500 * DIM * 4


def test_a_rank_that_touched_nothing_sends_the_prefix_alone():
    wire = SyncWire(_codec(), ["a", "b"], [10, 10], DIM)
    empty = [torch.zeros(0, dtype=torch.int64)] * 2
    payload = wire.encode(empty, [torch.zeros(0, DIM)] * 2, 0)
    assert payload.numel() == 16
    slots, rows = wire.decode(payload, src=1)
    assert slots.numel() == 0 and rows.shape == (0, DIM)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: p[:10], "shorter than its 16-byte prefix"),
        (lambda p: p[:-7], "checksum mismatch|do not add up|truncated"),
        (lambda p: torch.cat([p[:40], p[40:41] ^ 0x10, p[41:]]), "checksum mismatch"),
        (lambda p: torch.cat([p[:1] ^ 0xFF, p[1:]]), "not a hot-row sync payload"),
    ],
)
def test_a_damaged_payload_is_a_clear_error_naming_the_rank(damage, match):
    wire = SyncWire(_codec(), ["a", "b"], [10, 10], DIM)
    payload = wire.encode([torch.arange(3), torch.arange(10, 12)], [torch.randn(3, DIM), torch.randn(2, DIM)], 0)
    with pytest.raises(HotWireError, match=rf"from rank 1 .*({match})"):
        wire.decode(damage(payload), src=1)


def _device_encoded(wire: SyncWire, slots: list[torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor:
    """The payload :meth:`SyncWire.encode` builds on the device backend (its codec's, run on the
    CPU), its length read as the size exchange reads it."""
    assert wire.codec.backend_choice == "device"
    coded = wire.encode(slots, rows, 0)
    assert isinstance(coded, fmt.Deferred)  # its length still on the device
    return wire.settle(coded, int(coded.length))


def test_the_device_payload_decodes_to_the_cpu_payloads_rows_bit_for_bit_reading_nothing_per_part():
    tables = 5
    wire = SyncWire(_codec(), [f"t{k}" for k in range(tables)], [50] * tables, DIM)
    g = torch.Generator().manual_seed(3)
    slots = [torch.randperm(50, generator=g)[: 7 + k].sort().values + 50 * k for k in range(tables)]
    # ranges apart (several bound classes), and repeated rows (the host path dedups them by value)
    rows = [(torch.randn(7 + k, DIM, generator=g) * 4.0**k)[torch.arange(7 + k) // 2] for k in range(tables)]
    host_slots, host_rows = wire.decode(wire.encode(slots, rows, 0), src=0)
    on_device = SyncWire(_codec(backend="device"), wire.features, wire.sizes, DIM)
    payload = _device_encoded(on_device, slots, rows)
    table_at = 16 + 2 * len(host_slots)  # version 2: each table's row count, then one codec payload
    assert int(payload[4]) == 2 and int(payload[6]) == tables
    counts = payload[table_at : table_at + 4 * tables].clone().view(torch.int32)
    assert counts.tolist() == [len(s) for s in slots]
    coded = payload[table_at + 4 * tables :]
    assert on_device.coded_row_bytes == coded.numel() and on_device.raw_row_bytes == sum(r.numel() * 4 for r in rows)
    header, _ = fmt.unpack(coded)  # a block per table, each at its own bound's class (the CPU's part bound)
    assert header.widths == [DIM] * tables
    assert header.bounds == [bound_class(b) for b in wire.bounds(rows, 0)[0]]
    assert len(set(header.bounds)) > 1  # several bound classes
    c = HostSyncCounter()
    with counted_reads(c), c:
        (got,), _, _ = on_device.decode_all([payload])
    assert sum(c.counts.values()) == 1, c.counts  # the heads, every part's codec head and the counts
    assert torch.equal(got[0], host_slots) and torch.equal(got[1], host_rows)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda p: p[:-7], "checksum mismatch|do not add up|truncated"),
        (lambda p: torch.cat([p[:-20], p[-20:-19] ^ 0x10, p[-19:]]), "checksum mismatch"),
    ],
)
def test_a_damaged_device_payload_is_a_clear_error_naming_the_rank(damage, match):
    wire = SyncWire(_codec(backend="device"), ["a", "b"], [10, 10], DIM)
    payload = _device_encoded(wire, [torch.arange(3), torch.arange(10, 12)], [torch.randn(3, DIM), torch.randn(2, DIM)])
    with pytest.raises(HotWireError, match=rf"from rank 1 .*({match})"):
        wire.decode(damage(payload), src=1)


def test_a_sealed_payload_whose_row_counts_pass_the_capacity_is_refused_naming_the_rank_and_table():
    """Row counts that add up but pass a table's capacity (an encoder's bug, or a forged check)
    would index past the codec's rows: refused, naming the table."""
    wire = SyncWire(_codec(backend="device"), ["a", "b"], [10, 10], DIM)
    payload = _device_encoded(wire, [torch.arange(6), torch.arange(10, 16)], [torch.randn(6, DIM)] * 2).clone()
    at = hot_wire._PREFIX.size + 2 * 12  # the row counts, after 12 two-byte slots
    assert payload[at : at + 8].view(torch.int32).tolist() == [6, 6]
    payload[at : at + 8] = torch.tensor([11, 1], dtype=torch.int32).view(torch.uint8)
    ops.adler32_seal_(payload, None, payload.numel(), 0, hot_wire._PREFIX.size, hot_wire._CHECK_AT)
    with pytest.raises(HotWireError, match=r"from rank 1 .*table 'a': 11 rows, past the capacity of 10"):
        wire.decode(payload, src=1)


# --- the config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"sync_codec": "backward"}, r"placement.sync_codec=backward has no effect without placement.hot_rows"),
        ({"hot_rows": 4, "sync_codec": "lossy"}, r"placement.sync_codec must be one of exact, backward"),
    ],
)
def test_sync_codec_without_hot_rows_or_of_a_bad_value_is_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        parse_placement_cfg(cfg, "table_wise", num_tables=3)


def test_sync_codec_backward_needs_an_error_bounded_backward_codec():
    assert parse_placement_cfg({"hot_rows": 4, "sync_codec": "backward"}, "table_wise", 3).sync_codec == "backward"
    spec = PlacementSpec(hot_rows=4, sync_codec="backward")
    opt = {"sparse": {"name": "rowwise_adagrad", "lr": 0.1}}
    with pytest.raises(ValueError, match=r"placement.sync_codec=backward .* compression=none"):
        none = CompressionSpec(name="none")
        setup_replication(spec, torch.nn.Module(), [], [], opt, none, 64, DIM, runtime=None, directions=None)


# --- the sync on 2 gloo ranks ----------------------------------------------------------------------

ROWS, STEPS = (12, 40), 4


def _grad(rank: int, step: int, table: int) -> torch.Tensor:
    """Each rank's gradient of a table: some rows both ranks touch, some one, some none; the two
    tables' values four orders of magnitude apart."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + table)
    out = torch.randn(ROWS[table], DIM, generator=g) * (1e-3 if table == 0 else 10.0)
    keep = torch.rand(ROWS[table], generator=g) < 0.6
    return out * keep[:, None]


class _Recording(HotRowOptimizer):
    """Keeps the summed gradient each update applies, per table (its rows, values)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _apply(
        self, weights: torch.Tensor, momentum: Any, sel: torch.Tensor, g: torch.Tensor, lr: float, eps: float
    ) -> None:
        for base, size in zip(self.layout.bases, self.layout.sizes, strict=True):  # every table's rows at once
            mine = (sel >= base) & (sel < base + size)
            self.applied.append((sel[mine] - base, g[mine].clone()))
        super()._apply(weights, momentum, sel, g, lr, eps)


def _sync_ranks(rank: int, world: int) -> dict[str, Any]:
    sent: list[int] = []  # bytes each collective of the sync puts on the wire to peers
    gather, a2a = dist.all_gather, dist.all_to_all_single

    def all_gather(out: list, t: torch.Tensor, *a: Any, **k: Any) -> Any:
        sent.append((world - 1) * t.numel() * t.element_size())
        return gather(out, t, *a, **k)

    def all_to_all_single(out: torch.Tensor, t: torch.Tensor, recv: list, send: list, *a: Any, **k: Any) -> Any:
        sent.append((sum(send) - send[rank]) * t.element_size())
        return a2a(out, t, recv, send, *a, **k)

    dist.all_gather, dist.all_to_all_single = all_gather, all_to_all_single  # type: ignore[assignment]
    torch.manual_seed(0)
    weights = {f"hot.t{i}": torch.nn.Parameter(torch.randn(n, DIM)) for i, n in enumerate(ROWS)}
    wire = SyncWire(_codec(), ["t0", "t1"], list(ROWS), DIM)
    opt = _Recording(weights, "sgd", lr=1.0, eps=1e-8, sync_every=1, wire=wire)
    replicas, exact, bounds = [], [], []
    for step in range(STEPS):
        for i, w in enumerate(weights.values()):
            g = _grad(rank, step, i)
            touched = g.abs().sum(1).nonzero().flatten()
            w.grad = torch.sparse_coo_tensor(touched.unsqueeze(0), g[touched], g.shape)
            # the test's own figure: an exact all-gather of every rank's (divided) dense gradient
            mine = g / world
            bounds.append(EB * float(mine[touched].max() - mine[touched].min()))
            parts = [torch.empty_like(mine) for _ in range(world)]
            gather(parts, mine)
            exact.append(sum(parts))
        opt.step()
        for w in weights.values():
            w.grad = None
        replicas.append([w.detach().clone() for w in weights.values()])
    out = {"replicas": replicas, "applied": opt.applied, "exact": exact, "bounds": bounds, "sent": sent}
    return {**out, "opt": opt.sent_bytes}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_sync_ranks, 2)


def test_replicas_are_bit_identical_on_every_rank_after_every_iteration(ranks):
    for step in range(STEPS):
        for a, b in zip(ranks[0]["replicas"][step], ranks[1]["replicas"][step], strict=True):
            assert torch.equal(a, b), f"replicas differ after iteration {step + 1}"


def test_each_summed_gradient_is_within_the_ranks_bounds_of_the_exact_sum(ranks):
    r0 = ranks[0]
    assert len(r0["applied"]) == STEPS * len(ROWS)
    for k, (sel, got) in enumerate(r0["applied"]):
        exact = r0["exact"][k][sel]
        hit = exact.abs().sum(1) > 0  # rows no rank touched are not applied
        assert bool(hit.all()) and len(sel) == int((r0["exact"][k].abs().sum(1) > 0).sum())
        # each rank's rows within its own bound of its table (0.01 of its rows' range), and the
        # sum of the two decoded rows rounded once in fp32
        limit = sum(r["bounds"][k] for r in ranks) + 2 * torch.finfo(torch.float32).eps * float(exact.abs().max())
        err = float((got - exact).abs().max())
        assert err <= limit, f"table {k % 2} at step {k // 2}: error {err} > {limit}"
        assert err > 0  # coded, not exact (the test would not see a sync that bypassed the codec)


def test_sent_bytes_are_the_bytes_the_sync_put_on_the_wire(ranks):
    for r in ranks:
        # every all_gather / all_to_all_single the optimizer called, sized from its tensors and splits
        assert len(r["sent"]) == 2 * STEPS  # per sync: the size all-gather and the payload exchange
        assert r["opt"] == sum(r["sent"]) > 0
