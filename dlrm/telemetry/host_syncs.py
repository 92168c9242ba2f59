"""Host synchronisations per training iteration, counted on a few steady-state iterations.

A :class:`~dlrm.trainer.loop.StepObserver`: after ``skip`` training iterations (the pipeline's
fill, the first calibration) it counts the next ``window`` whole iterations, each from the end of
one optimizer step to the end of the next, with :class:`~dlrm.telemetry.sync_counter.HostSyncCounter`
(a dispatch mode: every op of a counted iteration goes through Python, so only a few are counted).
An iteration cut by the end of a training segment (evaluation, a checkpoint) is not counted.

What the figure means on each device: on CUDA only ops on device tensors count (real waits). On
the CPU every tensor stands for a device tensor, as in ``python -m dlrm.bench.host_syncs``, so
host-side work on the trainer's thread (e.g. batch preparation) counts too, and ``.tolist()``,
``.cpu()`` and ``.numpy()`` of CPU tensors do not reach the dispatcher and are missed: the CPU
figure counts dispatcher-visible synchronisations. Work in other threads is not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from dlrm.telemetry.sync_counter import HostSyncCounter


class HostSyncMeter:
    """Counts this rank's host synchronisations over ``window`` iterations after ``skip``."""

    def __init__(self, device: torch.device, skip: int = 2, window: int = 3) -> None:
        self.count_cpu = device.type == "cpu"
        self.skip, self.window = skip, window
        self.steps = 0  # training steps seen in this process
        self.counted = 0  # whole iterations counted
        self.by_op: Counter[str] = Counter()
        self._counter: HostSyncCounter | None = None

    def segment_start(self, model: torch.nn.Module) -> None:
        return  # a segment's first iteration fills the pipeline: not steady state

    def step_end(self, model: torch.nn.Module) -> None:
        self._stop(keep=True)
        self.steps += 1
        if self.steps >= self.skip and self.counted < self.window:
            self._counter = HostSyncCounter(count_cpu=self.count_cpu)
            self._counter.__enter__()

    def segment_end(self, model: torch.nn.Module) -> None:
        self._stop(keep=False)

    def _stop(self, keep: bool) -> None:
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)
        if keep:
            self.counted += 1
            self.by_op.update(counter.by_op)

    def metrics(self) -> dict[str, Any]:
        """``host_syncs_per_iteration`` (the mean over ranks and counted iterations; None if none
        was counted) and ``host_syncs_by_op`` (the same mean per op). A collective."""
        mine = (self.counted, dict(self.by_op))
        gathered: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        iterations = sum(n for n, _ in gathered)
        if not iterations:
            return {"host_syncs_per_iteration": None, "host_syncs_by_op": {}}
        by_op: Counter[str] = Counter()
        for _, ops in gathered:
            by_op.update(ops)
        return {
            "host_syncs_per_iteration": sum(by_op.values()) / iterations,
            "host_syncs_by_op": {op: n / iterations for op, n in sorted(by_op.items())},
        }
