"""Two emulated nodes (scripts/two_nodes.sh): a real 4-rank run across two network namespaces, and
the namespaces gone afterwards whether the run succeeds, fails or is stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from namespaces import why_not
from trainer_runs import REPO, SMALL

from dlrm.bench import netns, two_nodes


def _why_not() -> str | None:
    return why_not("two-node tests")


needs_namespaces = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _ours(pid: int) -> list[str]:
    """Namespaces of the script run with this pid (its names carry the pid)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in out if n.startswith(f"dlrm-2n-{pid}-")]


def _script(tmp_path: Path, cache: Path, args: list[str], overrides: list[str]) -> subprocess.Popen:
    trainer = [f"hydra.run.dir={tmp_path / 'run'}", f"data.cache_dir={cache}", *SMALL, *overrides]
    cmd = ["bash", str(REPO / "scripts" / "two_nodes.sh"), *args, "--", *trainer]
    with open(tmp_path / "out.txt", "w") as out:  # a pipe no one reads while we wait would stall the ranks
        return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHON=sys.executable), stdout=out, stderr=out)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@needs_namespaces
@pytest.mark.timeout(120)
def test_table_row_wise_trains_across_two_nodes_and_the_namespaces_go(tmp_path, cache):
    report = tmp_path / "two_nodes.json"
    args = ["--rate", "1gbit", "--timeout", "100", "--report", str(report)]
    proc = _script(tmp_path, cache, args, ["sharding=table_row_wise", "max_iterations=6"])
    rc = proc.wait(timeout=110)
    log = (tmp_path / "out.txt").read_text()
    assert rc == 0, log[-6000:]
    assert _ours(proc.pid) == []
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["iterations"] == 6
    # TorchRec's planner puts each table_row_wise table on one node's ranks: two nodes of two ranks
    # (on one host, 4 ranks are one node and every table spans ranks 0-3)
    nodes = {p.split("ranks=")[1] for p in metrics["sharding_plan"].values()}
    assert nodes == {"[0, 1]", "[2, 3]"}, metrics["sharding_plan"]
    measured = json.loads(report.read_text())
    assert measured["exit_codes"] == [0, 0]
    # both directions crossed the veth; node 1's loopback carried its own ranks' traffic (rank 0's
    # store lives on node 0, so nothing else of the job uses node 1's lo)
    assert all(b > 100_000 for b in measured["inter_node_bytes"]), measured
    assert measured["loopback_bytes"][1] > 100_000, measured


@needs_namespaces
@pytest.mark.timeout(90)
def test_a_failing_run_returns_its_exit_code_and_leaves_nothing(tmp_path, cache):
    # every rank fails at once (no torch import to wait for): the launcher's part is what is tested
    proc = _script(tmp_path, cache, ["--grace", "5", "--timeout", "60", "--module", "dlrm.no_such_entry"], [])
    rc = proc.wait(timeout=80)
    log = (tmp_path / "out.txt").read_text()
    assert rc == 1 and "No module named dlrm.no_such_entry" in log, log[-4000:]
    assert _ours(proc.pid) == []


@needs_namespaces
@pytest.mark.timeout(90)
def test_a_stopped_run_removes_its_namespaces_and_ranks(tmp_path, cache):
    proc = _script(tmp_path, cache, ["--timeout", "80"], ["max_iterations=1000"])
    deadline = time.monotonic() + 60
    pids: set[int] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        names = _ours(proc.pid)
        if len(names) == 2:  # wait for both agents to be inside before stopping
            pids = {
                int(p)
                for n in names
                for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
            }
            if len(pids) >= 2:
                break
        time.sleep(0.2)
    assert len(pids) >= 2, (tmp_path / "out.txt").read_text()[-4000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    assert _ours(proc.pid) == []
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []


def test_without_root_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert two_nodes.main(["--", "max_iterations=1"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "sudo scripts/two_nodes.sh" in err


@needs_namespaces
def test_a_delay_is_netem_or_refused_by_name():
    """Where the kernel has sch_netem the link gets the delay then the rate; else the delay is
    refused as unsupported (a rate alone still works)."""
    with netns.Namespace(f"dlrm-2n-{os.getpid()}-probe") as ns:
        ns.set_rate("100mbit", "1mb", "100ms", delay="0")
        assert ns.sent_bytes() is not None
        try:
            ns.set_rate("100mbit", "1mb", "100ms", delay="5ms")
        except netns.NetnsError as e:
            assert "delay is unsupported" in str(e)
        else:
            qdiscs = ns.run("tc", "qdisc", "show", "dev", "lo").stdout
            assert "netem" in qdiscs and "delay 5ms" in qdiscs and "tbf" in qdiscs


@pytest.mark.scale  # a 4-rank auto run: make test-scale
@needs_namespaces
@pytest.mark.timeout(240)
def test_auto_times_the_two_links_apart_across_two_nodes(tmp_path, cache):
    """auto on 2 nodes x 2 ranks: the intra-node link (the namespace's loopback) and the inter-node
    link (the veth, shaped to 100 Mbit/s per direction) timed apart on TorchRec's intra- and
    cross-node groups, the plan priced with both. (Whether the veth is found shared by the node's
    ranks is not asserted: under load on 2 cores that test flips, see docs/two_nodes.md.)"""
    overrides = [
        "compression=auto",
        "dense_comm=auto",
        "compression.strategy.calibrate_iterations=2",
        "compression.strategy.measure_iterations=2",
        "max_iterations=6",
        "policy=fixed",
    ]
    proc = _script(tmp_path, cache, ["--rate", "100mbit", "--timeout", "220"], overrides)
    rc = proc.wait(timeout=230)
    assert rc == 0, (tmp_path / "out.txt").read_text()[-6000:]
    plans = json.loads((tmp_path / "run" / "strategy.json").read_text())["plans"]
    plan = [p for p in plans if p["choice"] is not None][-1]
    topo = plan["topology"]
    assert topo["ranks_per_node"] == 2
    # what a rank gets while both of its node's ranks cross: at most half the veth's 12.5 MB/s
    # per direction (tbf), well under the namespace's loopback
    per_rank = topo["inter"]["bytes_per_s"] / (2 if topo["inter"]["shared"] else 1)
    assert 1.5e6 < per_rank < 7e6, topo
    assert topo["intra"]["bytes_per_s"] > 5 * per_rank, topo
    assert plan["link"]["bytes_per_s"] == topo["inter"]["bytes_per_s"]
