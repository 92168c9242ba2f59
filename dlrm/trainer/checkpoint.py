"""Crash-safe sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout under ``<dir>``: ``step-<N>/`` holds the DCP shards of the model and optimizer (each rank
writes its own), ``train_state.json`` (iteration, data position, LR schedule, policy state, world
size, and the size and crc32 of every file of the step) and ``rng-rank<r>.pt``; ``latest`` names
the newest complete step. :class:`Checkpointer` is what the trainer uses: ``resume(...)`` at the
start, ``save(state)`` at intervals and the end. A save is written to ``.tmp-step-<N>/`` and
renamed into place only once every rank has finished, so a crash during a save leaves the previous
checkpoint untouched and usable. A step whose files no longer match their checksums (truncated,
corrupted, missing) is found before loading, by all ranks together so that they agree on it:
``resume=auto`` moves it aside to ``damaged-step-<N>/`` (never deleted) and takes the previous one.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dlrm.process.env import DistEnv
from dlrm.process.timeout import named_collective
from dlrm.trainer.loop import TrainState

LATEST = "latest"
CHECKSUMS = "checksums"  # the train_state.json key: file name -> [size, crc32]
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


def _all_ranks(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a collective when there is more than one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def complete_steps(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (those with a train_state.json), newest first."""
    complete = [p for p in root.glob("step-*") if (p / "train_state.json").exists()]
    return sorted(complete, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def file_digest(path: Path) -> list[int]:
    """[size, crc32] of a file, read in 8 MiB pieces."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    return [size, crc]


def damage(step_dir: Path, rank: int, world_size: int) -> list[str]:
    """What is wrong with ``step_dir``: this rank checks its share of the files (every world_size-th
    of the checksummed files, from its rank on) against the sizes and crc32s the save recorded."""
    try:
        train_state = json.loads((step_dir / "train_state.json").read_text())
    except (OSError, ValueError) as e:
        return [f"{step_dir / 'train_state.json'} is unreadable ({e})"]
    sums = train_state.get(CHECKSUMS, {})  # none in checkpoints written before checksums existed
    found = []
    for name in sorted(sums)[rank::world_size]:
        path = step_dir / name
        try:
            got = file_digest(path)
        except OSError as e:
            found.append(f"{path} is unreadable ({e.strerror})")
            continue
        if got != sums[name]:
            found.append(
                f"{path} has {got[0]} bytes with crc32 {got[1]:08x}, where the save wrote {sums[name][0]} bytes "
                f"with crc32 {sums[name][1]:08x}"
            )
    return found


def point_latest(root: Path, step_dir: Path | None) -> None:
    """Name ``step_dir`` in ``root/latest`` (atomically), or remove the pointer."""
    if step_dir is None:
        (root / LATEST).unlink(missing_ok=True)
        return
    pointer_tmp = root / f".{LATEST}.tmp"
    pointer_tmp.write_text(step_dir.name)
    pointer_tmp.replace(root / LATEST)


def set_aside(step_dir: Path) -> Path:
    """Rename a damaged checkpoint out of the way of resumes and the ``keep`` rotation (never deleted)."""
    target, n = step_dir.with_name(f"damaged-{step_dir.name}"), 1
    while target.exists():
        target, n = step_dir.with_name(f"damaged-{step_dir.name}.{n}"), n + 1
    step_dir.rename(target)
    return target


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
    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    world_size = int(train_state["world_size"])
    shares = _all_ranks({name: file_digest(tmp / name) for name in names[rank::world_size]})
    if rank == 0:
        train_state = {**train_state, CHECKSUMS: {k: v for share in shares for k, v in share.items()}}
        (tmp / "train_state.json").write_text(json.dumps(train_state, indent=2, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        point_latest(root, final)
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
    copy for all ranks), the dense-gradient hook (tensors, one per rank). A part of the first kind
    may also define ``check_resumable(saved, step_dir)``, called before any tensor is loaded, to
    refuse a checkpoint the run cannot continue (e.g. other replicated hot rows)."""

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
        on_checkpoint: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.root, self.env, self.model, self.optimizer, self.keep = root, env, model, optimizer, keep
        self.on_checkpoint = list(on_checkpoint)  # run on every rank at each save and at a resume
        self.parts = {name: part for name, part in parts.items() if part is not None}
        self.rank_parts = {name: part for name, part in (rank_parts or {}).items() if part is not None}

    def resume(self, mode: Any) -> TrainState:
        """The state to start from: a fresh one, or the newest checkpoint's (``resume`` = auto: if
        there is one; true: there must be one; false: never)."""
        if mode not in RESUME_MODES:
            raise ValueError(f"config key 'resume' must be auto, true or false (got {mode!r})")
        last = self._newest_intact(mode) if mode else None
        if last is None:
            return TrainState()
        saved_parts = json.loads((last / "train_state.json").read_text())
        for name, part in self.parts.items():  # before any tensor is read: a part may refuse the checkpoint
            check = getattr(part, "check_resumable", None)
            if check is not None:
                check(saved_parts.get(name), last)
        with named_collective(f"loading checkpoint {last}"):
            saved, mine = load(last, self.model, self.optimizer, self.env.rank, self.env.world_size, self.env.device)
        for name, part in self.parts.items():
            part.load_state_dict(saved.get(name, {}))
        for name, part in self.rank_parts.items():
            part.load_state_dict(mine.get(name, {}))
        for hook in self.on_checkpoint:
            hook()
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

    def _newest_intact(self, mode: Any) -> Path | None:
        """The newest checkpoint whose files all match their checksums, as all ranks agree: with
        resume=true the newest must be intact; with auto a damaged one is set aside (warned)."""
        steps = complete_steps(self.root)
        if mode is True and not steps:
            raise FileNotFoundError(f"resume=true but {self.root} holds no complete checkpoint")
        for n, step in enumerate(steps):
            with named_collective(f"checking checkpoint {step}"):
                found = [p for share in _all_ranks(damage(step, self.env.rank, self.env.world_size)) for p in share]
            if not found:
                if n and self.env.is_main:
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

    def save(self, state: TrainState) -> Path:
        """Checkpoint ``state`` (a collective: every rank calls it)."""
        for hook in self.on_checkpoint:
            hook()
        train_state = {
            **state.position(),
            "world_size": self.env.world_size,
            **{name: part.state_dict() for name, part in self.parts.items()},
        }
        rank_state = {name: part.state_dict() for name, part in self.rank_parts.items()}
        with named_collective(f"saving checkpoint step-{state.iteration} (DCP and its barriers)"):
            return save(self.root, self.model, self.optimizer, train_state, self.env.rank, self.keep, rank_state)
