"""One checkpoint mechanism: every piece of a run's state in one DCP save, keyed by rank where it is
a rank's own, checked before it is read, published so that ``latest`` never names a missing step;
format 1 (train_state.json beside state-rank<r>.pt) still read. On 2 real gloo ranks with a small
model (tests/multiprocess.py); the trainer's own resumes are tests/trainer/test_train.py's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from multiprocess import SharedJob, run_ranks
from run_artifacts import RunsCode
from torch.distributed.checkpoint import FileSystemReader
from torchrec.optim.keyed import KeyedOptimizerWrapper

from dlrm.process.env import DistEnv
from dlrm.trainer import checkpoint
from dlrm.trainer.checkpoint import Checkpointer, checked_steps, publish
from dlrm.trainer.checkpoint_format import SEAL, complete_steps, damage, read_state
from dlrm.trainer.loop import TrainState
from dlrm.trainer.state import CheckpointError, PerRank

WORLD = 2


class Shared:
    """A part every rank holds alike: plain data of every kind a state_dict holds."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = dict(state)


class Mine(Shared, PerRank):
    """A rank's own part (tensors that differ per rank, int keys, empty containers)."""


def _shared_state() -> dict[str, Any]:
    return {"nested": {"a": [1, 2.5, None, "x"], "empty": {}, "pair": (1, 2)}, "n": 7, "gains": {"t0": 1.25}}


def _rank_state(rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(rank)
    return {"rows": torch.randn(5, 3, generator=gen), 3: [torch.tensor([rank]), {}], "empty": [], "f": rank / 3}


def _objects(rank: int, trained: bool) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """A model, its optimizer and two parts: as trained (the values a save keeps) or fresh."""
    torch.manual_seed(0 if trained else 1)
    model = torch.nn.Linear(4, 3)
    optimizer = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    if trained:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    parts = {
        "schedule": Shared(_shared_state() if trained else {}),
        "mine": Mine(_rank_state(rank) if trained else {}),
    }
    return model, optimizer, parts


def _env(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank, world_size, rank, world_size, torch.device("cpu"), "gloo")


def _everything(model: torch.nn.Module, optimizer: Any, parts: Mapping[str, Any], state: TrainState) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "parts": {name: p.state_dict() for name, p in parts.items()},
        "position": state.position(),
        "rng": torch.get_rng_state(),
    }


def _save(rank: int, world_size: int, root: str, iterations: list[int], keep: int) -> dict:
    """Save the trained objects at each of ``iterations`` (random draws between saves)."""
    model, optimizer, parts = _objects(rank, trained=True)
    ckpt = Checkpointer(Path(root), _env(rank, world_size), model, optimizer, parts, keep=keep)
    state = TrainState(epoch=1)
    for it in iterations:
        torch.manual_seed(100 * rank + it)
        state.iteration = state.batch_in_epoch = it
        published = ckpt.save(state)
    return {"published": published.name, **_everything(model, optimizer, ckpt.parts, state)}


def _resume(rank: int, world_size: int, root: str, mode: Any) -> dict:
    model, optimizer, parts = _objects(rank, trained=False)
    ckpt = Checkpointer(Path(root), _env(rank, world_size), model, optimizer, parts)
    state = ckpt.resume(mode)
    return _everything(model, optimizer, ckpt.parts, state)


def _same(a: Any, b: Any) -> bool:
    """Equal values and types all the way down (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Any]:
    """A 2-rank run's checkpoints at iterations 4 and 8 (keep 3), and what each rank saved at 8."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    return {"root": root, "ranks": run_ranks(_save, WORLD, str(root), [4, 8], 3, timeout=240)}


def _copy(saved: dict[str, Any], tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved["root"], root)
    return root


@pytest.fixture(scope="module")
def on_copies(saved, tmp_path_factory) -> Callable[[str], tuple[Path, list[dict]]]:
    """name -> (root, each rank's result) of three tests' 2-rank runs on their own copies of the saved
    checkpoints, in one job (starting the ranks costs more than the runs): a resume=true, a
    resume=auto with rank 1's file of step-8 deleted, and a second save at 8."""
    roots = {name: _copy(saved, tmp_path_factory.mktemp(name)) for name in ("resume", "auto", "again")}
    (roots["auto"] / "step-8" / "__1_0.distcp").unlink()
    cases = {"resume": (_resume, True), "auto": (_resume, "auto"), "again": (_save, [8, 8], 3)}
    job = SharedJob({WORLD: {name: (fn, str(roots[name]), *args) for name, (fn, *args) in cases.items()}}, 120)
    return lambda name: (roots[name], job[name])


def test_one_dcp_save_holds_every_part_keyed_by_rank_where_it_is_a_ranks_own(saved):
    step = saved["root"] / "step-8"
    assert sorted(p.name for p in saved["root"].iterdir()) == ["latest", "step-4", "step-8"]
    assert (saved["root"] / "latest").read_text() == "step-8" and saved["ranks"][0]["published"] == "step-8"
    # DCP's files and nothing else: no train_state.json, no per-rank torch.save, no manifest
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    md = FileSystemReader(str(step)).read_metadata()
    parts = {k for k in md.state_dict_metadata if not k.startswith(("model.", "optimizer."))}
    assert parts == {
        "train_state.shared",
        "schedule.shared",
        *(f"{name}.rank{r}" for name in ("mine", "rng") for r in range(WORLD)),
    }
    seals = {i.fqn: v for i, v in md.storage_data.items() if i.fqn.startswith(SEAL)}
    assert sorted(seals) == [f"{SEAL}__0_0.distcp", f"{SEAL}__1_0.distcp"]
    assert all(v[0] == (step / k.removeprefix(SEAL)).stat().st_size for k, v in seals.items())


def test_a_resume_restores_every_part_of_every_rank_exactly(saved, on_copies):
    _, resumed = on_copies("resume")
    for rank in range(WORLD):
        want, got = saved["ranks"][rank], resumed[rank]
        assert got["position"] == {"iteration": 8, "epoch": 1, "batch_in_epoch": 8}
        for key in ("model", "optimizer", "parts", "rng"):  # rng: the draws after a resume are the saved run's
            assert _same(got[key], want[key]), (rank, key)
    assert not _same(saved["ranks"][0]["parts"]["mine"], saved["ranks"][1]["parts"]["mine"])


def test_read_state_gives_a_ranks_own_parts_and_the_shared_ones(saved):
    for rank in range(WORLD):
        got = read_state(saved["root"] / "step-8", rank)
        assert got.train_state == {"iteration": 8, "epoch": 1, "batch_in_epoch": 8, "world_size": 2, "format": 2}
        assert sorted(got.parts) == ["mine", "rng", "schedule"]
        assert _same(got.parts["mine"], _rank_state(rank)) and _same(got.parts["schedule"], _shared_state())


def test_dcp_alone_loads_a_flipped_byte_silently_and_the_recorded_crc32_finds_it(saved, tmp_path):
    step = _copy(saved, tmp_path) / "step-8"
    md = FileSystemReader(str(step)).read_metadata()
    info = next(v for i, v in md.storage_data.items() if i.fqn == "model.weight")
    path = step / info.relative_path
    data = bytearray(path.read_bytes())
    raw = saved["ranks"][0]["model"]["weight"].numpy().tobytes()
    at = data.index(raw, info.offset, info.offset + info.length)  # the tensor's own bytes in DCP's item
    data[at + 5] ^= 0x40
    path.write_bytes(bytes(data))
    weight = torch.zeros(3, 4)
    dcp.load({"model.weight": weight}, checkpoint_id=str(step), no_dist=True)
    assert not torch.equal(weight, saved["ranks"][0]["model"]["weight"])  # no error: DCP keeps no checksum
    found = [f for r in range(WORLD) for f in damage(step, r, WORLD)]
    assert len(found) == 1 and found[0].startswith(f"{path} has {len(data)} bytes with crc32 "), found


@pytest.mark.parametrize("how", ["flip", "truncate", "delete rank 1's file", "truncate .metadata"])
def test_a_damaged_step_is_found_by_the_ranks_together_naming_the_file(saved, tmp_path, how):
    step = _copy(saved, tmp_path) / "step-8"
    victim = step / {"delete rank 1's file": "__1_0.distcp", "truncate .metadata": ".metadata"}.get(how, "__0_0.distcp")
    data = victim.read_bytes()
    if how == "flip":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how.startswith("delete"):
        victim.unlink()
    else:
        victim.write_bytes(data[: len(data) // 2])
    shares = [damage(step, r, WORLD) for r in range(WORLD)]
    found = list(dict.fromkeys(f for share in shares for f in share))
    assert len(found) == 1, found
    expected = {
        "flip": f"{victim} has {len(data)} bytes with crc32",
        "truncate": f"{victim} has {len(data) // 2} bytes with crc32",
        "delete rank 1's file": f"{victim} is unreadable (No such file or directory)",
        "truncate .metadata": f"{victim} is unreadable (",
    }[how]
    assert found[0].startswith(expected), found
    # a data file is one rank's share (the other finds nothing); .metadata is everyone's
    assert sum(bool(s) for s in shares) == (WORLD if how == "truncate .metadata" else 1)
    # resume=true refuses it naming the file; resume=auto sets it aside and takes step-4
    with pytest.raises(CheckpointError, match=r"resume=true but the newest checkpoint .*step-8 is damaged: "):
        _resume(0, 1, str(step.parent), True)
    for step_dir, f in checked_steps(step.parent):
        assert f == ([] if step_dir.name == "step-4" else found)


def test_resume_auto_sets_a_damaged_step_aside_and_takes_the_previous(on_copies):
    root, resumed = on_copies("auto")  # step-8 without rank 1's file
    assert all(r["position"]["iteration"] == 4 for r in resumed)
    assert sorted(p.name for p in root.iterdir()) == ["damaged-step-8", "latest", "step-4"]
    assert (root / "latest").read_text() == "step-4"


@pytest.mark.parametrize("where", ["an item", "a part's state"])
def test_a_crafted_pickle_is_refused_naming_the_file_and_never_run(saved, tmp_path, where):
    step, marker = tmp_path / "step-8", tmp_path / "ran"
    # rewritten as one whose author could also rewrite the checksums: the trainer's own writer
    everything = {k: v for k, v in _load_all(saved["root"] / "step-8").items()}
    bad = RunsCode(marker)
    if where == "a part's state":
        import io

        buf = io.BytesIO()
        torch.save(bad, buf)
        bad = buf.getvalue()
    everything["mine.rank1"] = bad
    from dlrm.trainer.checkpoint_format import write_step

    write_step(step, everything)
    assert damage(step) == []
    with pytest.raises(CheckpointError) as refused:
        read_state(step, 1)
    assert str(refused.value).startswith(f"{step / '__0_0.distcp'} (mine.rank1) holds more than tensors and primitives")
    assert not marker.exists()
    read_state(step, 0)  # rank 0's parts are intact


def _load_all(step: Path) -> dict[str, Any]:
    """Every item of a step, flat, as a single process reads it (whole tensors; parts as saved bytes)."""
    md = FileSystemReader(str(step)).read_metadata()
    out: dict[str, Any] = {}
    for k, m in md.state_dict_metadata.items():
        out[k] = torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
    dcp.load(out, checkpoint_id=str(step), no_dist=True)
    return out


def test_a_checkpoint_of_an_unknown_format_is_refused_naming_the_file_and_format(saved, tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    monkeypatch.setattr(checkpoint, "FORMAT", 3)  # what a later version would write
    model, optimizer, parts = _objects(0, trained=True)
    Checkpointer(root, _env(0, 1), model, optimizer, parts).save(TrainState(iteration=2))
    monkeypatch.undo()
    with pytest.raises(CheckpointError) as refused:
        _resume(0, 1, str(root), "auto")
    assert str(refused.value).startswith(f"{root / 'step-2' / '.metadata'} holds a checkpoint of format 3; ")
    assert "reads format 2 (one DCP save) and format 1 (train_state.json beside state-rank<r>.pt)" in str(refused.value)


# -- format 1 ------------------------------------------------------------------------------------


def _save_v1(rank: int, world_size: int, root: str) -> dict:
    """Format 1 as the trainer of 44430a6 wrote it (its save, tests/checkpoint_v1.py) from the trained objects."""
    import checkpoint_v1

    from dlrm.trainer.state import RngState

    model, optimizer, parts = _objects(rank, trained=True)
    state = TrainState(iteration=6, epoch=1, batch_in_epoch=2)
    own = {"rng": RngState(), **parts}
    shared = {n: p.state_dict() for n, p in own.items() if not isinstance(p, PerRank)}
    mine = {n: p.state_dict() for n, p in own.items() if isinstance(p, PerRank)}
    train_state = {**state.position(), "world_size": world_size, **json.loads(json.dumps(shared))}
    checkpoint_v1.save(Path(root), model, optimizer, train_state, rank, mine)
    return _everything(model, optimizer, own, state)


def test_a_format_1_checkpoint_is_read_and_resumes_exactly(tmp_path):
    root = tmp_path / "checkpoints"
    want = run_ranks(_save_v1, WORLD, str(root), timeout=240)
    assert sorted(p.name for p in (root / "step-6").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "state-rank0.pt",
        "state-rank1.pt",
        "train_state.json",
    ]
    assert [damage(root / "step-6", r, WORLD) for r in range(WORLD)] == [[], []]
    got = run_ranks(_resume, WORLD, str(root), True, timeout=240)
    for rank in range(WORLD):
        assert got[rank]["position"] == {"iteration": 6, "epoch": 1, "batch_in_epoch": 2}
        for key in ("model", "optimizer", "rng"):
            assert _same(got[rank][key], want[rank][key]), (rank, key)
        # JSON kept the shared parts: a tuple came back a list, as format 1 always gave it
        assert got[rank]["parts"]["schedule"] == json.loads(json.dumps(_shared_state()))
        assert _same(got[rank]["parts"]["mine"], _rank_state(rank))
    # its own crc32 manifest still guards it: a damaged format-1 file is named
    victim = root / "step-6" / "state-rank1.pt"
    victim.write_bytes(victim.read_bytes()[:-1])
    found = [f for r in range(WORLD) for f in damage(root / "step-6", r, WORLD)]
    assert len(found) == 1 and found[0].startswith(f"{victim} has "), found
    # and its next save is format 2, beside it
    run_ranks(_save, WORLD, str(root), [7], 3, timeout=240)
    assert [p.name for p in complete_steps(root)] == ["step-7", "step-6"]
    assert not (root / "step-7" / "train_state.json").exists()


def test_a_crafted_format_1_rank_file_is_refused_naming_it(tmp_path):
    step, marker = tmp_path / "step-2", tmp_path / "ran"
    step.mkdir()
    (step / "train_state.json").write_text(
        json.dumps({"iteration": 2, "epoch": 0, "batch_in_epoch": 2, "world_size": 1})
    )
    torch.save({"dense_comm": RunsCode(marker)}, step / "state-rank0.pt")
    with pytest.raises(CheckpointError, match=f"^{step / 'state-rank0.pt'} holds more than tensors and primitives"):
        read_state(step, 0)
    assert not marker.exists()


# -- publishing ----------------------------------------------------------------------------------


class _Crash(Exception):
    pass


def _complete(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_text(content)
    return path


def _crash_at(n: int, monkeypatch) -> list[str]:
    """Make the ``n``-th file-system change of publishing raise; returns the log of those done."""
    done: list[str] = []

    def counted(name: str, real: Any) -> Any:
        def change(*args: Any, **kwargs: Any) -> Any:
            if len(done) == n:
                raise _Crash(f"{name} {args}")
            done.append(f"{name} {[str(a) for a in args]}")
            return real(*args, **kwargs)

        return change

    monkeypatch.setattr(Path, "rename", counted("rename", Path.rename))
    monkeypatch.setattr(Path, "replace", counted("replace", Path.replace))
    monkeypatch.setattr(shutil, "rmtree", counted("rmtree", shutil.rmtree))
    return done


def test_a_crash_at_any_point_of_a_repeated_save_leaves_latest_naming_a_complete_step(tmp_path, monkeypatch):
    """The final save repeating a periodic one (step-8 exists): whatever publishing had done when it
    stopped, ``latest`` names a complete checkpoint and the newest complete one is the old or the new
    step-8; finished, only the new one is left."""
    steps = 0
    for n in range(20):
        root = tmp_path / str(n)
        _complete(root / "step-4", "old 4")
        _complete(root / "step-8", "old 8")
        (root / "latest").write_text("step-8")
        tmp = _complete(root / ".tmp-step-8", "new 8")
        done = _crash_at(n, monkeypatch)
        try:
            final = publish(root, tmp, 8, keep=2)
        except _Crash:
            final = None
        monkeypatch.undo()
        latest = root / (root / "latest").read_text()
        assert (latest / ".metadata").exists(), (n, done)
        newest = complete_steps(root)[0]
        assert (newest / ".metadata").read_text() in ("old 8", "new 8"), (n, done)
        assert [p for p in complete_steps(root) if p.name.startswith("step-4")], (n, done)  # keep=2: kept
        if final is not None:
            steps = n
            assert sorted(p.name for p in root.iterdir()) == ["latest", "step-4", "step-8.1"]
            assert (latest / ".metadata").read_text() == "new 8" and latest == final
            break
    assert steps > 3  # it did get through every change


def test_a_repeated_save_of_a_step_replaces_it_under_a_new_name(on_copies):
    root, got = on_copies("again")  # saved at 8 twice more
    assert got[0]["published"] == got[1]["published"] == "step-8.2"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-4", "step-8.2"]
    assert (root / "latest").read_text() == "step-8.2"
    assert read_state(root / "step-8.2", 0).train_state["iteration"] == 8
