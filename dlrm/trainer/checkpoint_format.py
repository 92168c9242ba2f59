"""One checkpoint step on disk: a single torch.distributed.checkpoint (DCP) save, how it is written,
checked and read back.

A step directory is what DCP writes: ``.metadata`` and one ``__<r>_0.distcp`` per rank. It holds,
by name, the model and optimizer (each rank writes its shards; DCP reshards them on load) and one
item per checkpoint part: ``<part>.shared`` for a part that every rank holds alike (written once:
``train_state``, the lr schedule, early stopping, policies, the strategy) and ``<part>.rank<r>``
for a rank's own (:class:`~dlrm.trainer.state.PerRank`: random streams, codec and row-cache state,
the dense hook's state, hot rows). A part's item is its ``state_dict()`` as ``torch.save`` writes
it, so any nesting of tensors, numbers, strings, lists and dicts comes back exactly; every item
(the optimizer's too) is read with ``weights_only=True``, so a crafted item is refused, unrun.

DCP records each item's file, offset and length but no checksum, so a flipped byte would load
silently: each rank also returns the size and crc32 of the file it wrote with its write results,
and DCP's coordinator writes them into ``.metadata`` with the rest (last, once every rank has
written). :func:`damage` checks a rank's share of the files against them before anything is read.

Checkpoints of format 1 (``train_state.json`` with a crc32 manifest beside ``state-rank<r>.pt``
and DCP shards of the model and optimizer) are still read, never written.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torchrec.optim.keyed import CombinedOptimizer

from dlrm.trainer.state import CheckpointError, PerRank

FORMAT = 2  # train_state's "format": what this version writes
TRAIN_STATE = "train_state"  # the part holding the iteration, data position, world size and format
WEIGHTS = ("model", "optimizer")  # DCP's own state dicts (sharded tensors), not parts
SHARED = "shared"  # the key of a part every rank holds alike; a rank's own: rank<r>
SEAL = "file-digest:"  # .metadata's storage_data key prefix of a data file's [size, crc32]
METADATA = ".metadata"
V1_STATE = "train_state.json"  # format 1
_STEP = re.compile(r"step-(\d+)(?:\.(\d+))?")


def step_order(path: Path) -> tuple[int, int] | None:
    """(iteration, repeat) of a checkpoint's name: ``step-<N>`` is (N, 0), ``step-<N>.<k>`` a later save
    of the same iteration (k); None for any other name."""
    m = _STEP.fullmatch(path.name)
    return (int(m[1]), int(m[2] or 0)) if m else None


def complete_steps(root: Path) -> list[Path]:
    """The checkpoints under ``root``, newest first (format 1 ones too)."""
    steps = [p for p in root.glob("step-*") if step_order(p) and ((p / V1_STATE).exists() or (p / METADATA).exists())]
    return sorted(steps, key=lambda p: step_order(p) or (0, 0), reverse=True)


def file_digest(path: Path) -> list[int]:
    """[size, crc32] of a file, read in 8 MiB pieces."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    return [size, crc]


# -- writing -------------------------------------------------------------------------------------


class Part:
    """A checkpoint part as DCP holds it: ``part.state_dict()`` as one item, under ``shared`` or, for a
    :class:`PerRank` part, this rank's key (a Stateful itself, so that DCP's save asks it)."""

    def __init__(self, part: Stateful, rank: int) -> None:
        self.part, self.key = part, f"rank{rank}" if isinstance(part, PerRank) else SHARED

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.part.state_dict(), buf)
        return {self.key: buf.getvalue()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(unpickle(io.BytesIO(state[self.key]), self.key))


class SealingWriter(FileSystemWriter):
    """DCP's file writer; each rank adds the size and crc32 of the files it wrote to its write
    results, which DCP's coordinator writes into ``.metadata`` (keys ``file-digest:<file>``)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner).value()
        files = sorted({r.storage_data.relative_path for r in written})
        seals = [WriteResult(MetadataIndex(SEAL + f), 0, file_digest(Path(self.path) / f)) for f in files]
        done: Future[list[WriteResult]] = Future()
        done.set_result([*written, *seals])
        return done


def write_step(directory: Path, states: dict[str, Stateful]) -> None:
    """One DCP save of ``states`` into ``directory`` (a collective when there is a process group)."""
    dcp.save(states, storage_writer=SealingWriter(str(directory)))


# -- checking ------------------------------------------------------------------------------------


def read_metadata(step: Path) -> Metadata:
    try:
        return FileSystemReader(str(step)).read_metadata()
    except Exception as e:  # missing, truncated, not a pickle: the step cannot be read at all
        raise CheckpointError(f"{step / METADATA} is unreadable ({type(e).__name__}: {e})") from None


def damage(step: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with ``step``: this rank checks its share of the data files (every world_size-th,
    from its rank on) against the sizes and crc32s the save recorded."""
    if (step / V1_STATE).exists():
        return _damage_v1(step, rank, world_size)
    try:
        md = read_metadata(step)
    except CheckpointError as e:
        return [str(e)]
    seals = {i.fqn.removeprefix(SEAL): v for i, v in md.storage_data.items() if i.fqn.startswith(SEAL)}
    files: set[str] = {v.relative_path for v in md.storage_data.values() if hasattr(v, "relative_path")}
    found = [f"{step / METADATA} records no size and crc32 of {f}" for f in sorted(files - set(seals))]
    return found + _mismatches(step, {f: seals[f] for f in sorted(seals)[rank::world_size]})


def _mismatches(step: Path, sums: dict[str, list[int]]) -> list[str]:
    found = []
    for name, want in sums.items():
        path = step / name
        try:
            got = file_digest(path)
        except OSError as e:
            found.append(f"{path} is unreadable ({e.strerror})")
            continue
        if got != list(want):
            found.append(
                f"{path} has {got[0]} bytes with crc32 {got[1]:08x}, where the save wrote {want[0]} bytes "
                f"with crc32 {want[1]:08x}"
            )
    return found


# -- reading -------------------------------------------------------------------------------------


@dataclass
class Saved:
    """What a step holds for one rank beside the model and optimizer: ``train_state`` (iteration,
    epoch, batch_in_epoch, world_size, format) and ``parts``, by name: those every rank shares and
    this rank's own."""

    step: Path
    train_state: dict[str, Any]
    parts: dict[str, Any]


def unpickle(value: io.BytesIO, where: Any, device: Any = None) -> Any:
    """``torch.load(weights_only=True)``: anything but tensors and primitives is refused, unrun."""
    try:
        return torch.load(value, weights_only=True, map_location=device)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"{where} holds more than tensors and primitives (or is damaged), refused unloaded: "
            f"{str(e).strip().splitlines()[0]}. Move the checkpoint aside to resume from an older one, or start "
            "over (resume=false)"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item is read with ``weights_only=True`` (DCP's
    own reads it with ``weights_only=False``, which would run a crafted pickle), refused naming its
    file and key."""

    def __init__(self, step: Path, device: Any = None) -> None:
        super().__init__()
        self.step, self.device = step, device

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        assert self.metadata is not None
        fqn = read_item.dest_index.fqn
        where = f"{self.step / self.metadata.storage_data[read_item.storage_index].relative_path} ({fqn})"
        *parents, last = self.mappings[fqn]
        node: Any = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = unpickle(value, where, self.device)


def _load(states: dict[str, Any], step: Path, device: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` through :class:`SafeLoadPlanner`; our refusal, raised on any rank, is raised as itself."""
    try:
        with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a single process", as it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            planner = SafeLoadPlanner(step, device)
            dcp.load(states, storage_reader=FileSystemReader(str(step)), planner=planner, no_dist=no_dist)
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                raise exc from None
        raise


def read_state(step: Path, rank: int, device: Any = "cpu") -> Saved:
    """``train_state`` and the parts of rank ``rank`` from ``step`` (no collective); a format this
    version does not know is refused, naming the file and the format."""
    if (step / V1_STATE).exists():
        return _read_v1(step, rank, device)
    md = read_metadata(step)
    keys = {SHARED, f"rank{rank}"}
    raw: dict[str, Any] = {
        fqn: None
        for fqn in md.state_dict_metadata
        if fqn.partition(".")[0] not in WEIGHTS and fqn.partition(".")[2] in keys
    }
    if f"{TRAIN_STATE}.{SHARED}" not in raw:
        raise CheckpointError(f"{step / METADATA}: a DCP checkpoint without {TRAIN_STATE}, not one dlrm-train wrote")
    _load(raw, step, device, no_dist=True)

    def where(fqn: str) -> str:
        return f"{step / md.storage_data[MetadataIndex(fqn)].relative_path} ({fqn})"

    train_state = unpickle(io.BytesIO(raw.pop(f"{TRAIN_STATE}.{SHARED}")), where(f"{TRAIN_STATE}.{SHARED}"))
    if train_state.get("format") != FORMAT:
        raise CheckpointError(
            f"{step / METADATA} holds a checkpoint of format {train_state.get('format')!r}; this version reads format "
            f"{FORMAT} (one DCP save) and format 1 ({V1_STATE} beside state-rank<r>.pt): resume with the version "
            "that wrote it, or start a new run (resume=false)"
        )
    parts = {fqn.partition(".")[0]: unpickle(io.BytesIO(blob), where(fqn), device) for fqn, blob in raw.items()}
    return Saved(step, train_state, parts)


def load_weights(step: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Restore the model and optimizer from ``step``'s DCP shards (a collective)."""
    _init_state(optimizer)  # materialize lazily created optimizer state so DCP can load into it
    # The dummy step leaves zero gradients; a run from the start has none (a dense zero gradient
    # turns the hot rows' next sparse one dense, summed in another order).
    optimizer.zero_grad(set_to_none=True)
    _load({"model": model, "optimizer": optimizer}, step)


def _init_state(optimizer: Any) -> None:
    """``init_state`` of each optimizer a :class:`CombinedOptimizer` combines (its own would run one
    dummy step of all of them, bypassing an optimizer's own ``init_state``: the hot rows' counts its
    steps, which a resumed run must not see one more of)."""
    if isinstance(optimizer, CombinedOptimizer):
        for _, opt in optimizer.optimizers:
            _init_state(opt)
    else:
        optimizer.init_state()


# -- format 1 (read only) --------------------------------------------------------------------------


def _damage_v1(step: Path, rank: int, world_size: int) -> list[str]:
    try:
        train_state = json.loads((step / V1_STATE).read_text())
    except (OSError, ValueError) as e:
        return [f"{step / V1_STATE} is unreadable ({e})"]
    sums = train_state.get("checksums", {})  # none in checkpoints written before checksums existed
    return _mismatches(step, {name: sums[name] for name in sorted(sums)[rank::world_size]})


def _read_v1(step: Path, rank: int, device: Any) -> Saved:
    """Format 1: the shared parts and the position in train_state.json, a rank's own in state-rank<r>.pt."""
    saved = json.loads((step / V1_STATE).read_text())
    position = ("iteration", "epoch", "batch_in_epoch", "world_size")
    train_state = {**{k: saved[k] for k in position}, "format": 1}
    parts = {k: v for k, v in saved.items() if k not in position and k != "checksums"}
    path = step / f"state-rank{rank}.pt"
    if path.exists():
        with open(path, "rb") as f:
            parts.update(unpickle(io.BytesIO(f.read()), path, device))
    return Saved(step, train_state, parts)
