"""Run the trainer with its all-to-alls and codecs timed per training iteration (for dlrm.bench.netbench).

    DLRM_NETPROBE_OUT=DIR torchrun --nproc_per_node N -m dlrm.bench.netprobe [hydra overrides]

Trains exactly like ``python -m dlrm.train`` (same entry point, same overrides) and writes
``DIR/probe_rank<R>.json`` per rank: one record per training iteration with its wall time and,
split by pass (``forward``/``backward``), the time this rank was blocked in pooled-embedding
all-to-alls (the blocking call plus the wait on the async work, i.e. the exposed communication),
the bytes it sent to other ranks in them, and the codec time. Evaluation is not counted.

How: ``torch.distributed.all_to_all_single`` is wrapped (TorchRec and ``dlrm.embedding_comm`` call it
through the module); a call made inside :func:`dlrm.process.instrument.embedding_collective` is a
pooled-embedding all-to-all of that direction (the compressed all-to-all marks its own; the probe
marks TorchRec's ``All2All_Pooled_Req``/``_Wait`` the same way for the stock QComms path) and
the rest (the sparse input dist) is counted apart. The trainer's :class:`dlrm.trainer.loop.StepObserver`
seam marks training segments and closes an iteration after each step. Codec time comes from the
run statistics of the compressed dists (encode + decode + dedup) and, for TorchRec's QComms, from
timing fbgemm's ``QuantizedCommCodec.encode/decode``; the dense-gradient hook's codec time (DCT,
PowerSGD, casts) from its own statistics. The dense all-reduce itself runs inside DDP's reducer,
overlapped with the backward: its wire time stays in the remainder of the iteration.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torchrec.distributed import comm_ops as torchrec_comm_ops

from dlrm.dense_comm.wrapper import dense_comm_of
from dlrm.process.env import exit_without_teardown
from dlrm.process.instrument import current, embedding_collective
from dlrm.telemetry.comm_stats import run_totals

OUT_ENV = "DLRM_NETPROBE_OUT"
PASSES = ("forward", "backward")


class _Probe:
    """Per-process counters: the open iteration's sums and the finished iterations."""

    def __init__(self) -> None:
        self.training = False
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
    def timed(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if not PROBE.training:
            return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        direction = current()
        kind = f"a2a/{direction}" if direction else "other_a2a"
        PROBE.add(f"{kind}/bytes", _sent_bytes(input, input_split_sizes, group))
        t0 = time.perf_counter()
        work = real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        PROBE.add(f"{kind}/ms", 1e3 * (time.perf_counter() - t0))
        return _TimedWork(work, f"{kind}/ms") if async_op and work is not None else work

    return timed


def _mark(real: Callable[..., Any], direction: str) -> Callable[..., Any]:
    """``real`` run as an embedding collective of ``direction`` (TorchRec's own pooled all-to-all)."""

    @functools.wraps(real)
    def marked(*args: Any, **kwargs: Any) -> Any:
        with embedding_collective(direction):
            return real(*args, **kwargs)

    return staticmethod(marked)


def _wrap_codec(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            PROBE.add(f"codec/{current() or 'forward'}/ms", 1e3 * (time.perf_counter() - t0))

    return timed


def comm_run_sums(model: torch.nn.Module) -> dict[str, float]:
    """Run totals of the compressed dists in ``model`` and of its dense-gradient hook (this rank)."""
    return run_totals(model, dense_comm_of(model))


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
    for d in (*PASSES, "dense"):
        key = f"{d}/codec_ms"
        if key in comm:
            step[f"codec/{d}/ms"] = step.get(f"codec/{d}/ms", 0.0) + comm[key] - PROBE.comm_last.get(key, 0.0)
    PROBE.steps.append(step)
    PROBE.open = defaultdict(float)
    PROBE.comm_last = comm
    PROBE.t_last = time.perf_counter()  # the statistics snapshot is the probe's, not the trainer's


class TrainingObserver:
    """The trainer's :class:`dlrm.trainer.loop.StepObserver`: counts only inside training segments and
    closes an iteration after each optimizer step."""

    def segment_start(self, model: torch.nn.Module) -> None:
        PROBE.segments += 1
        PROBE.dense_params = dense_parameter_count(model)
        PROBE.comm_last = comm_run_sums(model)
        PROBE.open = defaultdict(float)
        PROBE.training, PROBE.t_last = True, time.perf_counter()

    def step_end(self, model: torch.nn.Module) -> None:
        _close_step(model)

    def segment_end(self, model: torch.nn.Module) -> None:
        PROBE.training = False


def install() -> None:
    """Wrap the all-to-all collective, mark TorchRec's pooled all-to-all, time the QComms codec."""
    dist.all_to_all_single = _wrap_all_to_all_single(dist.all_to_all_single)
    for cls, method, direction in (
        (torchrec_comm_ops.All2All_Pooled_Req, "forward", "forward"),
        (torchrec_comm_ops.All2All_Pooled_Wait, "forward", "forward"),
        (torchrec_comm_ops.All2All_Pooled_Wait, "backward", "backward"),
        (torchrec_comm_ops.All2All_Pooled_Req, "backward", "backward"),
    ):
        setattr(cls, method, _mark(getattr(cls, method), direction))
    try:
        from fbgemm_gpu.quantize_comm import QuantizedCommCodec
    except ImportError:  # no QComms without fbgemm: nothing to time
        return
    QuantizedCommCodec.encode = _wrap_codec(QuantizedCommCodec.encode)
    QuantizedCommCodec.decode = _wrap_codec(QuantizedCommCodec.decode)


def write(out_dir: Path, error: str | None = None) -> Path:
    """This rank's records as ``probe_rank<R>.json`` (atomically)."""
    rank = int(os.environ.get("RANK", 0))
    record = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "segments": PROBE.segments,
        "dense_params": PROBE.dense_params,
        "steps": PROBE.steps,
        "error": error,
        "omp_threads": torch.get_num_threads(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"probe_rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def main() -> None:
    """Install the probe, run the trainer's Hydra entry point with it, write this rank's records."""
    out = os.environ.get(OUT_ENV)
    if not out:
        raise SystemExit(f"dlrm.bench.netprobe: set {OUT_ENV}=DIR (where each rank writes probe_rank<R>.json)")
    install()
    from dlrm.train import hydra_main, run

    def probed(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
        return run(cfg, run_dir, observers=[TrainingObserver()])

    error = None
    try:
        hydra_main(probed)()
    except BaseException as e:  # record why, then let it propagate (Hydra exits non-zero)
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        write(Path(out), error)
    exit_without_teardown()


if __name__ == "__main__":
    main()
