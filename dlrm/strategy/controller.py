"""`compression=auto` / `dense_comm=auto`: calibrate on the run itself, choose, apply, re-plan.

The codec of every table and direction of the embedding all-to-all and of the dense gradients is
chosen by :func:`dlrm.performance.search.choose` from measurements of this run:

1. the link (:mod:`dlrm.performance.link_timing`): timed all-to-alls of several sizes on the run's
   own process group, fitted as ``latency + bytes / bandwidth`` (per rank, every rank sending at
   once, as in training); where the group spans several nodes (``LOCAL_WORLD_SIZE <
   WORLD_SIZE``), the intra- and inter-node links apart, on TorchRec's intra- and cross-node
   groups (``calibrate_topology``), and every collective priced on the links it crosses
   (:mod:`dlrm.performance.network`);
2. the codecs: for ``calibrate_iterations`` training iterations every option is also encoded and
   decoded on the side (not sent) on a real chunk per direction and call and on every dense
   bucket, for its ratio and time; options whose worst-case error could exceed the policy's bound
   are left out. Meanwhile the safe defaults travel: the bounded fallback codec of the all-to-alls
   (``compression.*.params.fallback``) and ``dense_comm.fallback`` (dct in auto.yaml), so these
   iterations send what those fixed choices send;
3. the input all-to-all (``compression.input: auto``): it sends raw meanwhile, and each call also
   codes its ids on the side (not sent) and decodes them, for the coded option's bytes and time;
4. the compute: the median iteration time over the next ``measure_iterations`` (the same
   defaults, no calibration work), less what the model gives those defaults. The iterations timed
   are recorded in the plan (``timed_iterations``). These are still a run's first iterations,
   which run slower than its steady state (in the two-node benchmark 300-350 ms against 245), so
   the plan is marked ``settled: false`` and re-made from the next ``measure_iterations`` timings
   whatever their drift (same codec measurements; only the compute re-calibrated).

Rank 0 decides and broadcasts, so every rank runs the same strategy. The plan is re-made every
``replan_every`` iterations, and when the measured iteration time drifts more than ``drift`` from
the prediction. Every plan is written to ``strategy.json`` in the run directory (and to
TensorBoard); ``strategy_file=PATH`` replays a saved one (each plan from the iteration it took
effect at, no calibration), which reproduces the run's losses.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dlrm.dense_comm.config import AUTO_OPTIONS
from dlrm.dense_comm.hook import DenseComm
from dlrm.embedding_comm.dist import CompressionRuntime
from dlrm.embedding_comm.input_switch import InputSwitch
from dlrm.performance.link_timing import calibrate_link, calibrate_topology
from dlrm.performance.network import Link, Topology
from dlrm.performance.search import Option, Timeline, Unit, choose, simulate
from dlrm.process.env import DistEnv, collective_device
from dlrm.strategy.config import StrategySpec

log = logging.getLogger(__name__)


def regroup_cost(samples: list[tuple]) -> float:
    """Seconds per raw byte of gathering a chunk's columns by codec and scattering them back."""
    regroup = [(raw, enc + dec) for _, feature, _, raw, _, enc, dec, _ in samples if feature == "*"]
    total = sum(r for r, _ in regroup)
    return sum(t for _, t in regroup) / 2 / total if total else 0.0  # each of encode and decode pays one


def _units(
    samples: list[tuple],
    dense_samples: list[tuple],
    iterations: int,
    ws: int,
    input_samples: Sequence[tuple] = (),
    input_dists: int = 1,
) -> list[Unit]:
    """Units with per-rank, per-iteration sizes and times, from every rank's calibration samples.

    An all-to-all sample is one block sent to one peer; each block goes to ``ws - 1`` peers, and
    the totals are shared by the ``ws`` ranks. Options that exceeded a bound in any sample are
    left out (the fallback, bounded, always stays). An input sample is one call of one of the
    ``input_dists`` input dists on one rank, each called once per batch.
    """
    scale = (ws - 1) / (iterations * ws)
    acc: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0] * 5))
    for direction, feature, option, raw, wire, enc, dec, ok in samples:
        if feature == "*":  # the regrouping cost, not a unit (regroup_cost)
            continue
        a = acc[(direction, feature)][option]
        a[0] += raw
        a[1] += wire
        a[2] += enc
        a[3] += dec
        a[4] += 0.0 if ok else 1.0
    units = []
    for (direction, feature), options in sorted(acc.items()):
        opts = tuple(
            Option(name, ratio=a[0] / a[1], encode_s=a[2] * scale, decode_s=a[3] * scale)
            for name, a in options.items()
            if a[4] == 0 and a[1] > 0
        )
        raw = next(iter(options.values()))[0] * scale
        units.append(Unit(f"{direction}/{feature}", direction, raw, opts))
    if dense_samples:
        per = 1.0 / (iterations * ws)
        d: dict[str, list[float]] = defaultdict(lambda: [0.0] * 4)
        for option, raw, wire, enc, dec in dense_samples:
            a = d[option]
            a[0] += raw
            a[1] += wire
            a[2] += enc
            a[3] += dec
        order = [o for o in AUTO_OPTIONS if o in d]
        units.append(
            Unit(
                "dense",
                "dense",
                d["none"][0] * per,
                tuple(Option(o, d[o][0] / d[o][1], d[o][2] * per, d[o][3] * per) for o in order),
            )
        )
    if input_samples:
        raw, wire, enc, dec = (sum(col) for col in zip(*input_samples, strict=True))
        per = input_dists / len(input_samples)  # per rank and batch
        coded = Option("ids", ratio=raw / wire, encode_s=enc * per, decode_s=dec * per)
        units.append(Unit("input", "input", raw * per, (Option("none"), coded)))
    return units


class StrategyController:
    """Runs the calibrate -> measure -> plan cycle of ``auto`` on every rank (step() is a
    collective at plan time), or replays a saved strategy."""

    def __init__(
        self,
        spec: StrategySpec,
        env: DistEnv,
        runtime: CompressionRuntime | None,
        dense: DenseComm | None,
        run_dir: Path,
        text: Any = None,
    ) -> None:
        self.spec, self.env, self.runtime, self.dense = spec, env, runtime, dense
        self.path = run_dir / "strategy.json"
        self.text = text  # TensorBoard's text(tag, value), rank 0
        self.plans: list[dict[str, Any]] = []
        self.replay: list[dict[str, Any]] = []
        self.link: Link | None = None
        self.topology: Topology | None = None  # several nodes: the two links, timed apart
        self.regroup = 0.0  # seconds per raw byte of mixing codecs within an all-to-all (calibrated)
        self.phase, self.phase_start = "idle", 0
        self.times: list[float] = []  # seconds of the iterations measured since the last event
        self.timed: list[int] = []  # and which iterations they were
        self._last = 0.0

    @property
    def active(self) -> bool:
        return self.runtime is not None or self.dense is not None

    # -- the cycle ------------------------------------------------------------------------------

    def start(self, iteration: int) -> None:
        """Before training (every rank): calibrate the link and begin calibrating the codecs, or
        load the strategy to replay."""
        if not self.active:
            return
        if self.spec.file:
            self.replay = json.loads(Path(self.spec.file).read_text())["plans"]
            for plan in self.replay:
                if plan["choice"] is not None and plan["from_iteration"] <= iteration:
                    self._apply(plan["choice"], iteration)
                elif plan["calibrated_from"] <= iteration:
                    self._apply_fallback(plan.get("fallback"))
            return
        self.topology = calibrate_topology(self.env)
        self.link = self.topology.inter if self.topology is not None else calibrate_link(self.env)
        if self.decided:  # resumed: the restored plan runs until the next re-plan
            self.plans = self.decided
            self.regroup = self.plans[-1].get("regroup_s_per_byte", 0.0)
            self.phase, self.phase_start = "run", iteration
        else:
            self._begin("calibrate", iteration)
        self._last = time.perf_counter()

    def step(self, iteration: int) -> None:
        """After iteration ``iteration`` (counted from 1) on every rank."""
        if not self.active:
            return
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        if self.spec.file:  # the saved run's codecs at the same iterations: its fallback while it calibrated
            for plan in self.replay:
                if plan["calibrated_from"] == iteration:
                    self._apply_fallback(plan.get("fallback"))
                if plan["choice"] is not None and plan["from_iteration"] == iteration:
                    self._apply(plan["choice"], iteration)
            return
        done = iteration - self.phase_start
        if self.phase == "calibrate" and done >= self.spec.calibrate_iterations:
            self._set_calibrating(False)
            self._begin("measure", iteration)
        elif self.phase == "measure":
            self.times.append(elapsed)
            self.timed.append(iteration)
            if done >= self.spec.measure_iterations:
                self._plan(iteration)
        elif self.phase == "run":
            self.times.append(elapsed)
            self.timed.append(iteration)
            if done >= self.spec.replan_every:  # a full re-plan: the codecs measured anew
                self._begin("calibrate", iteration)
            elif done % self.spec.measure_iterations == 0:
                # every rank must take the same decision: the check is a collective, held at
                # iterations every rank counts alike
                measured = self._slowest_recent()
                predicted = self.plans[-1]["predicted_iteration_ms"] / 1e3
                # predicted 0: the model gave the codecs it calibrated with the whole measured time
                drifted = predicted <= 0 or abs(measured / predicted - 1) > self.spec.drift
                if drifted or not self.plans[-1].get("settled", True):
                    log.info(
                        "strategy: %.1f ms per iteration against %.1f predicted%s; re-planning from the measured time",
                        1e3 * measured,
                        1e3 * predicted,
                        "" if drifted else " (the plan was timed on the first iterations)",
                    )
                    self._replan(iteration, measured)
        self._last = time.perf_counter()  # this step's own work is not the next iteration's

    def _begin(self, phase: str, iteration: int) -> None:
        if phase == "calibrate":
            self._finish_measurement()
            self._set_calibrating(True)
            # recorded now, decided later: a replay needs the fallback from here even if the run
            # ends before the plan
            self.plans.append(
                {"calibrated_from": iteration, "from_iteration": None, "choice": None, "fallback": self.fallback}
            )
            self._write()
        self.phase, self.phase_start, self.times, self.timed = phase, iteration, [], []

    def _set_calibrating(self, on: bool) -> None:
        if self.runtime is not None:
            self.runtime.calibrating = on
        if self.dense is not None:
            self.dense.calibrating = on
        if self.input is not None:
            self.input.calibrating = on
        if on:  # the defaults travel while every option is measured on the side
            self._apply_fallback()

    @property
    def fallback(self) -> dict[str, str]:
        """What travels while calibrating, per stage: the all-to-alls' bounded fallback codec and
        ``dense_comm.fallback``."""
        codecs = self.runtime.codecs if self.runtime is not None else {}
        out = {d: str(getattr(c.codec, "fallback", "")) for d, c in codecs.items()}
        if self.dense is not None:
            out["dense"] = self.dense.spec.fallback
        if self.input is not None:
            out["input"] = "none"  # raw, as TorchRec sends it
        return out

    @property
    def input(self) -> InputSwitch | None:
        """The input dists' switch (``compression.input: auto``), if the strategy decides it."""
        return None if self.runtime is None else self.runtime.input_switch

    def _apply_fallback(self, saved: Mapping[str, str] | None = None) -> None:
        """The defaults (the all-to-alls' fallback: an empty choice); ``saved``: a replayed plan's
        (a strategy.json without it is from before ``dense_comm.fallback``: the plain all-reduce)."""
        if self.runtime is not None:
            self.runtime.forward.choice, self.runtime.backward.choice = {}, {}
        if self.input is not None:
            self.input.coded = False
        if self.dense is not None:
            self.dense.mode = (saved or {}).get("dense", "none") if self.spec.file else self.dense.spec.fallback

    def _slowest_recent(self) -> float:
        """The slowest rank's median of its last ``measure_iterations`` iterations (a collective)."""
        median = statistics.median(self.times[-self.spec.measure_iterations :])
        recent = torch.tensor([median], dtype=torch.float64, device=collective_device())
        dist.all_reduce(recent, op=dist.ReduceOp.MAX)
        return float(recent)

    @property
    def decided(self) -> list[dict[str, Any]]:
        """The plans that were decided (not a calibration the run ended in)."""
        return [p for p in self.plans if p["choice"] is not None]

    def _finish_measurement(self) -> None:
        if self.phase == "run" and self.times:
            self.plans[-1]["measured_iteration_ms"] = 1e3 * statistics.median(self.times)
            self._write()

    # -- planning ---------------------------------------------------------------------------------

    def _collect(self) -> tuple[list[tuple], list[tuple], list[tuple]]:
        """Every rank's calibration samples: all-to-all, dense, input (a collective)."""
        mine: list[tuple] = []
        if self.runtime is not None:
            for d, c in self.runtime.codecs.items():
                mine += [(d, *s) for s in c.samples]
                c.samples.clear()
        dense = list(self.dense.samples) if self.dense is not None else []
        if self.dense is not None:
            self.dense.samples.clear()
        inputs = list(self.input.samples) if self.input is not None else []
        if self.input is not None:
            self.input.samples.clear()
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, (mine, dense, inputs))
        return (
            [s for g in gathered for s in g[0]],
            [s for g in gathered for s in g[1]],
            [s for g in gathered for s in g[2]],
        )

    def _plan(self, iteration: int) -> None:
        """After calibrating: decide from the new measurements (rank 0) and broadcast."""
        samples, dense_samples, input_samples = self._collect()
        decided: list[Any] = [None]
        if self.env.is_main:
            dists = self.input.dists if self.input is not None else 1
            units = _units(
                samples, dense_samples, self.spec.calibrate_iterations, self.env.world_size, input_samples, dists
            )
            self.regroup = regroup_cost(samples)
            # what the timed iterations ran (dct leaves buckets under its min_numel to the all-reduce)
            ran = {u.name: self.fallback[u.stage] for u in units}
            fallback = {u.name: ran[u.name] if any(x.name == ran[u.name] for x in u.options) else "none" for u in units}
            measured = statistics.median(self.times) if self.times else 0.0
            decided[0] = self._decide(iteration, units, measured, fallback, self.plans[-1]["calibrated_from"])
            # a run's first plan is timed on its first iterations (warm-up); later ones are not
            settled = bool(self.decided)
            decided[0].update(fallback=self.fallback, timed_iterations=list(self.timed), settled=settled)
        self._adopt(decided, iteration, replace=True)

    def _replan(self, iteration: int, measured: float) -> None:
        """After a drift: the same units, the compute re-calibrated from the iteration time the
        current plan measured (no codec calibration; cheap enough to do at once)."""
        self._finish_measurement()
        decided: list[Any] = [None]
        if self.env.is_main:
            last = self.plans[-1]
            units = [
                Unit(u["name"], u["stage"], u["raw_bytes"], tuple(Option(**o) for o in u["options"]))
                for u in last["units"]
            ]
            decided[0] = self._decide(iteration, units, measured, last["choice"], iteration)
            decided[0].update(
                fallback=self.fallback, timed_iterations=self.timed[-self.spec.measure_iterations :], settled=True
            )
        self._adopt(decided, iteration, replace=False)

    def _adopt(self, decided: list[Any], iteration: int, replace: bool) -> None:
        dist.broadcast_object_list(decided, src=0)
        if replace:
            self.plans[-1] = decided[0]
        else:
            self.plans.append(decided[0])
        self._apply(decided[0]["choice"], iteration)
        self._write()
        self._begin("run", iteration)

    def _decide(
        self, iteration: int, units: list[Unit], measured: float, measured_with: Mapping[str, str], calibrated_from: int
    ) -> dict[str, Any]:
        """The plan: compute = the measured iteration less what the model gives the options it ran
        with; then the greedy choice from uncompressed."""
        assert self.link is not None
        t0 = time.perf_counter()
        ws, regroup = self.env.world_size, self.regroup
        base = Timeline(self.link, ws, regroup_s_per_byte=regroup, topology=self.topology)
        modelled = simulate(units, measured_with, base).total
        timeline = Timeline(
            self.link, ws, between=max(measured - modelled, 0.0), regroup_s_per_byte=regroup, topology=self.topology
        )
        exact = {u.name: "none" for u in units}  # as Espresso: from uncompressed, a codec must pay for itself
        choice = choose(units, timeline, start=exact, min_gain=self.spec.min_gain)
        predicted = simulate(units, choice, timeline).total
        return {
            "calibrated_from": calibrated_from,
            "from_iteration": iteration,
            "choice": choice,
            "predicted_iteration_ms": 1e3 * predicted,
            "measured_iteration_ms": None,
            "decision_ms": 1e3 * (time.perf_counter() - t0),
            "link": {
                "bytes_per_s": self.link.bytes_per_s,
                "latency_s": self.link.latency_s,
                "burst_bytes": self.link.burst_bytes,
            },
            "topology": None if self.topology is None else _topology_record(self.topology),
            "compute_ms": 1e3 * timeline.between,
            "regroup_s_per_byte": regroup,
            "units": [
                {"name": u.name, "stage": u.stage, "raw_bytes": u.raw_bytes, "options": [asdict(o) for o in u.options]}
                for u in units
            ],
        }

    def _apply(self, choice: Mapping[str, str], iteration: int) -> None:
        log.info("strategy from iteration %d: %s", iteration, summary(choice))  # every rank's own log
        if self.runtime is not None:
            for d, c in self.runtime.codecs.items():
                c.choice = {name.split("/", 1)[1]: o for name, o in choice.items() if name.startswith(f"{d}/")}
        if self.dense is not None and "dense" in choice:
            self.dense.mode = choice["dense"]
        if self.input is not None:  # every rank at the same iteration: calls started from here on
            self.input.coded = choice.get("input") == "ids"

    def _write(self) -> None:
        if not self.env.is_main:
            return
        self.path.write_text(json.dumps({"plans": self.plans}, indent=1) + "\n")
        if self.text is not None and self.decided:
            plan = self.decided[-1]
            self.text(
                "strategy",
                f"from iteration {plan['from_iteration']}: {summary(plan['choice'])}, predicted "
                f"{plan['predicted_iteration_ms']:.1f} ms per iteration",
            )

    # -- results ----------------------------------------------------------------------------------

    def close(self) -> None:
        self._finish_measurement()

    def metrics(self) -> dict[str, Any]:
        """metrics.json's ``strategy`` (the last plan, summarised), predicted and measured ms."""
        if not self.active:
            return {}
        decided = self.decided or [p for p in self.replay if p["choice"] is not None]
        last = decided[-1] if decided else None
        if last is None:
            return {"strategy": "not decided (the run ended while calibrating)"}
        return {
            "strategy": summary(last["choice"]),
            "predicted_iteration_ms": last.get("predicted_iteration_ms"),
            "measured_iteration_ms": last.get("measured_iteration_ms"),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"plans": self.plans}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.plans = list(state.get("plans", []))
        if self.decided and not self.spec.file:
            self._apply(self.decided[-1]["choice"], self.decided[-1]["from_iteration"])


def _topology_record(t: Topology) -> dict[str, Any]:
    """strategy.json's ``topology``: ranks per node and each level's fitted link."""
    return {"ranks_per_node": t.ranks_per_node, "intra": asdict(t.intra), "inter": asdict(t.inter)}


def summary(choice: Mapping[str, str]) -> str:
    """``forward: lossy/zstd x20, fp16 x6; backward: ...; dense: dct; input: ids``."""
    parts = []
    for stage in ("forward", "backward"):
        counts: dict[str, int] = defaultdict(int)
        for name, o in choice.items():
            if name.startswith(f"{stage}/"):
                counts[o] += 1
        if counts:
            parts.append(f"{stage}: " + ", ".join(f"{o} x{n}" for o, n in sorted(counts.items(), key=lambda x: -x[1])))
    for stage in ("dense", "input"):
        if stage in choice:
            parts.append(f"{stage}: {choice[stage]}")
    return "; ".join(parts)
