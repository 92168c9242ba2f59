"""Position ids (dedup.position_ids): rows at a capacity take their positions as ids, and the plan
both ends know from the counts is the one a sort of those ids finds."""

from __future__ import annotations

import pytest
import torch

import dlrm_compression as compression
from dlrm.bench.host_syncs import counted_reads
from dlrm.telemetry.sync_counter import HostSyncCounter
from dlrm_compression import PayloadError, dedup, reference
from dlrm_compression import format as fmt

CASES = [([3, 0, 7], 7), ([1], 1), ([2], 5), ([0], 3), ([5, 5], 9), ([0, 0], 4), ([2, 9, 1, 4, 0, 6], 12)]


def _spelled_out(counts: list[int], capacity: int) -> torch.Tensor:
    """The ids as the layout says, row by row: block b's row r is r below its count, else 0."""
    return torch.tensor([[r if r < c else 0 for c in counts] for r in range(capacity)], dtype=torch.int64)


@pytest.mark.parametrize(("counts", "capacity"), CASES)
def test_the_attached_plan_is_the_plan_a_sort_of_the_ids_finds(counts, capacity):
    keys = dedup.position_ids(torch.tensor(counts), capacity)
    expected = _spelled_out(counts, capacity)
    assert torch.equal(keys, expected)
    sorted_plan = dedup.id_plan(expected.clone())  # (a fresh tensor: planned by a sort)
    for name, got, want in zip(sorted_plan._fields, dedup.id_plan(keys), sorted_plan, strict=True):
        assert torch.equal(got, want), name
    assert int(dedup.id_plan(keys).fingerprint) == int(reference.fingerprint(expected))


@pytest.mark.parametrize(("counts", "capacity"), CASES)
def test_the_receivers_ids_carry_on_the_host_what_a_decoder_would_read(counts, capacity):
    keys = dedup.host_position_ids(counts, capacity, torch.device("cpu"))
    sorted_plan = dedup.id_plan(_spelled_out(counts, capacity))
    assert torch.equal(keys, _spelled_out(counts, capacity))
    assert dedup.host_plan(keys) == [*sorted_plan.counts.tolist(), int(sorted_plan.fingerprint)]
    assert torch.equal(dedup.id_plan(keys).inverse, sorted_plan.inverse)
    assert dedup.host_plan(_spelled_out(counts, capacity)) is None  # (a plain tensor: the device holds it)


def test_counts_past_the_capacity_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"block 1's row count 8 is not within the capacity of 7 rows"):
        dedup.host_position_ids([3, 8], 7, torch.device("cpu"))


def _payload(counts: list[int], capacity: int, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Rows at capacity (each block's padding its first row), coded by their positions as ids."""
    g = torch.Generator().manual_seed(sum(counts))
    rows = torch.randn(capacity, dim * len(counts), generator=g)
    for b, c in enumerate(counts):  # the padding: the block's first row again
        rows[max(c, 1) :, b * dim : (b + 1) * dim] = rows[0, b * dim : (b + 1) * dim]
    codec = compression.get_codec("lossy", entropy=False, backend="device")
    bounds = torch.full((len(counts),), 0.01, dtype=torch.float64)
    keys = dedup.position_ids(torch.tensor(counts), capacity)
    d = codec.encode_deferred(rows, bounds, keys, blocks=[dim] * len(counts))
    payload = d.buffer[: int(d.length)] if isinstance(d, fmt.Deferred) else d
    return rows, payload, codec


@pytest.mark.parametrize(("counts", "capacity"), CASES)
def test_a_payload_coded_by_positions_decodes_from_the_receivers_ids_reading_nothing_more(counts, capacity):
    rows, payload, codec = _payload(counts, capacity)
    by_sort = codec.decode(payload.clone(), _spelled_out(counts, capacity))  # the ids as any caller passes them
    assert (by_sort - rows).abs().max() <= 0.01
    head = fmt.read_heads([payload], [None], [codec.head_size(len(counts))])[0]
    known = dedup.host_position_ids(counts, capacity, payload.device)
    counter = HostSyncCounter()
    with counted_reads(counter), counter:
        decoded = codec.decode(payload.clone(), known, head=head)
    assert torch.equal(decoded, by_sort) and counter.total == 0, counter.counts


def test_a_receiver_with_other_counts_is_told_its_ids_differ():
    _, payload, codec = _payload([3, 5], 6)
    head = fmt.read_heads([payload], [None], [codec.head_size(2)])[0]
    with pytest.raises(PayloadError, match="ids differ from the ids the payload was encoded with"):
        codec.decode(payload.clone(), dedup.host_position_ids([3, 4], 6, payload.device), head=head)
