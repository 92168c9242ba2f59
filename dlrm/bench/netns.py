"""Private network namespaces for the emulated-network tools: made, shaped with ``tc``, and deleted.

Used by :mod:`dlrm.bench.netbench` (one namespace, its loopback throttled) and
:mod:`dlrm.bench.two_nodes` (two namespaces joined by a veth pair, the link between them
throttled). Nothing here touches the machine's own network: links are created directly inside
the namespaces, addresses live only there, and deleting a namespace deletes its veth end (and so
the pair). Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from typing import Any

from dlrm.bench import netreport

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)?\s*$", re.I)


class NetnsError(RuntimeError):
    """A namespace or link cannot be made or shaped; the message says what to do."""


def preflight(program: str, script: str) -> None:
    """Refuse early, naming ``program`` and how to run ``script`` as root, where namespaces cannot be made."""
    problems = []
    if os.geteuid() != 0:
        problems.append(
            "needs root: it creates network namespaces (`ip netns add`) and throttles links with "
            f"`tc`; run it as root, e.g. `sudo {script}`"
        )
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        problems.append(f"{' and '.join(missing)} not found: install iproute2 (`apt-get install iproute2`)")
    elif os.geteuid() == 0:
        probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if probe.returncode != 0:
            problems.append(f"`ip netns list` fails here ({probe.stderr.strip()}): network namespaces unavailable")
    if problems:
        raise NetnsError(f"{program} cannot run:\n  - " + "\n  - ".join(problems))


def delay_ms(delay: str) -> float:
    """A tc time ('20ms', '500us', '0.1s', '0'; no unit: ms) in milliseconds."""
    m = _DELAY.match(delay)
    if not m:
        raise ValueError(f"delay {delay!r}: expected a number with us, ms or s (e.g. 5ms), or 0")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[(m.group(2) or "ms").lower()]
    return float(m.group(1)) * scale


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def exists(name: str) -> bool:
    return name in _ip("netns", "list", check=False).stdout.split()


class Namespace:
    """A private network namespace with only its loopback up; deleted (and emptied) on exit."""

    def __init__(self, name: str) -> None:
        if not _NAME.fullmatch(name):
            raise NetnsError(f"namespace name {name!r}: use letters, digits, '_', '-', '.' only")
        self.name = name

    def __enter__(self) -> Namespace:
        if exists(self.name):
            raise NetnsError(
                f"network namespace {self.name!r} exists already (another run, or a leftover: "
                f"`ip netns del {self.name}`)"
            )
        _ip("netns", "add", self.name)
        try:
            self.run("ip", "link", "set", "lo", "up")
            links = self.run("ip", "-o", "link", "show").stdout.splitlines()
            names = [line.split(":")[1].strip() for line in links if ":" in line]
            if names != ["lo"]:
                raise NetnsError(f"namespace {self.name} has links {names}, expected only lo")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Kill what still runs inside (only ever our own runs), then delete the namespace."""
        self.kill_all()
        _ip("netns", "del", self.name, check=False)

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.name, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def kill_all(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def argv(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.argv(*cmd), capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise NetnsError(f"`{' '.join(cmd)}` in namespace {self.name} failed: {proc.stderr.strip()}")
        return proc

    def set_rate(self, rate: str, burst: str, latency: str, dev: str = "lo", delay: str = "0") -> None:
        """Throttle ``dev``'s egress to ``rate`` (a tc rate; ``unlimited``: no limit) after a one-way
        ``delay`` (netem; refused, not skipped, where the kernel lacks sch_netem)."""
        netreport.rate_bytes_per_s(rate)  # validate before touching tc
        ms = delay_ms(delay)
        subprocess.run(self.argv("tc", "qdisc", "del", "dev", dev, "root"), capture_output=True, timeout=60)
        parent = ["root"]
        if ms > 0:
            try:
                self.run("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{ms:g}ms")
            except NetnsError as e:
                raise NetnsError(
                    f"cannot delay {dev} by {delay}: {e} (the kernel has no sch_netem?); delay is "
                    "unsupported here, run with delay 0"
                ) from None
            parent = ["parent", "1:1", "handle", "10:"]
        if rate.strip().lower() != netreport.UNLIMITED:
            self.run("tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", rate, "burst", burst, "latency", latency)

    def sent_bytes(self, dev: str = "lo") -> int | None:
        """Bytes ``dev``'s tbf has sent so far (None without a throttle)."""
        out = self.run("tc", "-s", "qdisc", "show", "dev", dev).stdout
        m = re.search(r"qdisc tbf .*?Sent (\d+) bytes", out, re.S)
        return int(m.group(1)) if m else None

    def tx_bytes(self, dev: str) -> int:
        """Bytes ``dev`` has transmitted (its kernel counter, shaped or not)."""
        (link,) = json.loads(self.run("ip", "-s", "-j", "link", "show", "dev", dev).stdout)
        return int(link["stats64"]["tx"]["bytes"])

    def add_address(self, dev: str, cidr: str) -> None:
        self.run("ip", "addr", "add", cidr, "dev", dev)
        self.run("ip", "link", "set", dev, "up")


def veth_pair(a: Namespace, dev_a: str, b: Namespace, dev_b: str) -> None:
    """A veth pair with ``dev_a`` in ``a`` and ``dev_b`` in ``b``, made in place (never in the
    machine's own namespace); deleting either namespace deletes the pair."""
    for dev in (dev_a, dev_b):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", dev):
            raise NetnsError(f"link name {dev!r}: at most 15 letters, digits, '_', '-', '.'")
    _ip("link", "add", "name", dev_a, "netns", a.name, "type", "veth", "peer", "name", dev_b, "netns", b.name)
