"""Training under faults, with real torchrun ranks: a stalled peer, a lossy link, a damaged or crafted
checkpoint. (A rank killed outright: tests/trainer/test_train.py,
test_sigkilled_rank_restarts_from_the_last_checkpoint_and_finishes.)"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from run_artifacts import RunsCode, checkpoint_items, data_files, raw_losses
from trainer_runs import launch, losses, train, worker_pids

from dlrm.bench.netns import Namespace, NetnsError
from dlrm.process.timeout import ROLL_CALL_S, CollectiveTimeout, PeerLost, named_collective

NETEM = ("netem", "loss", "1%", "delay", "5ms")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_only_timeouts_are_renamed_and_the_innermost_name_wins():
    gloo = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
    inner, outer = named_collective("the inner all-to-all"), named_collective("the outer step")
    with pytest.raises(CollectiveTimeout) as timeout, outer, inner:
        raise RuntimeError(gloo)
    assert str(timeout.value) == f"the inner all-to-all timed out waiting for a peer ({gloo})"
    with pytest.raises(PeerLost) as lost, named_collective("the inner all-to-all"):
        raise RuntimeError("Connection reset by peer")  # a dead peer: named, but not a timeout
    assert str(lost.value) == "the inner all-to-all lost a peer (Connection reset by peer)"
    assert not isinstance(lost.value, CollectiveTimeout)
    with pytest.raises(RuntimeError) as other, named_collective("the inner all-to-all"):
        raise RuntimeError("CUDA error: out of memory")  # not the network's: passes through untouched
    assert type(other.value) is RuntimeError and str(other.value) == "CUDA error: out of memory"


@pytest.mark.timeout(180)
def test_a_stalled_rank_makes_the_others_fail_naming_the_collective_and_the_rank(tmp_path, cache):
    timeout_s, run_dir = 10, tmp_path / "run"
    output = tmp_path / "torchrun.log"
    overrides = [f"comm_timeout_s={timeout_s}", "loss_log=true", "max_iterations=100000"]
    agent = launch(run_dir, cache, overrides, output, nproc=3)
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while len(raw_losses(run_dir) if (run_dir / "losses.txt").exists() else []) < 3:
            assert time.monotonic() < deadline and agent.poll() is None, "training did not start in time"
            time.sleep(0.05)
        workers = worker_pids(agent.pid)
        assert sorted(workers) == [0, 1, 2], workers
        os.kill(workers[1], signal.SIGSTOP)  # rank 1 stops answering, its sockets stay open
        stopped = time.monotonic()
        while _running(workers[0]) and time.monotonic() < stopped + 120:
            time.sleep(0.05)
        waited = time.monotonic() - stopped
    finally:
        for pid in workers.values():  # nothing outlives the test, the stopped rank least of all
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        try:
            agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    stderr = output.read_text()
    # rank 0 gave up after comm_timeout_s (gloo's default would be 30 minutes) and its roll call
    assert timeout_s - 1 < waited < timeout_s + ROLL_CALL_S + 20, (waited, stderr[-3000:])
    assert agent.returncode != 0
    # (or, where rank 2 entered its wait first, its timeout closed the pair rank 0 was waiting on)
    timed_out = r"CollectiveTimeout: rank 0 of 3: (.*?) timed out after"
    lost = r"PeerLost: rank 0 of 3: (.*?) lost a peer's .*? within"
    message = rf"(?:{timed_out}|{lost}) comm_timeout_s=10 s; (.*?)\. gloo"
    found = re.search(message, stderr)
    assert found, stderr[-6000:]
    timed_out, lost, who = found.groups()
    collective = timed_out or lost
    # which one depends on where rank 1 stopped: each names its kind and the iteration
    assert re.search(r"all-to-all|all-reduce|all-gather", collective) and re.search(r"iteration \d+", collective)
    assert who.startswith("rank(s) [1] did not answer"), who  # rank 2 answered: it waited on rank 1 too
    assert not any(_running(pid) for pid in workers.values())


def _netem_unavailable() -> str | None:
    """Why a namespace with a netem loopback cannot be made here (None: it can)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs root and iproute2 (ip, tc) for a private network namespace"
    try:
        with Namespace(f"dlrm-netem-probe-{os.getpid()}") as ns:
            ns.run("tc", "qdisc", "replace", "dev", "lo", "root", *NETEM)
    except NetnsError as e:
        return f"no network namespace with tc netem here (kernel module sch_netem?): {e}"
    return None


@pytest.mark.timeout(240)
def test_training_over_a_lossy_slow_link_gives_the_losses_of_a_clean_one(tmp_path, cache):
    why = _netem_unavailable()
    if why:
        pytest.skip(why)
    common = ["loss_log=true", "max_iterations=15", "batch_size=32"]
    train(tmp_path / "clean", cache, common)
    with Namespace(f"dlrm-netem-{os.getpid()}") as ns:
        ns.run("ip", "link", "set", "lo", "mtu", "1500")  # packets of a real link's size, so that some drop
        ns.run("tc", "qdisc", "replace", "dev", "lo", "root", *NETEM)
        train(tmp_path / "lossy", cache, common, prefix=ns.argv())
        stats = ns.run("tc", "-s", "qdisc", "show", "dev", "lo").stdout
    sent, dropped = (int(x) for x in re.search(r"Sent \d+ bytes (\d+) pkt \(dropped (\d+)", stats).groups())
    assert dropped > 0, f"netem dropped nothing of {sent} packets: the link was not lossy\n{stats}"
    assert losses(tmp_path / "lossy") == losses(tmp_path / "clean")


SHARES = (("step-12", 0), ("step-9", 1), ("step-6", 1))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_damaged_checkpoints_are_refused_by_resume_true_and_skipped_by_auto(tmp_path, cache):
    run_dir = tmp_path / "run"
    common = ["loss_log=true", "checkpoint.every=3", "checkpoint.keep=4", "batch_size=32"]
    train(run_dir, cache, [*common, "max_iterations=12"])
    ckpts = run_dir / "checkpoints"
    first = dict(raw_losses(run_dir))
    # step-12 truncated in the file that rank 0 checks, step-9 with one bit flipped in the file that
    # rank 1 checks (rank r checks the r-th of the files .metadata records), step-6 without rank 1's
    # file: the rank whose share is intact must agree to skip the step all the same
    victims = {step: ckpts / step / data_files(ckpts / step)[share] for step, share in SHARES}
    truncated, flipped, deleted = victims["step-12"], victims["step-9"], victims["step-6"]
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    _flip_byte(flipped)
    damaged = {path: path.read_bytes() for path in (truncated, flipped)}
    deleted.rename(tmp_path / "deleted")

    proc = train(run_dir, cache, [*common, "max_iterations=16", "resume=true"], check=False)
    assert proc.returncode != 0
    assert f"resume=true but the newest checkpoint {ckpts / 'step-12'} is damaged: {truncated} has" in proc.stderr
    assert dict(raw_losses(run_dir)) == first  # nothing trained
    assert all(path.read_bytes() == data for path, data in damaged.items())  # nothing moved

    train(run_dir, cache, [*common, "max_iterations=16", "resume=auto"])
    log = (run_dir / "train_rank0.log").read_text()
    for step, path in victims.items():
        assert f"checkpoint {ckpts / step} is damaged ({path} " in log
        kept = ckpts / f"damaged-{step}" / path.name
        assert kept.read_bytes() == damaged[path] if path in damaged else not kept.exists()  # set aside
    assert f"checkpoint {ckpts / 'step-6'} is damaged ({deleted} is unreadable (No such file or directory))" in log
    assert f"resumed from {ckpts / 'step-3'} at iteration 3" in log
    logged = raw_losses(run_dir)
    assert [it for it, _ in logged] == [*range(1, 13), *range(4, 17)]  # 4-12 redone from step-3
    assert dict(logged[12:21]) == {i: first[i] for i in range(4, 13)}
    assert (ckpts / "latest").read_text() == "step-16"


def test_a_pickled_payload_in_a_checkpoint_is_refused_naming_the_file_and_never_run(tmp_path, cache):
    from dlrm.trainer.checkpoint_format import write_step

    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    common = ["checkpoint.every=4", "comm_timeout_s=60"]
    train(run_dir, cache, [*common, "max_iterations=4"])
    step = run_dir / "checkpoints" / "step-4"
    items = checkpoint_items(step)
    assert "dense_comm.rank1" in items
    items["dense_comm.rank1"] = RunsCode(marker)
    shutil.rmtree(step)
    # an attacker who can write the files can rewrite their checksums too: the trainer's own writer
    write_step(step, items)
    victim = step / "__0_0.distcp"  # one process wrote it all

    proc = train(run_dir, cache, [*common, "max_iterations=8", "resume=auto"], check=False)
    assert proc.returncode != 0
    assert not marker.exists()  # the payload never ran
    assert f"CheckpointError: {victim} (dense_comm.rank1) holds more than tensors" in proc.stderr, proc.stderr[-3000:]
