"""Run the trainer with its all-to-alls and codecs timed per training iteration (for dlrm.netbench).

    DLRM_NETPROBE_OUT=DIR torchrun --nproc_per_node N -m dlrm.netprobe [hydra overrides]

Trains exactly like ``python -m dlrm.train`` (same entry point, same overrides) and writes
``DIR/probe_rank<R>.json`` per rank: one record per training iteration with its wall time and,
split by pass (``forward``/``backward``), the time this rank was blocked in pooled-embedding
all-to-alls (the blocking call plus the wait on the async work, i.e. the exposed communication),
the bytes it sent to other ranks in them, and the codec time. Evaluation is not counted.

How, without touching the trainer: ``torch.distributed.all_to_all_single`` is wrapped (TorchRec
and ``dlrm.comm`` call it through the module), calls made from a ``comm_ops.py`` are the pooled
embeddings (TorchRec's and ours) and the rest (the sparse input dist) is counted apart;
``torch.autograd.backward`` marks the backward pass; ``dlrm.loop.Stepper.run`` marks training and
each ``on_step`` closes an iteration. Codec time comes from the run statistics of the compressed
dists (``dlrm.comm``: encode + decode + dedup) and, for TorchRec's QComms, from timing fbgemm's
``QuantizedCommCodec.encode/decode``. The dense all-reduce runs inside DDP's C++ reducer and is
not visible here: it stays in the remainder of the iteration.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

OUT_ENV = "DLRM_NETPROBE_OUT"
PASSES = ("forward", "backward")
_EMB_CALLERS = ("comm_ops.py",)  # torchrec/distributed/comm_ops.py and dlrm/comm/comm_ops.py


class _Probe:
    """Per-process counters: the open iteration's sums and the finished iterations."""

    def __init__(self) -> None:
        self.training = False
        self.phase = "forward"
        self.open: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.t_last = 0.0
        self.comm_last: dict[str, float] = {}
        self.segments = 0
        self.dense_params = 0  # all-reduced (DDP) parameters, for the cost model

    def add(self, key: str, value: float) -> None:
        if self.training:
            self.open[key] += value


PROBE = _Probe()


class _TimedWork(dist.Work):
    """An async ``dist.Work`` (TorchRec checks ``isinstance``) whose ``wait()`` time is counted."""

    def __init__(self, work: dist.Work, key: str) -> None:
        super().__init__()
        self._work, self._key = work, key

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            PROBE.add(self._key, 1e3 * (time.perf_counter() - t0))

    # The rest is the wrapped work's.
    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        return self._work.result()

    def get_future(self) -> Any:
        return self._work.get_future()

    def synchronize(self) -> None:
        self._work.synchronize()


def _sent_bytes(input_: torch.Tensor, input_split_sizes: list[int] | None, group: Any) -> int:
    """Bytes of ``input_`` that go to other ranks (a rank's own split never leaves the process)."""
    ws, me = dist.get_world_size(group), dist.get_rank(group)
    if input_.dim() == 0 or input_.numel() == 0:
        return 0
    row = input_.numel() // max(input_.size(0), 1) * input_.element_size()
    if input_split_sizes is None:
        return (input_.size(0) // ws) * (ws - 1) * row
    return sum(int(n) for i, n in enumerate(input_split_sizes) if i != me) * row


def _wrap_all_to_all_single(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def timed(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
              input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if not PROBE.training:
            return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        caller = sys._getframe(1).f_code.co_filename
        kind = f"a2a/{PROBE.phase}" if caller.endswith(_EMB_CALLERS) else "other_a2a"
        PROBE.add(f"{kind}/bytes", _sent_bytes(input, input_split_sizes, group))
        t0 = time.perf_counter()
        work = real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        PROBE.add(f"{kind}/ms", 1e3 * (time.perf_counter() - t0))
        return _TimedWork(work, f"{kind}/ms") if async_op and work is not None else work

    return timed


def _wrap_backward(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def marked(*args: Any, **kwargs: Any) -> Any:
        previous, PROBE.phase = PROBE.phase, "backward"
        try:
            return real(*args, **kwargs)
        finally:
            PROBE.phase = previous

    return marked


def _wrap_codec(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            PROBE.add(f"codec/{PROBE.phase}/ms", 1e3 * (time.perf_counter() - t0))

    return timed


def comm_run_sums(model: torch.nn.Module) -> dict[str, float]:
    """Run totals of the compressed dists in ``model`` (this rank; empty without dlrm.comm dists)."""
    sums: dict[str, float] = defaultdict(float)
    for m in model.modules():
        dists = getattr(m, "compressed_dists", None)
        if not callable(dists):
            continue
        for d in dists():
            for k, v in d.stats.state(run=True)[0].items():
                if k.count("/") == 1:  # totals only, not per feature
                    sums[k] += v
    return dict(sums)


def dense_parameter_count(model: torch.nn.Module) -> int:
    """Parameters that DDP all-reduces every iteration (the dense MLPs inside DMP)."""
    from torch.nn.parallel import DistributedDataParallel

    total = 0
    for ddp in model.modules():
        if isinstance(ddp, DistributedDataParallel):
            ignored = ddp.parameters_to_ignore  # the sharded tables DMP keeps out of DDP
            for module_name, module in ddp.module.named_modules():
                for name, p in module.named_parameters(recurse=False):
                    if f"{module_name}.{name}" not in ignored and p.requires_grad:
                        total += p.numel()
    return total


def _close_step(model: torch.nn.Module) -> None:
    """End the open iteration: its wall time, and the codec time the dists added meanwhile."""
    now = time.perf_counter()
    comm = comm_run_sums(model)
    step = dict(PROBE.open)
    step["ms"] = 1e3 * (now - PROBE.t_last)
    for d in PASSES:
        key = f"{d}/codec_ms"
        if key in comm:
            step[f"codec/{d}/ms"] = step.get(f"codec/{d}/ms", 0.0) + comm[key] - PROBE.comm_last.get(key, 0.0)
    PROBE.steps.append(step)
    PROBE.open = defaultdict(float)
    PROBE.comm_last = comm
    PROBE.t_last = time.perf_counter()  # the statistics snapshot is the probe's, not the trainer's


def _wrap_stepper_run(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def run(self: Any, batches: Any, on_step: Callable[[torch.Tensor], None]) -> None:
        def step(loss: torch.Tensor) -> None:
            on_step(loss)
            _close_step(self.model)

        PROBE.segments += 1
        PROBE.dense_params = dense_parameter_count(self.model)
        PROBE.comm_last = comm_run_sums(self.model)
        PROBE.open = defaultdict(float)
        PROBE.training, PROBE.t_last = True, time.perf_counter()
        try:
            return real(self, batches, step)
        finally:
            PROBE.training = False

    return run


def install() -> None:
    """Patch the collectives, the backward entry point, the stepper and the QComms codec."""
    from dlrm.loop import Stepper

    dist.all_to_all_single = _wrap_all_to_all_single(dist.all_to_all_single)
    torch.autograd.backward = _wrap_backward(torch.autograd.backward)
    Stepper.run = _wrap_stepper_run(Stepper.run)
    try:
        from fbgemm_gpu.quantize_comm import QuantizedCommCodec
    except ImportError:  # no QComms without fbgemm: nothing to time
        return
    QuantizedCommCodec.encode = _wrap_codec(QuantizedCommCodec.encode)
    QuantizedCommCodec.decode = _wrap_codec(QuantizedCommCodec.decode)


def write(out_dir: Path, error: str | None = None) -> Path:
    """This rank's records as ``probe_rank<R>.json`` (atomically)."""
    rank = int(os.environ.get("RANK", 0))
    record = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", 1)), "segments": PROBE.segments,
              "dense_params": PROBE.dense_params, "steps": PROBE.steps, "error": error, "omp_threads": torch.get_num_threads()}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"probe_rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def main() -> None:
    """Install the probe, run the trainer's Hydra entry point, write this rank's records."""
    out = os.environ.get(OUT_ENV)
    if not out:
        raise SystemExit(f"dlrm.netprobe: set {OUT_ENV}=DIR (where each rank writes probe_rank<R>.json)")
    install()
    from dlrm.train import main as train_main

    error = None
    try:
        train_main()
    except BaseException as e:  # record why, then let it propagate (Hydra exits non-zero)
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        write(Path(out), error)


if __name__ == "__main__":
    main()
