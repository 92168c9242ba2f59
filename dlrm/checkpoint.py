"""Crash-safe sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout under ``<dir>``: ``step-<N>/`` holds the DCP shards of the model and optimizer (each rank
writes its own), ``train_state.json`` (iteration, data position, LR schedule, policy state, world
size) and ``rng-rank<r>.pt``; ``latest`` names the newest complete step. :class:`Checkpointer`
is what the trainer uses: ``resume(...)`` at the start, ``save(state)`` at intervals and the end. A save is written to
``.tmp-step-<N>/`` and renamed into place only once every rank has finished, so a crash during a
save leaves the previous checkpoint untouched and usable.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dlrm.env import DistEnv
from dlrm.loop import TrainState

LATEST = "latest"
RESUME_MODES = ("auto", True, False)
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    pass


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_step(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = root / LATEST
    if pointer.exists():
        step = root / pointer.read_text().strip()
        if (step / "train_state.json").exists():
            return step
    complete = [p for p in root.glob("step-*") if (p / "train_state.json").exists()]
    return max(complete, key=lambda p: int(p.name.split("-")[1]), default=None)


def save(
    root: Path,
    model: torch.nn.Module,
    optimizer: Any,
    train_state: dict[str, Any],
    rank: int,
    keep: int = 2,
    rank_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of ``train_state['iteration']`` on every rank (a collective call);
    ``rank_state`` is this rank's own state (tensors allowed), kept in ``state-rank<r>.pt``."""
    step = int(train_state["iteration"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    if rank_state:
        torch.save(dict(rank_state), tmp / f"state-rank{rank}.pt")
    _barrier()  # every rank's shard, RNG and state files are on disk
    if rank == 0:
        (tmp / "train_state.json").write_text(json.dumps(train_state, indent=2, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        pointer_tmp = root / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name)
        pointer_tmp.replace(root / LATEST)
        old = sorted((p for p in root.glob("step-*") if p != final), key=lambda p: int(p.name.split("-")[1]))
        for stale in old[: max(0, len(old) - (keep - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
        for stale_tmp in root.glob(".tmp-step-*"):
            if stale_tmp != tmp:
                shutil.rmtree(stale_tmp, ignore_errors=True)
    _barrier()
    return final


def load(
    step_dir: Path, model: torch.nn.Module, optimizer: Any, rank: int, world_size: int, device: Any = "cpu"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore model, optimizer and this rank's RNG from ``step_dir``; return its train_state and
    this rank's own state (empty if it saved none)."""
    state_file = step_dir / "train_state.json"
    if not state_file.exists():
        raise CheckpointError(f"{step_dir} is not a complete checkpoint (no train_state.json)")
    train_state = json.loads(state_file.read_text())
    saved_ws = int(train_state["world_size"])
    if saved_ws != world_size:
        raise CheckpointError(
            f"checkpoint {step_dir} was written by {saved_ws} ranks but this job has {world_size}: "
            f"the data position and per-rank RNG streams depend on the world size. Resume with "
            f"--nproc_per_node/--nnodes giving {saved_ws} ranks, or start a new run (resume=false)."
        )
    optimizer.init_state()  # materialize lazily created optimizer state so DCP can load into it
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(step_dir))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng_file = step_dir / f"rng-rank{rank}.pt"
    _set_rng_state(torch.load(rng_file, weights_only=False))
    rank_file = step_dir / f"state-rank{rank}.pt"
    # our own file, written by save() above (it holds numpy RNG states, hence not weights_only)
    rank_state = torch.load(rank_file, weights_only=False, map_location=device) if rank_file.exists() else {}
    return train_state, rank_state


class Stateful(Protocol):
    """Training state beside the model and optimizer: the LR schedule and policy (JSON-able, one
    copy for all ranks), the dense-gradient hook (tensors, one per rank)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Checkpointer:
    """Saves and restores one run: model, optimizer, RNG, and the named :class:`Stateful` parts:
    ``parts`` are the same on every rank (saved once, in train_state.json), ``rank_parts`` each
    rank's own (saved per rank)."""

    def __init__(
        self,
        root: Path,
        env: DistEnv,
        model: torch.nn.Module,
        optimizer: Any,
        parts: Mapping[str, Stateful | None],
        keep: int = 2,
        rank_parts: Mapping[str, Stateful | None] | None = None,
    ) -> None:
        self.root, self.env, self.model, self.optimizer, self.keep = root, env, model, optimizer, keep
        self.parts = {name: part for name, part in parts.items() if part is not None}
        self.rank_parts = {name: part for name, part in (rank_parts or {}).items() if part is not None}

    def resume(self, mode: Any) -> TrainState:
        """The state to start from: a fresh one, or the newest checkpoint's (``resume`` = auto: if
        there is one; true: there must be one; false: never)."""
        if mode not in RESUME_MODES:
            raise ValueError(f"config key 'resume' must be auto, true or false (got {mode!r})")
        last = latest_step(self.root) if mode else None
        if mode is True and last is None:
            raise FileNotFoundError(f"resume=true but {self.root} holds no complete checkpoint")
        if last is None:
            return TrainState()
        saved, mine = load(last, self.model, self.optimizer, self.env.rank, self.env.world_size, self.env.device)
        for name, part in self.parts.items():
            part.load_state_dict(saved.get(name, {}))
        for name, part in self.rank_parts.items():
            part.load_state_dict(mine.get(name, {}))
        state = TrainState(iteration=saved["iteration"], epoch=saved["epoch"], batch_in_epoch=saved["batch_in_epoch"])
        if self.env.is_main:
            log.info(
                "resumed from %s at iteration %d (epoch %d, batch %d)",
                last,
                state.iteration,
                state.epoch,
                state.batch_in_epoch,
            )
        return state

    def save(self, state: TrainState) -> Path:
        """Checkpoint ``state`` (a collective: every rank calls it)."""
        train_state = {
            **state.position(),
            "world_size": self.env.world_size,
            **{name: part.state_dict() for name, part in self.parts.items()},
        }
        rank_state = {name: part.state_dict() for name, part in self.rank_parts.items()}
        return save(self.root, self.model, self.optimizer, train_state, self.env.rank, self.keep, rank_state)
