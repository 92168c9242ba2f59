"""Read what a trainer run leaves behind: TensorBoard scalars and hparams, raw loss logs, checkpoints."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def events(run_dir: Path) -> EventAccumulator:
    """Every event file of the run's TensorBoard directory (all attempts of a resumed run)."""
    return EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0}).Reload()


def scalars(run_dir: Path, prefix: str = "") -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the scalars whose tag starts with ``prefix``."""
    acc = events(run_dir)
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"] if tag.startswith(prefix)}


def raw_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every (iteration, loss) line of losses.txt in file order (a restarted run appends)."""
    out = []
    for line in (run_dir / "losses.txt").read_text().splitlines():
        it, loss = line.split()
        out.append((int(it), float(loss)))
    return out


def attempts(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """The losses of a run restarted once, split where an iteration comes again: the first
    attempt's and the second's (from its checkpoint on); asserts that it restarted."""
    logged = raw_losses(run_dir)
    restart = next((n for n in range(1, len(logged)) if logged[n][0] <= logged[n - 1][0]), None)
    assert restart is not None, "no iteration was logged twice: the restart redid nothing"
    return dict(logged[:restart]), dict(logged[restart:])


def checkpoint_tensors(step_dir: Path) -> dict[str, Any]:
    """A sharded DCP checkpoint (model and optimizer of every rank) as one plain nested dict of
    whole tensors, loaded in this single process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(step_dir), str(Path(tmp) / "state.pt"))
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    return {k: state[k] for k in ("model", "optimizer")}


def data_files(step_dir: Path) -> list[str]:
    """The data files a checkpoint's .metadata records a size and crc32 of, sorted: rank r checks
    every world_size-th from the r-th on."""
    from torch.distributed.checkpoint import FileSystemReader

    from dlrm.trainer.checkpoint_format import SEAL

    storage = FileSystemReader(str(step_dir)).read_metadata().storage_data
    return sorted(i.fqn.removeprefix(SEAL) for i in storage if i.fqn.startswith(SEAL))


def checkpoint_items(step_dir: Path) -> dict[str, Any]:
    """Every item of a checkpoint, flat by DCP key, read in this single process (whole tensors; a
    part's state as the bytes DCP holds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None for k, m in meta.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": intended, this is one process
        dcp.load(out, checkpoint_id=str(step_dir), no_dist=True)
    return out


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths of a nested dict's leaves."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix.rstrip("/"): tree}


class RunsCode:
    """What a crafted checkpoint file or item holds: unpickling it calls ``open(marker, "w")``
    (a test then asserts that the marker was never made)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))
