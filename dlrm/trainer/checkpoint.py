"""Crash-safe sharded checkpoints: a run's whole state in one torch.distributed.checkpoint (DCP) save.

:class:`Checkpointer` is what the trainer uses: ``resume(...)`` at the start, ``save(state)`` at
intervals and the end. As torchtitan's CheckpointManager does, it hands DCP one dict of named
Stateful objects: the model, the optimizer, ``train_state`` (iteration, data position, world size)
and ``parts``, those of the run's components (lr schedule, early stopping, policies, strategy, row
caches, hot rows, the dense hook's state, ...) with this rank's random streams as ``rng``; a
:class:`~dlrm.trainer.state.PerRank` part is kept per rank. What a step directory holds, and how it
is checked and read: :mod:`dlrm.trainer.checkpoint_format`.

Publishing. Every rank writes into ``<dir>/.tmp-step-<N>/``, where DCP's ``.metadata`` (with the
size and crc32 of every data file) is written last; then rank 0 renames that directory to a name no
checkpoint has, ``step-<N>`` (``step-<N>.<k>`` when step N was saved before: a final save repeating
a periodic one), and replaces ``latest`` by a file naming it (written beside it, renamed over it).
Both renames are atomic and nothing is deleted before them: the earlier save of the same step, the
checkpoints beyond ``keep`` and the leftovers of interrupted saves go afterwards, each renamed out of
sight first. So ``latest`` always names a complete checkpoint, and a crash anywhere leaves the newest
published one whole; a resume takes the newest complete checkpoint (by N, then k).

Before loading, the ranks check their shares of the step's files against the recorded checksums and
agree on the result: ``resume=auto`` moves a damaged step aside to ``damaged-step-<N>/`` (never
deleted) and takes the previous one; ``resume=true`` refuses it, naming the file.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from dlrm.process.env import DistEnv
from dlrm.process.timeout import named_collective
from dlrm.trainer.checkpoint_format import (
    FORMAT,
    TRAIN_STATE,
    WEIGHTS,
    Part,
    complete_steps,
    damage,
    load_weights,
    read_state,
    step_order,
    write_step,
)
from dlrm.trainer.loop import TrainState
from dlrm.trainer.state import CheckpointError, RngState

LATEST = "latest"
RESUME_MODES = ("auto", True, False)
log = logging.getLogger(__name__)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_ranks(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a collective when there is more than one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def checked_steps(root: Path, rank: int = 0, world_size: int = 1) -> Iterator[tuple[Path, list[str]]]:
    """Each complete checkpoint under ``root``, newest first, with what is wrong with it (empty:
    intact) as all ranks together found it (a collective per step when there are several ranks)."""
    for step in complete_steps(root):
        with named_collective(f"checking checkpoint {step}"):
            found = [p for share in _all_ranks(damage(step, rank, world_size)) for p in share]
        yield step, list(dict.fromkeys(found))  # a finding about .metadata comes from every rank


def _sync_dir(path: Path) -> None:
    """Make the renames in directory ``path`` durable (they are atomic already)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_latest(root: Path, step_dir: Path | None) -> None:
    """Name ``step_dir`` in ``root/latest`` (atomically), or remove the pointer."""
    if step_dir is None:
        (root / LATEST).unlink(missing_ok=True)
        return
    pointer_tmp = root / f".{LATEST}.tmp"
    pointer_tmp.write_text(step_dir.name)
    pointer_tmp.replace(root / LATEST)
    _sync_dir(root)


def set_aside(step_dir: Path) -> Path:
    """Rename a damaged checkpoint out of the way of resumes and the ``keep`` rotation (never deleted)."""
    target, n = step_dir.with_name(f"damaged-{step_dir.name}"), 1
    while target.exists():
        target, n = step_dir.with_name(f"damaged-{step_dir.name}.{n}"), n + 1
    step_dir.rename(target)
    return target


def _remove(path: Path) -> None:
    """Rename ``path`` out of sight, then delete it: never a half-deleted directory under a checkpoint's name."""
    trash = path.with_name(f".deleting-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def publish(root: Path, tmp: Path, iteration: int, keep: int) -> Path:
    """Rank 0, once every rank has written ``tmp``: rename it to a name no checkpoint has, point
    ``latest`` at it, and only then remove the older checkpoints ``keep`` lets go (an earlier save of
    the same iteration among them) and the leftovers of interrupted saves."""
    taken = [o[1] for p in root.glob(f"step-{iteration}*") if (o := step_order(p)) and o[0] == iteration]
    repeat = max(taken, default=-1) + 1
    final = root / (f"step-{iteration}.{repeat}" if repeat else f"step-{iteration}")
    tmp.rename(final)
    point_latest(root, final)
    older = [p for p in complete_steps(root) if p != final]
    same = [p for p in older if (step_order(p) or (0, 0))[0] == iteration]
    others = [p for p in older if p not in same]
    for stale in [*same, *others[max(0, keep - 1) :]]:
        _remove(stale)
    for leftover in [*root.glob(".tmp-step-*"), *root.glob(".deleting-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    return final


@dataclass
class Position:
    """The ``train_state`` part: where training is (what a resume continues from), which world size
    wrote it (the data position and per-rank random streams depend on it) and the format."""

    state: TrainState
    world_size: int

    def state_dict(self) -> dict[str, Any]:
        return {**self.state.position(), "world_size": self.world_size, "format": FORMAT}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        if int(saved["world_size"]) != self.world_size:
            raise CheckpointError(
                f"written by {saved['world_size']} ranks but this job has {self.world_size}: the data position "
                f"and per-rank RNG streams depend on the world size. Resume with --nproc_per_node/--nnodes giving "
                f"{saved['world_size']} ranks, or start a new run (resume=false)."
            )
        self.state.iteration, self.state.epoch = int(saved["iteration"]), int(saved["epoch"])
        self.state.batch_in_epoch = int(saved["batch_in_epoch"])


def _restore(step: Path, name: str, part: Stateful, saved: Any) -> None:
    """``part.load_state_dict(saved)``; its refusal names the checkpoint and the part."""
    try:
        part.load_state_dict(saved)
    except (CheckpointError, ValueError) as e:  # compression/'s row cache refuses with ValueError
        raise CheckpointError(f"checkpoint {step}: {name}: {e}") from None


class Checkpointer:
    """Saves and restores one run: the model and optimizer, where training is, and ``parts``, the
    named :class:`Stateful` objects of its components (this rank's random streams added as ``rng``).
    A part's ``load_state_dict`` may refuse a checkpoint the run cannot continue by raising
    :class:`CheckpointError`; it is called before any model tensor is read."""

    def __init__(
        self,
        root: Path,
        env: DistEnv,
        model: torch.nn.Module,
        optimizer: Any,
        parts: Mapping[str, Stateful],
        keep: int = 2,
    ) -> None:
        self.root, self.env, self.model, self.optimizer, self.keep = root, env, model, optimizer, keep
        taken = sorted({"rng", TRAIN_STATE, *WEIGHTS} & set(parts))
        if taken:
            raise ValueError(f"checkpoint parts named {taken} would replace the checkpoint's own entries")
        self.parts: dict[str, Stateful] = {"rng": RngState(), **parts}

    def resume(self, mode: Any) -> TrainState:
        """The state to start from: a fresh one, or the newest checkpoint's (``resume`` = auto: if
        there is one; true: there must be one; false: never)."""
        if mode not in RESUME_MODES:
            raise ValueError(f"config key 'resume' must be auto, true or false (got {mode!r})")
        last = self._newest_intact(mode) if mode else None
        state = TrainState()
        if last is None:
            return state
        saved = read_state(last, self.env.rank, self.env.device)
        _restore(last, TRAIN_STATE, Position(state, self.env.world_size), saved.train_state)
        unknown = sorted(set(saved.parts) - set(self.parts))
        if unknown:
            raise CheckpointError(
                f"checkpoint {last} holds state of {unknown}, which this run does not have (it would be dropped): "
                "resume with the configuration the checkpoint was written with, or start a new run (resume=false)"
            )
        for name, part in self.parts.items():  # before any tensor is read: a part may refuse the checkpoint
            _restore(last, name, part, saved.parts.get(name, {}))
        with named_collective(f"loading checkpoint {last}"):
            load_weights(last, self.model, self.optimizer)
        if self.env.is_main:
            log.info(
                "resumed from %s at iteration %d (epoch %d, batch %d)",
                last,
                state.iteration,
                state.epoch,
                state.batch_in_epoch,
            )
        return state

    def _newest_intact(self, mode: Any) -> Path | None:
        """The newest checkpoint whose files all match their checksums, as all ranks agree: with
        resume=true the newest must be intact; with auto a damaged one is set aside (warned)."""
        steps = complete_steps(self.root)
        if mode is True and not steps:
            raise FileNotFoundError(f"resume=true but {self.root} holds no complete checkpoint")
        for step, found in checked_steps(self.root, self.env.rank, self.env.world_size):
            if not found:
                latest = self.root / LATEST
                if self.env.is_main and (not latest.exists() or latest.read_text() != step.name):
                    point_latest(self.root, step)
                return step
            if mode is True:
                raise CheckpointError(
                    f"resume=true but the newest checkpoint {step} is damaged: {'; '.join(found)}. Move it "
                    f"aside to resume from an older one (resume=auto does so itself), or start over (resume=false)."
                )
            if self.env.is_main:
                moved = set_aside(step)
                log.warning(
                    "checkpoint %s is damaged (%s); moved it to %s, trying an older one", step, "; ".join(found), moved
                )
            _barrier()
        if steps and self.env.is_main:
            point_latest(self.root, None)
            log.warning("no intact checkpoint is left in %s: training starts from scratch", self.root)
        return None

    def load_weights(self) -> Path | None:
        """Load the model and optimizer of the newest checkpoint under the root (a collective; early
        stopping's best step), or nothing when there is none; a damaged one is refused, naming its files."""
        for step, found in checked_steps(self.root, self.env.rank, self.env.world_size):
            if found:
                raise CheckpointError(f"checkpoint {step} is damaged: {'; '.join(found)}")
            with named_collective(f"loading checkpoint {step}"):
                load_weights(step, self.model, self.optimizer)
            if self.env.is_main:
                log.info("loaded the weights of %s", step)
            return step
        return None

    def save(self, state: TrainState) -> Path:
        """Checkpoint ``state`` (a collective: every rank calls it); saving changes nothing in training."""
        rank, tmp = self.env.rank, self.root / f".tmp-step-{state.iteration}"
        parts = {TRAIN_STATE: Position(state, self.env.world_size), **self.parts}
        states: dict[str, Stateful] = {"model": self.model, "optimizer": self.optimizer}
        states.update({name: Part(part, rank) for name, part in parts.items()})
        with named_collective(f"saving checkpoint step-{state.iteration} (DCP and its barriers)"):
            if self.env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # an interrupted save's: never published
                tmp.mkdir(parents=True)
            _barrier()
            write_step(tmp, states)  # returns once DCP's coordinator has written .metadata
            final = publish(self.root, tmp, state.iteration, self.keep) if self.env.is_main else None
            return self.root / _all_ranks(final.name if final else None)[0]  # every rank waits for it
