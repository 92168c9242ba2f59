"""The host-synchronisation meter counts whole steady-state iterations only, and their mean."""

from __future__ import annotations

import torch

from dlrm.telemetry.host_syncs import HostSyncMeter

MODEL = torch.nn.Linear(1, 1)


def iteration(items: int) -> None:
    """An iteration's work: ``items`` host reads of a tensor value and one data-dependent shape."""
    t = torch.arange(4)
    for _ in range(items):
        t.sum().item()
    t.nonzero()


def test_counts_the_window_after_the_skipped_iterations_and_reports_the_mean() -> None:
    meter = HostSyncMeter(torch.device("cpu"), skip=2, window=2)
    meter.segment_start(MODEL)
    for items in (10, 10, 1, 3, 10, 10):  # iterations 1-2 skipped, 3-4 counted, 5-6 past the window
        iteration(items)
        meter.step_end(MODEL)
    meter.segment_end(MODEL)
    assert meter.counted == 2
    assert meter.metrics() == {"host_syncs_per_iteration": 3.0, "host_syncs_by_op": {"item": 2.0, "nonzero": 1.0}}


def test_an_iteration_cut_by_the_end_of_a_segment_is_not_counted() -> None:
    meter = HostSyncMeter(torch.device("cpu"), skip=1, window=5)
    meter.segment_start(MODEL)
    iteration(1)
    meter.step_end(MODEL)  # counting starts here
    iteration(7)  # drained by the segment's end: not a whole iteration
    meter.segment_end(MODEL)
    assert meter.counted == 0 and meter.metrics()["host_syncs_per_iteration"] is None
    meter.segment_start(MODEL)
    iteration(9)  # a segment's first iteration fills the pipeline: not counted
    meter.step_end(MODEL)
    iteration(2)
    meter.step_end(MODEL)
    meter.segment_end(MODEL)
    assert meter.counted == 1 and meter.metrics()["host_syncs_per_iteration"] == 3.0


def test_on_cuda_host_tensors_do_not_count() -> None:
    meter = HostSyncMeter(torch.device("cuda", 0), skip=0, window=1)
    meter.segment_start(MODEL)
    meter.step_end(MODEL)
    iteration(3)  # CPU tensors: no device to wait for
    meter.step_end(MODEL)
    meter.segment_end(MODEL)
    assert meter.counted == 1 and meter.metrics()["host_syncs_per_iteration"] == 0.0
