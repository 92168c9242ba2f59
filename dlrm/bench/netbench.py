"""End-to-end speedup on an emulated network link: the trainer in a private, throttled network namespace.

    sudo scripts/bench_network.sh [--rate 100mbit] [--repeats 2] [--iterations N] [-- hydra overrides]
    python -m dlrm.bench.netbench --help

Creates a network namespace with only a loopback device, throttles it with ``tc`` (a token-bucket
filter: ``tc qdisc replace dev lo root tbf rate R burst 1mb latency 100ms``), and trains there
with ``torchrun`` (N ranks, gloo over 127.0.0.1) once per configuration and repeat, cycling the
configurations (ABCDE ABCDE ...) so that drift from other work on the machine hits all of them.
Every rank is timed in-process by :mod:`dlrm.bench.netprobe`; :mod:`dlrm.bench.netreport` prints per
configuration the iteration time, throughput, speedup against ``none`` from the same repeat,
the all-to-all share of the iteration, wire ratios per direction, codec time, test AUC, and the
cost model's prediction (:mod:`dlrm.performance.cost_model`), then projects the published 32-GPU setup.

Needs root (``ip netns add`` and ``tc``) and iproute2 (``apt-get install iproute2``). Talks only
to 127.0.0.1 inside its own namespace; deletes the namespace when done, also on failure. The
loopback is one medium for all ranks: each rank gets rate/N while all send at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm.bench import netns, netreport
from dlrm.bench.cli import options_from
from dlrm.bench.netns import Namespace, NetnsError
from dlrm.bench.netprobe import OUT_ENV
from dlrm.bench.published_setup import PUBLISHED_CODEC_GBPS, PUBLISHED_LINK_GBPS, projection_lines

REPO = Path(__file__).resolve().parents[2]
# Compression configs, with `+D` for dense_comm=D: the baseline, stock TorchRec's best effort
# (QComms fp16 on the all-to-alls, fp16 all-reduce), the production bar (QComms MX4, groups of
# 8/16), ours, and ours with each dense option.
DEFAULT_CONFIGS = (
    "none",
    "qcomm_fp16+fp16",
    "qcomm_mx4+fp16",
    "lossy",
    "lossy+fp16",
    "lossy+powersgd",
    "lossy+dct",
)
# The published Terabyte model (notes/papers.md §1.5) on synthetic Criteo-like data, table-wise,
# 2,048 samples per rank.
TRAINER_DEFAULTS = (
    "data=synthetic",
    "model.embedding_dim=64",
    "model.dense_arch_layer_sizes=[512,256,64]",
    "model.over_arch_layer_sizes=[512,512,256,1]",
    "batch_size=2048",
    "sharding=table_wise",
    "progress_bar=false",
    "checkpoint.keep=1",
)


class BenchError(NetnsError):
    """The benchmark cannot run or a run failed; the message says what to do."""


@dataclass(frozen=True)
class Variant:
    """A configuration to compare: a label, a `compression` config name, extra Hydra overrides."""

    label: str
    compression: str
    overrides: tuple[str, ...] = ()


def variant_of(name: str) -> Variant:
    """``lossy`` -> compression=lossy; ``lossy+dct`` -> compression=lossy dense_comm=dct."""
    compression, _, dense = name.partition("+")
    return Variant(name, compression, (f"dense_comm={dense}",) if dense else ())


def preflight() -> None:
    """Refuse early, with the reason, where the namespace cannot be made."""
    netns.preflight("dlrm.bench.netbench", "scripts/bench_network.sh")


@dataclass
class Options:
    """The parsed command line."""

    variants: list[Variant]
    rates: list[str]
    repeats: int
    iterations: int | None
    epochs: int
    warmup: int
    nproc: int
    threads: int
    out: Path
    timeout: float
    burst: str
    latency: str
    netns: str
    keep_checkpoints: bool
    overrides: list[str] = field(default_factory=list)
    codec_gbps: tuple[float, float] = PUBLISHED_CODEC_GBPS
    cluster_gbps: float = PUBLISHED_LINK_GBPS
    report: bool = False  # only rebuild the tables from the runs already in `out`


def merge_overrides(overrides: Sequence[str]) -> list[str]:
    """Hydra overrides with one entry per key, the last given winning (defaults, then the user's)."""
    merged: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0] if "=" in o and not o.startswith(("+", "~")) else o
        merged.pop(key, None)
        merged[key] = o
    return list(merged.values())


def trainer_command(o: Options, v: Variant, run_dir: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """torchrun argv (to run inside the namespace) and environment for one training run."""
    given = [
        *TRAINER_DEFAULTS,
        f"compression={v.compression}",
        f"epochs={o.epochs}",
        *([f"max_iterations={o.iterations}"] if o.iterations is not None else []),
        *o.overrides,
        *v.overrides,
        f"hydra.run.dir={run_dir}",
    ]
    overrides = merge_overrides(given)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={o.nproc}",
        "--max-restarts=0",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--local-addr=127.0.0.1",
        "-m",
        "dlrm.bench.netprobe",
        *overrides,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(o.threads),
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    env[OUT_ENV] = str(run_dir)
    return cmd, env


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_one(ns: Namespace, o: Options, v: Variant, rate: str, run_dir: Path, port: int) -> dict[str, Any]:
    """Train once inside the namespace at ``rate``; returns wall time, load and link bytes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ns.set_rate(rate, o.burst, o.latency)
    cmd, env = trainer_command(o, v, run_dir, port)
    log = run_dir / "driver.log"
    (run_dir / "command.txt").write_text(shlex.join(ns.argv(*cmd)) + "\n")
    load0, sent0, t0 = os.getloadavg()[0], ns.sent_bytes(), time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            ns.argv(*cmd), stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=o.timeout)
        except BaseException as e:  # timeout or interrupt: stop torchrun and its ranks
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=20)
                    break
                except subprocess.TimeoutExpired:
                    continue
            ns.kill_all()
            if isinstance(e, subprocess.TimeoutExpired):
                raise BenchError(
                    f"{v.label} at {rate} ran past --timeout {o.timeout:g} s and was stopped; "
                    f"last lines of {log}:\n{_tail(log)}"
                ) from None
            raise
    wall, sent1 = time.monotonic() - t0, ns.sent_bytes()
    ns.kill_all()  # nothing of this run may outlive it
    if not o.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if rc != 0:
        raise BenchError(f"{v.label} at {rate} failed (exit {rc}); last lines of {log}:\n{_tail(log)}")
    return {
        "wall_s": wall,
        "load1_before": load0,
        "load1_after": os.getloadavg()[0],
        "link_bytes": None if sent0 is None or sent1 is None else sent1 - sent0,
        "burst": o.burst,
    }


RUN_RECORD = "netbench_run.json"


def load_runs(out: Path, warmup: int) -> list[netreport.RunResult]:
    """Every finished run under ``out/runs`` (each identified by its netbench_run.json)."""
    records = sorted((out / "runs").glob(f"*/{RUN_RECORD}"))
    if not records:
        raise BenchError(f"{out / 'runs'}: no run directories with {RUN_RECORD}")
    results = []
    for path in records:
        rec = json.loads(path.read_text())
        results.append(
            netreport.load_run(path.parent, warmup, rec["label"], rec["rate"], rec["repeat"], rec.get("extra"))
        )
    return sorted(results, key=lambda r: (r.repeat, r.extra.get("order", 0)))


def parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m dlrm.bench.netbench",
        description=__doc__.split("\n")[0],
        epilog="Arguments after `--` are Hydra overrides for every run.",
    )
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="comma-separated `compression` configs, each optionally +DENSE for dense_comm=DENSE (e.g. "
        "lossy+dct); must include none (default %(default)s)",
    )
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar=("LABEL CONFIG", "OVERRIDE"),
        help="an extra configuration: label, compression config, then Hydra overrides",
    )
    p.add_argument(
        "--rate",
        action="append",
        dest="rates",
        help="tc rate of the loopback, e.g. 200mbit, or 'unlimited'; repeat for several "
        "(default 100mbit, where the all-to-alls take over 60%% of an uncompressed iteration)",
    )
    p.add_argument("--repeats", type=int, default=2, help="cycles over the configurations (default 2)")
    p.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="training iterations per run, at most --epochs epochs (default: all of them; AUC "
        "comparisons need full-length runs)",
    )
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")
    p.add_argument("--warmup", type=int, default=3, help="first iterations left out of the timings")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank (default 1)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default outputs/netbench/<time>)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one training run may take (default 900)")
    p.add_argument("--burst", default="1mb", help="tbf burst (must exceed the loopback MTU; default 1mb)")
    p.add_argument("--latency", default="100ms", help="tbf latency (queue bound; default 100ms)")
    p.add_argument("--netns", default=f"dlrm-netbench-{os.getpid()}", help="namespace name")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final checkpoint")
    p.add_argument(
        "--report", action="store_true", help="run nothing: rebuild the tables from the runs in --out (no root needed)"
    )
    p.add_argument(
        "--codec-gbps",
        default=",".join(f"{g:g}" for g in PUBLISHED_CODEC_GBPS),
        help="GPU codec encode,decode GB/s for the published-setup projection (default %(default)s)",
    )
    p.add_argument(
        "--cluster-gbps",
        type=float,
        default=PUBLISHED_LINK_GBPS,
        help="per-GPU link GB/s of the published cluster for the projection (default %(default)s)",
    )
    args, rest = netreport.parse_with_overrides(p, argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    variants = [variant_of(n) for n in names]
    for item in args.variant:
        if len(item) < 2:
            p.error("--variant needs LABEL CONFIG [OVERRIDE ...]")
        variants.append(Variant(item[0], item[1], tuple(item[2:])))
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels) or "none" not in labels:
        p.error(f"configuration labels must be unique and include none (got {labels})")
    for n in {v.compression for v in variants}:
        if not (REPO / "configs" / "compression" / f"{n}.yaml").exists():
            p.error(f"no compression config {n!r} in configs/compression/")
    for o in {o for v in variants for o in v.overrides if o.startswith("dense_comm=")}:
        if not (REPO / "configs" / "dense_comm" / f"{o.split('=', 1)[1]}.yaml").exists():
            p.error(f"no dense_comm config {o.split('=', 1)[1]!r} in configs/dense_comm/")
    rates = args.rates or ["100mbit"]
    for r in rates:
        try:
            netreport.rate_bytes_per_s(r)
        except ValueError as e:
            p.error(str(e))
    if args.repeats < 1 or args.nproc < 2 or args.warmup < 0 or args.threads < 1:
        p.error("need --repeats >= 1, --nproc >= 2, --warmup >= 0, --threads >= 1")
    if args.iterations is not None and args.iterations <= args.warmup:
        p.error(f"--iterations {args.iterations} leaves nothing after --warmup {args.warmup}")
    try:
        enc, dec = (float(x) for x in args.codec_gbps.split(","))
    except ValueError:
        p.error(f"--codec-gbps wants ENCODE,DECODE in GB/s, got {args.codec_gbps!r}")
    if args.report and args.out is None:
        p.error("--report needs --out DIR (a previous benchmark's output directory)")
    try:
        netreport.size_bytes(args.burst)
    except ValueError as e:
        p.error(f"--burst: {e}")
    out = args.out or REPO / "outputs" / "netbench" / time.strftime("%Y-%m-%d_%H-%M-%S")
    return options_from(
        Options, args, variants=variants, rates=rates, out=out, overrides=list(rest), codec_gbps=(enc, dec)
    )


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the namespace's cleanup


def report(o: Options, results: list[netreport.RunResult], failure: str | None, argv: Sequence[str]) -> int:
    """Summaries, cost-model check and projection: printed, and written to table.md/results.json."""
    loads = [x for r in results for x in (r.extra.get("load1_before"), r.extra.get("load1_after")) if x is not None]
    cpus = os.cpu_count() or 1
    context: dict[str, Any] = {
        "argv": list(argv),
        "rates": sorted({r.rate for r in results}),
        "nproc": o.nproc,
        "cpus": cpus,
        "load1_mean": sum(loads) / len(loads) if loads else None,
        "load1_max": max(loads) if loads else None,
        "failure": failure,
        "warmup": o.warmup,
    }
    bursts = {r.extra.get("burst", o.burst) for r in results}
    if len(bursts) != 1:
        print(f"runs used different tbf bursts {sorted(bursts)}: the cost model assumes one", file=sys.stderr)
    try:
        summaries = netreport.summarize(results)
        validation = netreport.validate_model(results, summaries, burst_bytes=netreport.size_bytes(sorted(bursts)[0]))
    except ValueError as e:
        print(f"cannot summarize: {e}", file=sys.stderr)
        (o.out / "results.json").write_text(netreport.to_json(results, [], {}, context))
        return 1
    load_line = "Load average (1 min) during the runs: not recorded"
    if loads:
        load_line = (
            f"Load average (1 min) during the runs: mean {context['load1_mean']:.2f}, max "
            f"{context['load1_max']:.2f} on {cpus} CPUs"
            + ("  <- busy machine: timings are noisy" if context["load1_max"] > 1.5 * cpus else "")
        )
    lines = [
        netreport.format_table(summaries),
        "",
        f"Timed iterations per run: {min(r.iterations_timed for r in results)}+ after {o.warmup} warm-up; "
        f"{max(r.repeat for r in results) + 1} repeat(s), configurations cycled; speedups paired within a "
        f"repeat (median, min-max). AUC is only comparable after full-length runs (--iterations).",
        load_line,
        f"Cost model: compute {validation['compute_ms']:.0f} ms calibrated on {validation['calibration']} "
        f"(tbf burst {validation['burst_bytes'] / 2**20:g} MiB per collective); "
        f"{validation['predictions']} predictions, mean |error| "
        f"{100 * (validation['mean_abs_error'] or math.nan):.1f}%, max "
        f"{100 * (validation['max_abs_error'] or math.nan):.1f}%."
        + (
            f"  <- {100 * validation['calibration_link_share']:.0f}% of that run was on the link: "
            "add an unthrottled rate (--rate unlimited) to calibrate the compute on"
            if validation["calibration_link_share"] > 0.5
            else ""
        ),
        "",
        *projection_lines(summaries, o),
    ]
    text = "\n".join(lines)
    print("\n" + text)
    (o.out / "table.md").write_text(text + "\n")
    (o.out / "results.json").write_text(netreport.to_json(results, summaries, validation, context))
    print(f"\nwrote {o.out / 'table.md'} and {o.out / 'results.json'}")
    return 0 if failure is None else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run every (repeat, rate, configuration) in turn, then print the tables (or only re-report)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    o = parse_args(argv)
    if o.report:
        try:
            return report(o, load_runs(o.out, o.warmup), None, argv)
        except (BenchError, netreport.RunDirError) as e:
            print(e, file=sys.stderr)
            return 1
    try:
        preflight()
    except NetnsError as e:
        print(e, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    o.out.mkdir(parents=True, exist_ok=True)
    plan = [(rep, rate, v) for rep in range(o.repeats) for rate in o.rates for v in o.variants]
    print(
        f"dlrm.bench.netbench: {len(plan)} runs ({o.repeats} x {len(o.rates)} rate(s) x {len(o.variants)} configs), "
        f"{o.nproc} ranks, namespace {o.netns}, output {o.out}",
        flush=True,
    )
    print(f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs", flush=True)
    results: list[netreport.RunResult] = []
    failure = None
    try:
        with Namespace(o.netns) as ns:
            for i, (rep, rate, v) in enumerate(plan):
                run_dir = o.out / "runs" / f"r{rep}_{rate}_{v.label}"
                extra = {**run_one(ns, o, v, rate, run_dir, port=29500 + i % 1000), "order": i}
                (run_dir / RUN_RECORD).write_text(
                    json.dumps(
                        {
                            "label": v.label,
                            "compression": v.compression,
                            "overrides": list(v.overrides),
                            "rate": rate,
                            "repeat": rep,
                            "extra": extra,
                        },
                        indent=1,
                    )
                    + "\n"
                )
                r = netreport.load_run(run_dir, o.warmup, v.label, rate, rep, extra)
                results.append(r)
                print(
                    f"[{i + 1}/{len(plan)}] repeat {rep} {rate} {v.label}: {r.iteration_ms:.0f} ms/iter, "
                    f"a2a {100 * r.a2a_share:.0f}%, AUC {r.auc:.4f}, load {extra['load1_before']:.1f}->"
                    f"{extra['load1_after']:.1f}, {extra['wall_s']:.0f} s",
                    flush=True,
                )
    except (NetnsError, netreport.RunDirError, KeyboardInterrupt) as e:
        failure = f"{type(e).__name__}: {e}"
        print(f"dlrm.bench.netbench stopped: {failure}", file=sys.stderr)
    if not results:
        return 1
    return report(o, results, failure, argv)


if __name__ == "__main__":
    sys.exit(main())
