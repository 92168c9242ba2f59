"""The row cache, its probe and hot-row replication run on the tensors' own device: counted on the
device backend run on CPU tensors (each object built with ``backend="device"``: none of the host's
shortcuts; dlrm.bench.host_syncs.counted_reads counts each .tolist()/.cpu() as a host read), their
host waits are a fixed few per chunk, batch or sync (the sizes their layouts depend on, read for
all blocks or tables at once), never per block or table, and their results are bit for bit those
of the host backend (``backend="host"``: the CPU shortcuts). The row cache's device payload waits
for nothing per chunk: it reads with its collective's size exchange and heads (below, and at real
ranks in test_device_path.py). A static check pins their host copies."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.bench.host_copies import PER_CHUNK, HostCopy, host_copies
from dlrm.bench.host_syncs import counted_reads
from dlrm.embedding_comm import fixed_bound
from dlrm.embedding_comm import forward_cache as fc
from dlrm.embedding_comm.cache_probe import CacheProbe
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.config import DirectionSpec
from dlrm.embedding_comm.stats import CommStats
from dlrm.placement.hot_rows import HotSplit
from dlrm.placement.hot_sync import HotRowOptimizer
from dlrm.placement.hot_wire import SyncWire
from dlrm.telemetry.sync_counter import HostSyncCounter
from dlrm_compression import format as fmt
from dlrm_compression.backend import DEVICE
from dlrm_compression.row_cache import RowCache

EB, DIM = 0.01, 4


def _codec(direction: str = "forward", mode: str = "abs", backend: str = "device") -> DirectionCodec:
    """The lossy codec of ``direction`` with the fixed-length coder (as on CUDA), its stages on
    ``backend`` (the device's by default: the code a GPU runs, on CPU tensors)."""
    spec = DirectionSpec("lossy", mode=mode, params={"entropy": False})
    return DirectionCodec(spec, direction, fixed_bound(EB), backend)


def _chunks(nb: int, steps: int = 3, rows: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forward chunks by id: block 0 drifts past the bound (moved rows), the others stay (hits)."""
    g = torch.Generator().manual_seed(nb)
    tables = torch.randn(nb, 40, DIM, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 40, (rows, nb), generator=g)
        tables[0] += 3 * EB * torch.randn(40, DIM, generator=g)
        out.append((torch.cat([tables[k][ids[:, k]] for k in range(nb)], 1), ids))
    return out


@contextmanager
def _labelled(counter: HostSyncCounter, obj: Any, names: list[str], label: str) -> Iterator[None]:
    """Run ``obj``'s functions ``names`` under ``label`` (the codec's own waits, counted apart:
    ``c.by_label[label]`` leaves ``label/codec`` out)."""
    saved = {n: getattr(obj, n) for n in names}

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with counter.label(label):
                return f(*args, **kwargs)

        return run

    for n, f in saved.items():
        setattr(obj, n, wrap(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(obj, n, f)


def test_row_cache_finds_and_gathers_without_a_wait_and_stores_with_at_most_one():
    cache = RowCache(DIM, capacity_rows=50, backend=DEVICE)  # the device's compactions (no nonzero)
    assert not cache.host
    cache.store(torch.arange(30), torch.randn(30, DIM))
    ids = torch.arange(20, 60)
    c = HostSyncCounter()
    with counted_reads(c), c:
        with c.label("find"):
            slots, _ = cache.find(ids)
            rows = cache.gather(slots)
        with c.label("store_known"):
            cache.store(ids, rows, slots, n_held=10)  # evicts past the capacity
        with c.label("store"):
            cache.store(torch.arange(55, 70), torch.randn(15, DIM))
    assert c.by_label == {"store": 1}, c.counts  # find, gather and a store told its count: none
    assert cache.ids()[-15:] == list(range(55, 70)) and len(cache) == 50


@pytest.mark.parametrize("nb", [2, 5])
def test_forward_cache_waits_a_fixed_number_of_times_per_chunk_whatever_its_blocks(nb):
    dc = _codec()
    feats, widths, bounds = [f"f{k}" for k in range(nb)], [DIM] * nb, torch.full((nb,), EB, dtype=torch.float64)
    sender, receiver = fc.ForwardCache(backend="device"), fc.ForwardCache(backend="device")
    held, decoded = [], []
    c = HostSyncCounter()
    with counted_reads(c), c, _labelled(c, fc, ["_code", "_decode"], "codec"):
        for i, (chunk, ids) in enumerate(_chunks(nb)):
            with c.label(f"encode{i}"):
                payload, h, counts = sender.encode(dc, chunk, ids, feats, widths, bounds, 1)
            with c.label(f"decode{i}"):
                decoded.append(receiver.decode(dc, payload, ids, feats, widths, 0))
            held.append(h)
    assert counts["hit_rows"] > 0 and counts["moved_rows"] > 0  # every kind of row was met
    for i in range(3):
        # encode: the blocks' counts with their coded bounds (every block at capacity: no sizes
        # read before); decode: the held counts with the flags, then the sent counts
        assert (c.by_label[f"encode{i}"], c.by_label[f"decode{i}"]) == (1, 2), c.counts
    # the same rows as the host backend (the payloads differ in their check: Adler-32 on a device)
    dc = _codec(backend="host")
    sender, receiver = fc.ForwardCache(backend="host"), fc.ForwardCache(backend="host")
    for (chunk, ids), h, d in zip(_chunks(nb), held, decoded, strict=True):
        payload, mirror, _ = sender.encode(dc, chunk, ids, feats, widths, bounds, 1)
        assert torch.equal(mirror, h) and torch.equal(receiver.decode(dc, payload, ids, feats, widths, 0), d)
        assert torch.equal(d, h)  # the receiver holds what the sender mirrors


@pytest.mark.parametrize("nb", [2, 5])
def test_forward_cache_on_device_waits_only_in_the_reads_of_its_collective(nb):
    """The device payload: nothing waits per chunk; the host reads what it needs with the
    transport's two reads (the sizes with the blocks' counts, the heads with the held counts)."""
    dc, host_dc = _codec(), _codec(backend="host")
    feats, widths, bounds = [f"f{k}" for k in range(nb)], [DIM] * nb, torch.full((nb,), EB, dtype=torch.float64)
    host_sender, host_receiver = fc.ForwardCache(backend="host"), fc.ForwardCache(backend="host")
    sender, receiver = fc.ForwardCache(backend="device"), fc.ForwardCache(backend="device")
    for i, (chunk, ids) in enumerate(_chunks(nb, steps=4)):
        payload, held, counts = host_sender.encode(host_dc, chunk, ids, feats, widths, bounds, 1)
        decoded = host_receiver.decode(host_dc, payload, ids, feats, widths, 0)
        c = HostSyncCounter()
        with counted_reads(c), c:
            with c.label("encode"):
                late, mirror, values, store = sender.encode_on_device(dc, chunk, ids, feats, widths, bounds, 1)
            with c.label("sizes"):  # as comm_ops._send's one read
                host = torch.cat([late.length.reshape(1), values]).tolist()
            with c.label("store"):
                got_counts = store(host[1:])
            with c.label("prepare"):
                size, extra, state = receiver.prepare_on_device(dc, late.take(host[0]), ids, widths, feats, 0)
            with c.label("heads"):  # as comm_ops._read_heads's one read
                [head] = fmt.read_heads([late.take(host[0])], [extra], [size])
                head.state = state
            with c.label("decode"):
                got = receiver.decode_on_device(dc, late.take(host[0]), head, widths)
        assert dict(c.by_label) == {"sizes": 1, "heads": 1}, c.counts
        # the host path's rows, counts and caches, bit for bit
        assert torch.equal(mirror, held) and torch.equal(got, decoded) and got_counts == counts, i
        assert all(sender.caches[k].ids() == v.ids() for k, v in host_sender.caches.items())
        assert all(
            torch.equal(receiver.caches[k].rows(torch.tensor(v.ids())), v.rows(torch.tensor(v.ids())))
            for k, v in host_receiver.caches.items()
        )
    assert counts["hit_rows"] > 0 and counts["moved_rows"] > 0


def test_forward_cache_on_device_with_ids_not_read_yet_picks_its_payload_or_the_codecs_there():
    """Which chunks hold ids is read with the sizes (issue 25): given the device flag instead,
    the cache's encode waits for nothing and sends, where the ids hold, its payload bit for bit
    and, where they do not, the codec's payload of the chunk (by value), leaving its mirror as it
    was; the chunk as the peer decodes it is either payload's decode."""
    nb = 3
    dc = _codec()
    feats, widths, bounds = [f"f{k}" for k in range(nb)], [DIM] * nb, torch.full((nb,), EB, dtype=torch.float64)
    # told by the flag; told nothing (the ids hold)
    flagged, plain = fc.ForwardCache(backend="device"), fc.ForwardCache(backend="device")
    for i, (chunk, ids) in enumerate(_chunks(nb, steps=5)):
        holds = i != 2  # a chunk of bags with two ids: its candidate ids do not identify its rows
        c = HostSyncCounter()
        with counted_reads(c), c:
            with c.label("encode"):
                late, mirror, values, store = flagged.encode_on_device(
                    dc, chunk, ids, feats, widths, bounds, 1, single=torch.tensor(holds)
                )
            host = torch.cat([late.length.reshape(1), values]).tolist()  # the sizes' one read
            counts = store(host[1:])
            payload = late.take(host[0])
            if holds:
                want, want_mirror, want_values, want_store = plain.encode_on_device(
                    dc, chunk, ids, feats, widths, bounds, 1
                )
                want_host = torch.cat([want.length.reshape(1), want_values]).tolist()
                assert counts == want_store(want_host[1:]) and counts["held_rows"] > (0 if i else -1)
                assert torch.equal(payload, want.take(want_host[0])) and torch.equal(mirror, want_mirror), i
            else:
                codec = dc.encode_deferred(chunk, widths, bounds, None)
                assert isinstance(codec, fmt.Deferred)
                assert counts is None and torch.equal(payload, codec.take(int(codec.length)))
                assert torch.equal(mirror, dc.codec.decode(payload)), i  # what the peer's codec decodes
        assert "encode" not in c.by_label, c.counts  # no wait per chunk
        assert {k: v.ids() for k, v in flagged.caches.items()} == {k: v.ids() for k, v in plain.caches.items()}


@pytest.mark.parametrize("nb", [2, 5])
def test_probe_waits_a_fixed_number_of_times_per_chunk_whatever_its_blocks(nb):
    dc = _codec()
    feats, widths, bounds = [f"f{k}" for k in range(nb)], [DIM] * nb, [EB] * nb
    probe, stats = CacheProbe(backend="device"), CommStats()  # its shadow caches' compactions: the device's
    c = HostSyncCounter()
    with counted_reads(c), c, _labelled(c, fc, ["_code", "_decode"], "codec"):
        for i, (chunk, ids) in enumerate(_chunks(nb)):
            payload = dc.encode(chunk, widths, bounds, ids)
            with c.label(f"observe{i}"):
                probe.observe(dc, chunk, ids, payload, feats, widths, bounds, 1, stats)
    for i in range(3):  # per scheme the cache's encode (1), then the worst errors with the bounds (1)
        assert c.by_label[f"observe{i}"] == 2 * 2, c.counts


def _batch(nf: int, rows: int = 32) -> Batch:
    g = torch.Generator().manual_seed(nf)
    lengths = torch.randint(0, 3, (nf * rows,), generator=g, dtype=torch.int32)
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync([f"f{k}" for k in range(nf)], values, lengths)
    return Batch(dense_features=torch.zeros(rows, 1), sparse_features=kjt, labels=torch.zeros(rows))


@pytest.mark.parametrize("nf", [2, 5])
def test_hot_split_reads_every_keys_length_in_one_wait(nf):
    hot = {f"f{k}": torch.tensor([3, 7, 1]) for k in range(nf)}
    split = HotSplit(hot, backend="device")  # the device's compactions (no nonzero)
    batch = _batch(nf)
    c = HostSyncCounter()
    with counted_reads(c), c:
        out = split(batch).sparse_features
    assert c.total == 1, c.counts
    want = HotSplit(hot, backend="host")(batch).sparse_features  # the host backend's answer
    assert out.keys() == want.keys() and torch.equal(out.values(), want.values())
    assert torch.equal(out.lengths(), want.lengths()) and out.length_per_key() == want.length_per_key()


def _touch(params: dict[str, torch.nn.Parameter], g: torch.Generator) -> None:
    for p in params.values():
        rows = torch.randint(0, p.shape[0], (6,), generator=g).unique()
        p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(len(rows), DIM, generator=g), p.shape)


@pytest.mark.parametrize("tables", [2, 5])
@pytest.mark.parametrize("coded", [False, True])
def test_hot_row_sync_waits_a_fixed_number_of_times_per_sync_whatever_its_tables(tables, coded):
    def run(count: bool) -> tuple[list[torch.Tensor], HostSyncCounter]:
        """Counted on the device backend, else on the host's (the CPU shortcuts)."""
        backend = "device" if count else "host"
        params = {
            f"w{k}": torch.nn.Parameter(torch.randn(16, DIM, generator=torch.Generator().manual_seed(k)))
            for k in range(tables)
        }
        wire = SyncWire(_codec("backward", "rel", backend), list(params), [16] * tables, DIM) if coded else None
        opt = HotRowOptimizer(params, "rowwise_adagrad", lr=0.1, eps=1e-8, sync_every=1, wire=wire, backend=backend)
        g, c = torch.Generator().manual_seed(0), HostSyncCounter()
        for i in range(3):
            _touch(params, g)
            if not count:
                opt.step()
                continue
            with counted_reads(c), c, c.label(f"step{i}"):  # the codec's own waits counted too
                opt.step()
        return [p.detach().clone() for p in params.values()], c

    replicas, c = run(count=True)
    # exact: the touched counts, the hit counts (all tables at once); coded: the payload's length
    # (one rank: no size exchange), then every payload's head with the checks, the parts' codec
    # heads and the hit counts
    expected = 2
    assert all(c.by_label[f"step{i}"] == expected for i in range(3)), c.counts
    assert all(torch.equal(a, b) for a, b in zip(replicas, run(count=False)[0], strict=True))


def _synced_on_ranks(rank: int, ws: int, tables: int, coded: bool) -> dict:
    """Three syncs of every rank's touched rows, on the host backend (the CPU shortcuts), then on
    the device backend, counted: this rank's waits per sync (the codec's own included) and its
    collectives."""
    import torch.distributed as dist

    from dlrm.placement import hot_sync

    calls = {"n": 0}
    gather, exchange = dist.all_gather, dist.all_to_all_single

    def counted(collective: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return collective(*args, **kwargs)

        return run

    hot_sync.dist.all_gather, hot_sync.dist.all_to_all_single = counted(gather), counted(exchange)  # type: ignore[attr-defined]
    try:
        runs = {}
        for path in ("host", "device"):
            params = {
                f"w{k}": torch.nn.Parameter(torch.randn(16, DIM, generator=torch.Generator().manual_seed(k)))
                for k in range(tables)
            }
            wire = SyncWire(_codec("backward", "rel", path), list(params), [16] * tables, DIM) if coded else None
            opt = HotRowOptimizer(params, "rowwise_adagrad", lr=0.1, eps=1e-8, sync_every=1, wire=wire, backend=path)
            g, c = torch.Generator().manual_seed(rank), HostSyncCounter()
            calls["n"] = 0
            for i in range(3):
                _touch(params, g)
                if path == "host":
                    opt.step()
                    continue
                with counted_reads(c), c, c.label(f"step{i}"):  # the codec's own waits counted too
                    opt.step()
            runs[path] = ([p.detach().clone() for p in params.values()], c, calls["n"] // 3)
    finally:  # unwrapped for the next case in this process
        hot_sync.dist.all_gather, hot_sync.dist.all_to_all_single = gather, exchange  # type: ignore[attr-defined]
    (host, _, _), (device, c, collectives) = runs["host"], runs["device"]
    return {
        "same": all(torch.equal(a, b) for a, b in zip(host, device, strict=True)),
        "replicas": device,
        "waits": [c.by_label[f"step{i}"] for i in range(3)],
        "collectives": collectives,
    }


@pytest.fixture(scope="module")
def synced_on_two_ranks():
    """_synced_on_ranks at 2 ranks, exact and coded, in one job: starting the ranks costs more than the syncs."""
    from multiprocess import SharedJob

    return SharedJob({2: {coded: (_synced_on_ranks, 3, coded) for coded in (False, True)}})


@pytest.mark.parametrize("ws", [2, pytest.param(3, marks=pytest.mark.scale)])  # 3 ranks: make test-scale
@pytest.mark.parametrize("coded", [False, True])
def test_hot_row_sync_on_ranks_waits_at_most_once_per_collective(request, coded, ws):
    from multiprocess import run_ranks

    if ws == 2:
        got = request.getfixturevalue("synced_on_two_ranks")[coded]
    else:  # (make test-scale: one job a case, as before)
        got = run_ranks(_synced_on_ranks, ws, 3, coded)
    for r in got:
        assert r["same"]  # the device code's replicas are the CPU shortcuts', bit for bit
        assert all(torch.equal(a, b) for a, b in zip(r["replicas"], got[0]["replicas"], strict=True))
        # the exact sync: the size all-gather and the rows' all-gather; coded: the size all-gather
        # and the payloads' all-to-all
        assert r["collectives"] == 2, r
        # one read after each, the codec's own included: the sizes (with the touched counts,
        # exact), then the hit counts (with every payload's head and its parts' codec heads, coded)
        assert r["waits"] == [r["collectives"]] * 3, (ws, r["waits"], r["collectives"])


# The functions these features run per chunk, batch or sync, and their host copies: each a size
# the layout needs (read once for all blocks or tables), the wire's framing, or a CPU shortcut.
PER_ITERATION: dict[str, tuple[str, ...] | None] = {
    "compression.row_cache": PER_CHUNK["compression.row_cache"],  # (the chunk's: the same functions)
    "dlrm.embedding_comm.forward_cache": None,
    "dlrm.embedding_comm.cache_probe": ("CacheProbe.measure", "CacheProbe.observe", "_over_bound"),
    "dlrm.placement.hot_rows": ("HotSplit.__call__", "HotRows.forward"),
    "dlrm.placement.hot_sync": None,
    "dlrm.placement.hot_wire": (
        "SyncWire.bounds",
        "SyncWire.encode",
        "SyncWire.encode_capacity",
        "SyncWire.settle",
        "SyncWire.decode",
        "SyncWire.decode_all",
        "SyncWire._rows",
        "SyncWire._tables",
        "held_slots",
        "_host",
    ),
}
KNOWN = {
    ("dlrm.embedding_comm.forward_cache", "ForwardCache.encode", "tolist"),  # the blocks' classification
    ("dlrm.embedding_comm.forward_cache", "CacheStage.encode", "tolist"),  # a sampled chunk: length and counts
    ("dlrm.embedding_comm.forward_cache", "ForwardCache.decode", "tolist"),  # held counts and flags, moved counts
    ("dlrm.embedding_comm.cache_probe", "_over_bound", "tolist"),  # the worst errors, a statistic
    ("dlrm.placement.hot_rows", "HotSplit.__call__", "tolist"),  # the keys' lengths (length_per_key)
    ("dlrm.placement.hot_sync", "HotRowOptimizer._hits", "tolist"),  # the hit counts (exact)
    ("dlrm.placement.hot_sync", "HotRowOptimizer._gather", "tolist"),  # the size exchange with the touched counts
    ("dlrm.placement.hot_sync", "HotRowOptimizer._gather_coded", "tolist"),  # the size exchange
    ("dlrm.placement.hot_wire", "SyncWire.encode", "numpy"),  # zlib's crc32 of a CPU payload
    ("dlrm.placement.hot_wire", "_host", "cpu"),  # the bounds with the touched counts; every head, check and hit count
    ("dlrm.placement.hot_wire", "_host", "numpy"),
}


def test_static_check_finds_only_the_known_host_copies():
    sites = {(s.module, s.function, s.call) for s in host_copies(PER_ITERATION)}
    assert sites == KNOWN, sorted(sites ^ KNOWN)
    assert all(isinstance(s, HostCopy) for s in host_copies(PER_ITERATION))
