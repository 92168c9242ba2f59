"""The two-node benchmark: configurations across two emulated nodes at several inter-node rates,
throughput and bytes per rank, and the two-level cost model's iteration time against the measured.

    sudo python -m dlrm.bench.two_node_bench --out DIR [--rate 1gbit --rate 100mbit]
        [--configs none,qcomm_fp16+none,lossy+none,lossy+dct,auto+auto] [-- hydra overrides]

Every configuration runs under :mod:`dlrm.bench.netprobe` (iteration times, all-to-all bytes and
codec time per iteration) through :func:`dlrm.bench.two_nodes.run` (2 nodes x 2 ranks), first
with the inter-node link unthrottled, then at each rate. The prediction at a rate is the same
configuration's unthrottled iteration (its compute and codec time, calibrated) plus what the
iteration's collectives add on a link of that rate (:func:`added_seconds`), each priced by the
two-level model (:mod:`dlrm.performance.network`) on one veth per node shared by the node's ranks.
Three rules of the emulated link, each read off the per-collective times of quiet runs:

- **tc's bucket refills only while the link idles.** A collective gets the shaper's burst at line
  speed only when the one before it in the iteration (forward all-to-all, backward all-to-all,
  dense all-reduce, cyclically) fitted in the burst; after one that did not, the bucket is empty
  and every byte goes at the rate (``none`` at 100 Mbit/s: its forward all-to-all took 546 ms
  more than unthrottled, its bytes at the rate are 545 ms).
- **An all-to-all's own CPU work overlaps its wire time**: it adds what its wire time exceeds its
  unthrottled time by, not the sum.
- **The input dist runs a batch ahead** (TorchRec's pipeline): it adds only what exceeds the
  unthrottled iteration.

The dense all-reduce is added whole (DDP's overlap with the backward is not modelled).
``auto+auto`` chooses per link, so its unthrottled run calibrates nothing: its prediction is its
own plan's (``predicted_iteration_ms``: the strategy's two-level timeline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dlrm.bench import netreport, two_nodes
from dlrm.performance.cost_model import Workload
from dlrm.performance.network import Collective, Link, Topology, ring_allreduce_bytes

CONFIGS = ("none+none", "qcomm_fp16+none", "lossy+none", "lossy+dct", "auto+auto")
# the netbench's setup: Terabyte MLPs, dim 64, synthetic rows, table-wise
TRAINER = [
    "data=synthetic",
    "data.rows={train:400000,dev:4000,test:4000}",
    "model.embedding_dim=64",
    "model.dense_arch_layer_sizes=[512,256,64]",
    "model.over_arch_layer_sizes=[512,512,256,1]",
    "sharding=table_wise",
    "progress_bar=false",
    "eval_batch_size=2048",
]


def collectives(r: netreport.RunResult, input_bytes: float) -> list[Collective]:
    """The collectives of one measured iteration: the all-to-alls and the input dist pairwise, the
    dense gradients a ring (gloo's all-reduce and all-gather) of their wire bytes."""
    dense = ring_allreduce_bytes(r.dense_params, r.world_size) / r.dense_ratio
    return [
        Collective("pairwise", r.a2a_bytes["forward"]),
        Collective("pairwise", r.a2a_bytes["backward"]),
        Collective("pairwise", input_bytes),
        Collective("ring", dense),
    ]


def added_seconds(r: netreport.RunResult, base: netreport.RunResult, input_bytes: float, topo: Topology) -> float:
    """What the iteration's collectives (measured in ``r``) add on ``topo`` to the unthrottled run
    ``base`` of the same configuration, by the rules of the module docstring."""
    fwd, bwd, inp, dense = collectives(r, input_bytes)
    drained = replace(topo, inter=replace(topo.inter, burst_bytes=0.0))
    # in iteration order, each with its unthrottled time; the dense all-reduce precedes the next forward
    cycle = [(fwd, base.a2a_ms["forward"] / 1e3), (bwd, base.a2a_ms["backward"] / 1e3), (dense, 0.0)]
    added = 0.0
    for i, (c, own) in enumerate(cycle):
        idle_before = _on_link(cycle[i - 1][0], topo, r.world_size) <= topo.inter.burst_bytes
        added += max(0.0, (topo if idle_before else drained).seconds(c, r.world_size) - own)
    return added + max(0.0, topo.seconds(inp, r.world_size) - base.iteration_ms / 1e3)


def _on_link(c: Collective, topo: Topology, world: int) -> float:
    """Bytes ``c`` puts on one node's inter-node link: every rank's crossing bytes for ``pairwise``,
    the one crossing rank's for ``ring``."""
    inter = topo.crossing(c, world)[1]
    return inter * topo.ranks_per_node


def node_bytes(r: netreport.RunResult, input_bytes: float, topo: Topology) -> float:
    """What the model puts on one node's inter-node link per iteration: its ranks' crossing bytes."""
    return sum(_on_link(c, topo, r.world_size) for c in collectives(r, input_bytes))


def two_node_topology(rate: str, burst: str, nproc_per_node: int) -> Topology:
    """The emulated nodes: the namespace's loopback inside (free beside the CPU time the unthrottled
    run calibrates), one shaped veth per node across, carrying all of the node's ranks."""
    inter = Link(netreport.rate_bytes_per_s(rate), shared=True, burst_bytes=netreport.size_bytes(burst))
    return Topology(nproc_per_node, Link(float("inf")), inter)


def _run(o: argparse.Namespace, config: str, rate: str, out: Path) -> dict[str, Any]:
    compression, dense = config.split("+")
    run_dir = out / f"{config}@{rate}"
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"hydra.run.dir={run_dir}",
        f"compression={compression}",
        f"dense_comm={dense}",
        f"max_iterations={o.iterations}",
        f"batch_size={o.batch_size}",
        *TRAINER,
        *o.overrides,
    ]
    opts = two_nodes.Options(
        tag=f"{os.getpid()}",
        rate=rate,
        burst=o.burst,
        module="dlrm.bench.netprobe",
        timeout=o.timeout,
        trainer_args=overrides,
    )
    os.environ["DLRM_NETPROBE_OUT"] = str(run_dir)
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    measured = two_nodes.run(opts)
    measured["load_before"] = load
    (run_dir / "two_nodes.json").write_text(json.dumps(measured, indent=1) + "\n")
    if measured["exit_code"] != 0:
        raise RuntimeError(f"{config} at {rate} failed ({measured['exit_code']}): see {run_dir}/train_rank*.log")
    return measured


def _input_bytes(metrics: dict[str, Any], r: netreport.RunResult) -> float:
    """Bytes one rank sends in the input dist per iteration: the transport's meter, or for
    TorchRec's own QComms path (not metered) the raw ids and lengths of the workload."""
    by_path = metrics.get("wire_bytes_by_path")
    if by_path:
        return float(by_path["input"]) / r.world_size
    w = Workload(r.world_size, r.samples_per_iteration // r.world_size, tuple(r.embedding_dims))
    return w.input_dist_bytes()


def rows(out: Path, warmup: int, rates: Sequence[str], configs: Sequence[str], burst: str) -> list[dict[str, Any]]:
    """One row per configuration and rate, with the model's prediction (see the module docstring)."""
    table = []
    for config in configs:
        base = None
        for rate in ("unlimited", *rates):
            run_dir = out / f"{config}@{rate}"
            r = netreport.load_run(run_dir, warmup, config, rate, 0)
            m = json.loads((run_dir / "metrics.json").read_text())
            ws = r.world_size
            input_bytes = _input_bytes(m, r)
            topo = two_node_topology(rate, burst, ws // 2)
            if rate == "unlimited":
                base = r
                continue
            assert base is not None
            if config.startswith("auto"):
                predicted = m.get("predicted_iteration_ms")
            else:
                predicted = base.iteration_ms + 1e3 * added_seconds(r, base, input_bytes, topo)
            sent = input_bytes + r.a2a_bytes["forward"] + r.a2a_bytes["backward"]
            sent += ring_allreduce_bytes(r.dense_params, ws) / r.dense_ratio
            link = json.loads((run_dir / "two_nodes.json").read_text())
            table.append(
                {
                    "config": config,
                    "rate": rate,
                    "ms": r.iteration_ms,
                    "samples_per_s": r.samples_per_s,
                    "unthrottled_ms": base.iteration_ms,
                    "bytes_per_rank": sent,
                    "inter_node_bytes_per_iteration": statistics.fmean(link["inter_node_bytes"]) / m["iterations"],
                    "predicted_inter_node_bytes": node_bytes(r, input_bytes, topo),
                    "predicted_ms": predicted,
                    "error": None if predicted is None else predicted / r.iteration_ms - 1,
                    "strategy": m.get("strategy"),
                    "load_before": link.get("load_before"),
                }
            )
    return table


def markdown(table: Sequence[dict[str, Any]]) -> str:
    head = (
        "| inter-node | config | ms/iter | samples/s | unthrottled ms/iter | kB sent per rank/iter "
        "| kB over each veth/iter (model) | model ms (error) | load |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"
    )
    lines = [head]
    for t in table:
        err = "" if t["error"] is None else f" ({100 * t['error']:+.1f}%)"
        pred = "-" if t["predicted_ms"] is None else f"{t['predicted_ms']:.0f}{err}"
        lines.append(
            f"| {t['rate']} | {t['config']} | {t['ms']:.0f} | {t['samples_per_s']:,.0f} | {t['unthrottled_ms']:.0f} | "
            f"{t['bytes_per_rank'] / 1e3:,.0f} | {t['inter_node_bytes_per_iteration'] / 1e3:,.0f} "
            f"({t['predicted_inter_node_bytes'] / 1e3:,.0f}) | {pred} | "
            f"{t['load_before']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlrm.bench.two_node_bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rate", action="append", help="inter-node rate (repeatable; default 1gbit and 100mbit)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="compression+dense_comm pairs (%(default)s)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument(
        "--warmup", type=int, default=8, help="iterations left out of the timings (auto plans by 5, settles by 8)"
    )
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--burst", default="1mb")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--report", action="store_true", help="only re-print the table of a finished --out")
    o, overrides = netreport.parse_with_overrides(p, argv)
    o.overrides = overrides
    rates = o.rate or ["1gbit", "100mbit"]
    configs = [c if "+" in c else f"{c}+none" for c in o.configs.split(",")]
    if not o.report:
        two_nodes.netns.preflight("the two-node benchmark", "sudo python -m dlrm.bench.two_node_bench")
        for config in configs:
            for rate in ("unlimited", *rates):
                print(f"two_node_bench: {config} at {rate}", flush=True)
                _run(o, config, rate, o.out)
    table = rows(o.out, o.warmup, rates, configs, o.burst)
    (o.out / "two_node_bench.json").write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
