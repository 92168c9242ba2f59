"""The host-synchronisation counter sees every kind of sync once per call on CPU tensors, nothing in
sync-free code, nests, and leaves results bit for bit as they were."""

import sys
import warnings

import pytest
import torch

import dlrm_compression as compression
from dlrm.bench.criteo_like import criteo_like_batch
from dlrm.telemetry.sync_counter import HostSyncCounter


def test_each_kind_of_sync_counts_once_per_call():
    x = torch.arange(12.0)
    mask = x > 5
    with HostSyncCounter() as c:
        x.sum().item()
        float(x[0])
        int(x[1])
        bool(x[2])  # 4 x item
        x.nonzero()
        torch.unique(x, return_inverse=True)
        torch.unique(x.view(6, 2), dim=0)
        torch.unique_consecutive(x)  # 3 x unique
        x.masked_select(mask)
        x[mask]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # uint8 masks are deprecated, still served
            x[mask.to(torch.uint8)]  # 2 x bool_index
        y = x.clone()
        y[mask] = torch.zeros(6)  # a tensor of values: the mask becomes positions, a sync
        torch.repeat_interleave(x, torch.full((12,), 2))  # the output size is the repeats' sum
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.equal(x, y)
        torch.bincount(torch.tensor([0, 3, 3]))
        x.to("meta")  # a blocking copy to a device
        with pytest.raises(NotImplementedError):  # a meta tensor has no bytes to copy, but it was asked
            torch.empty(3, device="meta").cpu()
    assert c.by_op == {
        "item": 4,
        "nonzero": 1,
        "unique": 3,
        "masked_select": 1,
        "bool_index": 2,
        "bool_index_put": 1,
        "repeat_interleave": 2,
        "equal": 1,
        "bincount": 1,
        "to_device": 1,
        "to_host": 1,
    }
    assert c.total == 18


def test_sync_free_code_counts_nothing():
    x = torch.randn(64, 8)
    counts = torch.full((8,), 3)
    with HostSyncCounter() as c:
        y = (x * 2 + 1).relu().sum(0)
        s, perm = torch.sort(x[:, 0])
        x.cumsum(0)
        torch.zeros(64).scatter_(0, perm, s)
        torch.zeros(8).index_add_(0, torch.arange(8), y)
        torch.repeat_interleave(counts, counts, output_size=24)  # the caller knows the size
        torch.nonzero_static(x[:, 0] > 0, size=64)
        x.masked_fill(x > 0, 0.0)
        z = x.clone()
        z[x > 0] = 0.0  # one mask, a Python number: masked_fill, no sync (on CUDA too)
        torch.where(x > 0, x, -x).amax(1)
        x.index_select(0, perm)
        x.to(torch.float16)
        x.to("meta", non_blocking=True)
    assert c.total == 0, c.counts


def test_labels_nest_and_counters_nest():
    x = torch.arange(4.0)
    with HostSyncCounter() as outer:
        x.nonzero()
        with outer.label("encode"):
            x.sum().item()
            with HostSyncCounter() as inner, outer.label("bounds"):
                float(x.max())
                float(x.min())
        with outer.label("empty"):
            x + 1
    assert inner.counts == {("", "item"): 2}
    assert outer.counts == {("", "nonzero"): 1, ("encode", "item"): 1, ("encode/bounds", "item"): 2}
    assert outer.by_label == {"": 1, "encode": 1, "encode/bounds": 2}
    assert outer.labels == ["encode", "encode/bounds", "empty"]


def test_cpu_tensors_count_only_as_the_device_proxy():
    x = torch.arange(4.0)
    with HostSyncCounter(count_cpu=False) as c:
        x.sum().item()
        x.nonzero()
        x.to("meta")  # a real device: still counted
    assert c.by_op == {"to_device": 1}


def test_trace_names_the_calling_line():
    x = torch.arange(4.0)
    with HostSyncCounter(trace=True) as c, c.label("here"):
        line = sys._getframe().f_lineno + 1
        x.nonzero()
    assert [(e.op, e.label) for e in c.events] == [("nonzero", "here")]
    assert c.events[0].where.endswith(f"test_sync_counter.py:{line}")


def test_counting_leaves_the_codec_bit_identical():
    batch = criteo_like_batch(rows=256, tables=3, dim=16, seed=1)
    x = torch.cat([t["values"] for t in batch.values()], 1)
    ids = torch.stack([t["ids"] for t in batch.values()], 1)
    codec = compression.get_codec("lossy", entropy=False)

    def run():
        eb = compression.relative_to_absolute(x, 0.01, [16] * 3)
        payload = codec.encode(x, eb, ids, blocks=[16] * 3)
        return eb, payload, codec.decode(payload, ids)

    plain = run()
    with HostSyncCounter(trace=True) as c:
        counted = run()
    assert c.total > 0
    assert torch.equal(plain[0], counted[0])
    assert torch.equal(plain[1], counted[1])
    assert torch.equal(plain[2].view(torch.int32), counted[2].view(torch.int32))
