"""Two emulated nodes on one machine: the trainer across two network namespaces joined by a shaped link.

    sudo scripts/two_nodes.sh [--rate 1gbit] [--delay 0] [--nproc-per-node 2] [-- hydra overrides]
    python -m dlrm.bench.two_nodes --help

Each node is a private network namespace; a veth pair joins them (10.27.0.1 and 10.27.0.2, which
exist only inside the two namespaces), its both ends throttled with ``tc`` (tbf for the rate,
netem before it for a one-way delay). ``torchrun --nnodes 2 --node_rank {0,1}`` runs in each with a
static rendezvous at node 0's address (c10d's rendezvous cannot host its store on a namespace
address). gloo binds to the veth address, so ranks of one node reach each other over the
namespace's loopback (the kernel routes local addresses there, unshaped) and the other node's over
the veth. Prints, and writes with ``--report``, the exit codes, the wall time and the bytes each
link carried. Needs root and iproute2; deletes both namespaces (and so the link) on exit.

``--fault KIND@WHEN`` injects a fault across nodes (docs/faults.md): ``kill-node<r>`` SIGKILLs node
r's ranks (not its torchrun agent, which restarts them under ``--max-restarts``), ``cut-link`` takes
node 1's end of the link down; WHEN is seconds after the start (``30s``) or an iteration the
trainer logged (``it12``: needs ``loss_log=true`` and ``hydra.run.dir=...``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm.bench import netns, netreport
from dlrm.bench.cli import options_from
from dlrm.bench.netns import Namespace, NetnsError

REPO = Path(__file__).resolve().parents[2]
# One /30 inside the two namespaces only: node r has ADDRESSES[r].
ADDRESSES = ("10.27.0.1", "10.27.0.2")
PREFIX = 30
FAULT_KINDS = ("kill-node0", "kill-node1", "cut-link")
_WHEN = re.compile(r"(?:(\d+(?:\.\d+)?)s?|it(\d+))")


@dataclass(frozen=True)
class Fault:
    """``kind`` (one of FAULT_KINDS) injected ``seconds`` after the agents start, or once the
    trainer's losses.txt holds ``iteration``."""

    kind: str
    seconds: float | None = None
    iteration: int | None = None

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, _, when = text.partition("@")
        m = _WHEN.fullmatch(when.strip())
        if kind not in FAULT_KINDS or not m:
            raise ValueError(
                f"--fault {text!r}: expected KIND@WHEN, KIND one of {', '.join(FAULT_KINDS)}, WHEN seconds "
                "after the start (30s) or an iteration (it12)"
            )
        if m.group(2) is not None:
            return cls(kind, iteration=int(m.group(2)))
        return cls(kind, seconds=float(m.group(1)))

    def __str__(self) -> str:
        return f"{self.kind}@{f'it{self.iteration}' if self.iteration is not None else f'{self.seconds:g}s'}"


@dataclass
class Options:
    """The parsed command line."""

    tag: str
    rate: str = "1gbit"
    delay: str = "0"
    burst: str = "1mb"
    latency: str = "100ms"
    nproc_per_node: int = 2
    master_port: int = 29500
    max_restarts: int = 0
    timeout: float = 3600.0
    grace: float = 60.0
    module: str = "dlrm.train"
    report: Path | None = None
    trainer_args: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def namespace(self, node: int) -> str:
        return f"dlrm-2n-{self.tag}-node{node}"

    def link(self, node: int) -> str:
        return f"2n{self.tag}-{node}"


def torchrun_argv(o: Options, node: int) -> list[str]:
    """The agent of node ``node``: a static rendezvous at node 0's address, one run id for both."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--nproc_per_node={o.nproc_per_node}",
        f"--node_rank={node}",
        f"--master_addr={ADDRESSES[0]}",
        f"--master_port={o.master_port}",
        f"--rdzv-id=2n{o.tag}",  # the trainer names its run directory after it: the same on both nodes
        f"--max-restarts={o.max_restarts}",
        "-m",
        o.module,
        *o.trainer_args,
    ]


def node_env(o: Options, node: int) -> dict[str, str]:
    """gloo on the node's veth address; one OMP thread per rank unless the caller set it."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(
        GLOO_SOCKET_IFNAME=o.link(node),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    return env


def worst(codes: Sequence[int | None]) -> int:
    """The worst exit status, as a shell reports it (killed by signal N: 128 + N; never ended: 124)."""
    return max(124 if c is None else 128 - c if c < 0 else c for c in codes)


def _stop(procs: Sequence[subprocess.Popen], wait_s: float = 10.0) -> None:
    """TERM every agent still running (and its ranks, in its session), then KILL what remains."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.1)


def wait_all(
    procs: Sequence[subprocess.Popen],
    timeout: float,
    grace: float,
    tick: Callable[[], None] | None = None,
    poll_s: float = 0.2,
) -> list[int | None]:
    """Wait for every agent; once one fails, the others get ``grace`` seconds (their collectives
    fail on their own within the trainer's ``comm_timeout_s``), and none more than ``timeout``.
    ``tick`` is called every ``poll_s`` meanwhile (the fault injector)."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace)
            if tick is not None:
                tick()
            time.sleep(poll_s)
    finally:
        ended = [p.returncode for p in procs]
        _stop(procs)
    return ended


def trainer_run_dir(trainer_args: Sequence[str]) -> Path | None:
    """The run directory the trainer was given (``hydra.run.dir=``, relative to the repository)."""
    given = [a.split("=", 1)[1] for a in trainer_args if a.startswith("hydra.run.dir=")]
    return REPO / given[-1] if given else None


def last_logged_iteration(losses: Path) -> int:
    """The newest iteration rank 0 wrote to losses.txt (``loss_log=true``); 0 before the first."""
    try:
        with open(losses, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().split(b"\n")[:-1]  # the last piece has no newline yet (or is empty)
    except FileNotFoundError:
        return 0
    return int(lines[-1].split()[0]) if lines and lines[-1].strip() else 0


def worker_pids(agent: int) -> dict[int, int]:
    """rank -> pid of the ranks a torchrun agent started: its topmost descendants with RANK set (a
    rank's own children, e.g. data loader workers, inherit RANK and are left out)."""
    found, todo = {}, [agent]
    while todo:
        pid = todo.pop()
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
            children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except FileNotFoundError:
            continue
        for child in children:
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):
                continue
            rank = [e[5:] for e in environ if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0])] = child
            else:
                todo.append(child)
    return found


class Injector:
    """Injects ``o.faults`` when due (each once) and notes when each node's agent ended."""

    def __init__(self, o: Options, nodes: Sequence[Namespace], procs: Sequence[subprocess.Popen], t0: float) -> None:
        self.o, self.nodes, self.procs, self.t0 = o, nodes, procs, t0
        run_dir = trainer_run_dir(o.trainer_args)
        self.losses = run_dir / "losses.txt" if run_dir is not None else None
        self.injected: list[dict[str, Any]] = []
        self.ended_s: list[float | None] = [None] * len(procs)

    def __call__(self) -> None:
        now = time.monotonic() - self.t0
        for node, p in enumerate(self.procs):
            if p.poll() is not None and self.ended_s[node] is None:
                self.ended_s[node] = now
        done = {f["fault"] for f in self.injected}
        pending = [f for f in self.o.faults if str(f) not in done]
        if not pending:
            return
        logged = last_logged_iteration(self.losses) if self.losses is not None else 0
        for fault in pending:
            due = logged >= fault.iteration if fault.iteration is not None else now >= (fault.seconds or 0.0)
            if due and all(p.poll() is None for p in self.procs):
                what = self.inject(fault)
                if what is not None:
                    self.injected.append({"fault": str(fault), "at_s": now, "logged_iteration": logged, **what})
                    print(
                        f"two_nodes: injected {fault} at {now:.1f} s ({time.strftime('%H:%M:%S')}, "
                        f"iteration {logged} logged): {what}",
                        flush=True,
                    )

    def inject(self, fault: Fault) -> dict[str, Any] | None:
        """Do it; what was done, or None to try again at the next tick (no ranks to kill yet)."""
        if fault.kind == "cut-link":
            # node 1's end: node 0's end only loses its carrier and keeps its address, so node 0's
            # ranks still reach each other and the store (downing node 0's end would drop its address)
            self.nodes[1].run("ip", "link", "set", self.o.link(1), "down")
            return {"link": self.o.link(1)}
        node = int(fault.kind.removeprefix("kill-node"))
        ranks = worker_pids(self.procs[node].pid)  # not the agent: it restarts them under --max-restarts
        if len(ranks) < self.o.nproc_per_node:
            return None
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return {"killed_ranks": sorted(ranks), "pids": [ranks[r] for r in sorted(ranks)]}


def run(o: Options) -> dict[str, Any]:
    """Build both nodes and their link, train across them, measure, tear everything down."""
    with Namespace(o.namespace(0)) as n0, Namespace(o.namespace(1)) as n1:
        nodes = (n0, n1)
        netns.veth_pair(n0, o.link(0), n1, o.link(1))
        for node, ns in enumerate(nodes):
            ns.add_address(o.link(node), f"{ADDRESSES[node]}/{PREFIX}")
            ns.set_rate(o.rate, o.burst, o.latency, dev=o.link(node), delay=o.delay)
        before = [(ns.tx_bytes(o.link(node)), ns.tx_bytes("lo")) for node, ns in enumerate(nodes)]
        print(
            f"two_nodes: {o.namespace(0)} ({ADDRESSES[0]}) <-> {o.namespace(1)} ({ADDRESSES[1]}) at {o.rate}, "
            f"delay {o.delay}; {2 * o.nproc_per_node} ranks of {o.module}",
            flush=True,
        )
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(ns.argv(*torchrun_argv(o, node)), cwd=REPO, env=node_env(o, node), start_new_session=True)
            for node, ns in enumerate(nodes)
        ]
        injector = Injector(o, nodes, procs, t0)
        codes = wait_all(procs, o.timeout, o.grace, tick=injector, poll_s=0.05 if o.faults else 0.2)
        wall = time.monotonic() - t0
        injector.ended_s = [wall if e is None else e for e in injector.ended_s]
        after = [(ns.tx_bytes(o.link(node)), ns.tx_bytes("lo")) for node, ns in enumerate(nodes)]
    return {
        "exit_codes": codes,
        "exit_code": worst(codes),
        "wall_s": wall,
        "rate": o.rate,
        "delay": o.delay,
        "namespaces": [o.namespace(0), o.namespace(1)],
        "addresses": list(ADDRESSES),
        "nproc_per_node": o.nproc_per_node,
        # bytes sent by node r over the veth (to the other node) and over its loopback (to itself)
        "inter_node_bytes": [a[0] - b[0] for a, b in zip(after, before, strict=True)],
        "loopback_bytes": [a[1] - b[1] for a, b in zip(after, before, strict=True)],
        # seconds from the start to each node's agent ending, and the faults injected (--fault)
        "ended_s": injector.ended_s,
        "faults": injector.injected,
    }


def parse_args(argv: Sequence[str]) -> Options:
    p = argparse.ArgumentParser(
        prog="scripts/two_nodes.sh",
        description=__doc__.split("\n")[0],
        epilog="Arguments after `--` go to the trainer (Hydra overrides).",
    )
    p.add_argument(
        "--rate", default="1gbit", help="inter-node rate per direction, a tc rate or 'unlimited' (%(default)s)"
    )
    p.add_argument("--delay", default="0", help="one-way inter-node delay, e.g. 5ms; needs sch_netem (%(default)s)")
    p.add_argument("--burst", default="1mb", help="tbf burst (%(default)s)")
    p.add_argument("--latency", default="100ms", help="tbf queue bound (%(default)s)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (%(default)s)")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (%(default)s)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun --max-restarts (%(default)s)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before both nodes are stopped (%(default)s)")
    p.add_argument(
        "--grace", type=float, default=60, help="seconds a node may outlive the other's failure (%(default)s)"
    )
    p.add_argument("--module", default="dlrm.train", help="the module torchrun runs (%(default)s)")
    p.add_argument("--report", type=Path, default=None, help="also write the measurements to this JSON file")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND@WHEN",
        help=f"inject a fault ({', '.join(FAULT_KINDS)}) at WHEN: seconds after the start (30s) or a logged "
        "iteration (it12, needs loss_log=true and hydra.run.dir=...); repeatable",
    )
    p.add_argument("--tag", default=str(os.getpid()), help="unique name part of the namespaces and links (pid)")
    args, rest = netreport.parse_with_overrides(p, argv)
    try:
        netreport.rate_bytes_per_s(args.rate)
        netreport.size_bytes(args.burst)
        netns.delay_ms(args.delay)
    except ValueError as e:
        p.error(str(e))
    try:
        faults = [Fault.parse(f) for f in args.fault]
    except ValueError as e:
        p.error(str(e))
    by_iteration = [str(f) for f in faults if f.iteration is not None]
    if by_iteration and (trainer_run_dir(rest) is None or "loss_log=true" not in rest):
        p.error(
            f"--fault {by_iteration[0]} watches the trainer's <run dir>/losses.txt: pass loss_log=true and "
            "hydra.run.dir=... after `--` (or give the time in seconds, e.g. 30s)"
        )
    if not re.fullmatch(r"[A-Za-z0-9]{1,10}", args.tag):
        p.error(f"--tag {args.tag!r}: 1 to 10 letters or digits (it goes into link names)")
    if args.nproc_per_node < 1 or args.timeout <= 0 or args.grace < 0 or args.max_restarts < 0:
        p.error("need --nproc-per-node >= 1, --timeout > 0, --grace >= 0, --max-restarts >= 0")
    return options_from(Options, args, trainer_args=list(rest), faults=faults)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the namespaces' cleanup


def main(argv: Sequence[str] | None = None) -> int:
    o = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        netns.preflight("scripts/two_nodes.sh", "scripts/two_nodes.sh")
    except NetnsError as e:
        print(e, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        result = run(o)
    except NetnsError as e:
        print(f"two_nodes: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"two_nodes: stopped ({e or 'interrupted'}); namespaces removed", file=sys.stderr)
        return 130
    line = json.dumps(result)
    print(f"two_nodes: {line}", flush=True)
    if o.report is not None:
        o.report.parent.mkdir(parents=True, exist_ok=True)
        o.report.write_text(line + "\n")
    return int(result["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
