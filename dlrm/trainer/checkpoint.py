"""Crash-safe sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout under ``<dir>``: ``step-<N>/`` holds the DCP shards of the model and optimizer (each rank
writes its own), ``train_state.json`` (iteration, data position, world size, the state every rank
shares, and the size and crc32 of every file of the step) and ``state-rank<r>.pt`` (each rank's
own state: its RNG streams, codec and cache state; plain tensors and primitives only, loaded with
``weights_only=True``, so a crafted file cannot run code); ``latest`` names the newest complete
step. :class:`Checkpointer` is what the trainer uses: ``resume(...)`` at the start, ``save(state)``
at intervals and the end; everything beside the model and optimizer reaches it as one dict of named
:class:`Stateful` objects. A save is written to ``.tmp-step-<N>/`` and
renamed into place only once every rank has finished, so a crash during a save leaves the previous
checkpoint untouched and usable. A step whose files no longer match their checksums (truncated,
corrupted, missing) is found before loading, by all ranks together so that they agree on it:
``resume=auto`` moves it aside to ``damaged-step-<N>/`` (never deleted) and takes the previous one.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torchrec.optim.keyed import CombinedOptimizer

from dlrm.process.env import DistEnv
from dlrm.process.timeout import named_collective
from dlrm.trainer.loop import TrainState
from dlrm.trainer.state import CheckpointError, PerRank, RngState

LATEST = "latest"
CHECKSUMS = "checksums"  # the train_state.json key: file name -> [size, crc32]
RESUME_MODES = ("auto", True, False)
_BOOKKEEPING = {"world_size", CHECKSUMS}  # train_state.json keys beside the position and the parts
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


def checked_steps(root: Path, rank: int = 0, world_size: int = 1) -> Iterator[tuple[Path, list[str]]]:
    """Each complete checkpoint under ``root``, newest first, with what is wrong with it (empty:
    intact) as all ranks together found it (a collective per step when there are several ranks)."""
    for step in complete_steps(root):
        with named_collective(f"checking checkpoint {step}"):
            found = [p for share in _all_ranks(damage(step, rank, world_size)) for p in share]
        yield step, found


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
    ``rank_state`` is this rank's own state (tensors and primitives), kept in ``state-rank<r>.pt``."""
    step = int(train_state["iteration"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=str(tmp))
    torch.save(dict(rank_state or {}), tmp / rank_file(rank))
    _barrier()  # every rank's shard and state files are on disk
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


def rank_file(rank: int) -> str:
    return f"state-rank{rank}.pt"


def load_rank_state(step_dir: Path, rank: int, device: Any = "cpu") -> dict[str, Any]:
    """This rank's own state from ``step_dir`` (empty if it saved none), loaded with
    ``weights_only=True``: a file holding anything but tensors and primitives is refused, unrun."""
    path = step_dir / rank_file(rank)
    if not path.exists():
        return {}
    try:
        return torch.load(path, weights_only=True, map_location=device)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise CheckpointError(
            f"{path} holds more than tensors and primitives (or is not a torch file), refused unloaded: "
            f"{str(e).splitlines()[0]}. Move {step_dir} aside to resume from an older checkpoint, or start "
            "over (resume=false)"
        ) from None


def read_train_state(step_dir: Path, world_size: int) -> dict[str, Any]:
    """``step_dir``'s train_state.json, refused if another world size wrote it."""
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
    return train_state


def load_model(step_dir: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Restore the model and optimizer from ``step_dir``'s DCP shards (a collective)."""
    _init_state(optimizer)  # materialize lazily created optimizer state so DCP can load into it
    # The dummy step leaves zero gradients; a run from the start has none (a dense zero gradient
    # turns the hot rows' next sparse one dense, summed in another order).
    optimizer.zero_grad(set_to_none=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=str(step_dir))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _init_state(optimizer: Any) -> None:
    """``init_state`` of each optimizer a :class:`CombinedOptimizer` combines (its own would run one
    dummy step of all of them, bypassing an optimizer's own ``init_state``: the hot rows' counts its
    steps, which a resumed run must not see one more of)."""
    if isinstance(optimizer, CombinedOptimizer):
        for _, opt in optimizer.optimizers:
            _init_state(opt)
    else:
        optimizer.init_state()


class Checkpointer:
    """Saves and restores one run: the model and optimizer (DCP shards), and ``parts``, the named
    :class:`Stateful` objects of its components (this rank's random streams added as ``rng``). A
    part's ``load_state_dict`` may refuse a checkpoint the run cannot continue by raising
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
        if "rng" in parts:
            raise ValueError("a checkpoint part named 'rng' would replace this rank's random streams")
        self.parts: dict[str, Stateful] = {"rng": RngState(), **parts}

    def resume(self, mode: Any) -> TrainState:
        """The state to start from: a fresh one, or the newest checkpoint's (``resume`` = auto: if
        there is one; true: there must be one; false: never)."""
        if mode not in RESUME_MODES:
            raise ValueError(f"config key 'resume' must be auto, true or false (got {mode!r})")
        last = self._newest_intact(mode) if mode else None
        if last is None:
            return TrainState()
        saved = read_train_state(last, self.env.world_size)
        mine = load_rank_state(last, self.env.rank, self.env.device)
        unknown = sorted((set(saved) - set(TrainState().position()) - _BOOKKEEPING | set(mine)) - set(self.parts))
        if unknown:
            raise CheckpointError(
                f"checkpoint {last} holds state of {unknown}, which this run does not have (it would be dropped): "
                "resume with the configuration the checkpoint was written with, or start a new run (resume=false)"
            )
        for name, part in self.parts.items():  # before any tensor is read: a part may refuse the checkpoint
            try:
                part.load_state_dict((mine if isinstance(part, PerRank) else saved).get(name, {}))
            except (CheckpointError, ValueError) as e:  # compression/'s row cache refuses with ValueError
                raise CheckpointError(f"checkpoint {last}: {name}: {e}") from None
        with named_collective(f"loading checkpoint {last}"):
            load_model(last, self.model, self.optimizer)
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
        for n, (step, found) in enumerate(checked_steps(self.root, self.env.rank, self.env.world_size)):
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

    def load_weights(self) -> Path | None:
        """Load the model and optimizer of the newest checkpoint under the root (a collective; early
        stopping's best step), or nothing when there is none; a damaged one is refused, naming its files."""
        for step, found in checked_steps(self.root, self.env.rank, self.env.world_size):
            if found:
                raise CheckpointError(f"checkpoint {step} is damaged: {'; '.join(found)}")
            with named_collective(f"loading checkpoint {step}"):
                load_model(step, self.model, self.optimizer)
            if self.env.is_main:
                log.info("loaded the weights of %s", step)
            return step
        return None

    def save(self, state: TrainState) -> Path:
        """Checkpoint ``state`` (a collective: every rank calls it); saving changes nothing in training."""
        shared = {name: p.state_dict() for name, p in self.parts.items() if not isinstance(p, PerRank)}
        mine = {name: p.state_dict() for name, p in self.parts.items() if isinstance(p, PerRank)}
        train_state = {**state.position(), "world_size": self.env.world_size, **shared}
        with named_collective(f"saving checkpoint step-{state.iteration} (DCP and its barriers)"):
            return save(self.root, self.model, self.optimizer, train_state, self.env.rank, self.keep, mine)
