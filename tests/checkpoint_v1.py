"""The writer of checkpoint format 1, as dlrm/trainer/checkpoint.py had it up to 44430a6 (its
``save``, trimmed of the rotation): tests make old-format fixtures with it, so that a checkpoint a
run of that version left behind is what the reader is tested on, not a file kept in the repository.
A deliberately frozen copy: it repeats lines of today's writer on purpose and must not follow it
(or share its code), or the fixtures would stop being format 1's.

Layout: ``step-<N>/`` holds DCP shards of the model and optimizer alone, ``train_state.json`` (the
position, the world size, every shared part's state, and ``checksums``: file name -> [size, crc32]
of every other file) and ``state-rank<r>.pt`` (each rank's own parts, ``torch.save``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dlrm.trainer.checkpoint_format import file_digest


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_ranks(mine: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def save(
    root: Path,
    model: torch.nn.Module,
    optimizer: Any,
    train_state: dict[str, Any],
    rank: int,
    rank_state: Mapping[str, Any],
) -> Path:
    """Format 1's save (every rank calls it): ``train_state`` holds iteration, epoch, batch_in_epoch,
    world_size and the shared parts; ``rank_state`` this rank's own parts."""
    step = int(train_state["iteration"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(tmp))
    torch.save(dict(rank_state), tmp / f"state-rank{rank}.pt")
    _barrier()
    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    world_size = int(train_state["world_size"])
    shares = _all_ranks({name: file_digest(tmp / name) for name in names[rank::world_size]})
    if rank == 0:
        train_state = {**train_state, "checksums": {k: v for share in shares for k, v in share.items()}}
        (tmp / "train_state.json").write_text(json.dumps(train_state, indent=2, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        pointer = root / ".latest.tmp"
        pointer.write_text(final.name)
        pointer.replace(root / "latest")
    _barrier()
    return final
