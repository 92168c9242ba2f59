"""Choosing a codec per unit of traffic from a timeline model of one iteration (ByteComp/Espresso).

Pure arithmetic, no torch: the trainer measures the inputs on its own run (link latency and
bandwidth from timed collectives, each unit's ratio and codec time on real batches, the compute
time of an iteration) and hands them over as :class:`Unit` and :class:`Timeline`.

A *unit* is what can carry its own codec: a table in one direction of the embedding all-to-all
(``forward/cat_3``), the dense gradients (``dense``), or the input (KJT) all-to-all's ids
(``input``: raw or coded losslessly, ``ids``). Its *options* are the codecs allowed for
it (the caller has already removed those that could exceed the error bound), each with the wire
ratio and encode/decode seconds measured for it.

The timeline of one iteration, as Espresso models it (start = max(previous finish, ready); codec
time on the compute path delays everything after it)::

    compute: [before] [enc fwd] ....wait.... [dec fwd] [between] [enc bwd] ..wait.. [dec bwd] [after]  [dec dense]
    link:                       [fwd a2a]                                  [bwd a2a]    [dense all-reduce]

A stage whose tables use more than one codec also pays for gathering its chunk's columns by codec
and scattering them back (``regroup_s_per_byte``, measured), so mixing codecs must pay for itself.

The input all-to-all of the next batch runs a batch ahead (TorchRec's pipeline): its coding sits
on the compute path, and its link time counts only where the other collectives leave the link no
room (:func:`dlrm.performance.cost_model.exposed_input_dist`); the spans below leave it out.

The forward all-to-all starts when its units are encoded, and the model waits for it (TorchRec
needs the pooled rows to go on); so does the backward. The dense all-reduce starts when the
dense gradients are ready (their encode done) and overlaps the ``after`` compute (the end of the
backward, the optimizer), as DDP's buckets do; the iteration ends when both are done. The link
serves one collective at a time. The iteration's seconds are the cost model's
(:class:`dlrm.performance.cost_model.Breakdown` with ``compute_overlapped=after``): one model for the
cost model and the search.

:func:`choose` is Espresso's greedy search: units in descending size, each takes the option that
lowers the simulated iteration time most (or keeps the current one), so a codec is chosen only
where it pays for itself on this link; one option for a whole all-to-all stage is tried first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .cost_model import Breakdown, with_input
from .network import Collective, Link, Topology

STAGES = ("forward", "backward", "dense", "input")


@dataclass(frozen=True)
class Option:
    """One codec for a unit: its wire ratio (raw / wire) and seconds per iteration on the host."""

    name: str
    ratio: float = 1.0
    encode_s: float = 0.0
    decode_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.ratio > 0 or self.encode_s < 0 or self.decode_s < 0:
            raise ValueError(f"option {self.name!r}: ratio must be > 0 and codec times >= 0, got {self}")


@dataclass(frozen=True)
class Unit:
    """What travels with one codec: its stage (which collective), raw bytes per iteration, options."""

    name: str
    stage: str
    raw_bytes: float
    options: tuple[Option, ...]

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"unit {self.name!r}: stage must be one of {STAGES}, got {self.stage!r}")
        if not self.options:
            raise ValueError(f"unit {self.name!r} has no option")
        names = [o.name for o in self.options]
        if len(set(names)) != len(names):
            raise ValueError(f"unit {self.name!r}: options named twice in {names}")

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(f"unit {self.name!r} has no option {name!r}; it has {[o.name for o in self.options]}")


@dataclass(frozen=True)
class Timeline:
    """The calibrated iteration: the link, the ranks on it, and the compute around the collectives
    (seconds): ``before`` the forward all-to-all, ``between`` the two all-to-alls, ``after`` the
    backward all-to-all (which the dense all-reduce overlaps)."""

    link: Link
    ranks: int
    before: float = 0.0
    between: float = 0.0
    after: float = 0.0
    # seconds per raw byte of gathering a chunk's columns by codec and scattering them back:
    # paid by a whole all-to-all stage once its tables use more than one codec
    regroup_s_per_byte: float = 0.0
    # ranks in nodes (several nodes: intra- and inter-node links apart); None: every rank on ``link``
    topology: Topology | None = None

    @property
    def compute(self) -> float:
        return self.before + self.between + self.after

    def seconds(self, stage: str, wire_bytes: float) -> float:
        """A stage's collective of ``wire_bytes`` per rank: the all-to-alls pairwise, the dense
        gradients' ring (gloo's all-reduce and all-gather), each on the links it crosses (one
        node: every collective on ``link``)."""
        network = self.topology or Topology.one_level(self.link, self.ranks)
        pattern = "ring" if stage == "dense" else "pairwise"
        return network.seconds(Collective(pattern, wire_bytes), self.ranks)


@dataclass
class Simulation:
    """One simulated iteration: its total and when each collective ran."""

    total: float
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # stage -> (start, finish) on the link


def simulate(units: Iterable[Unit], choice: Mapping[str, str], t: Timeline) -> Simulation:
    """The iteration time of ``units`` with ``choice`` (unit name -> option name) on ``t``."""
    enc = dict.fromkeys(STAGES, 0.0)
    dec = dict.fromkeys(STAGES, 0.0)
    wire = dict.fromkeys(STAGES, 0.0)
    raw = dict.fromkeys(STAGES, 0.0)
    used: dict[str, set[str]] = {s: set() for s in STAGES}
    for u in units:
        o = u.option(choice[u.name])
        enc[u.stage] += o.encode_s
        dec[u.stage] += o.decode_s
        wire[u.stage] += u.raw_bytes / o.ratio
        raw[u.stage] += u.raw_bytes
        used[u.stage].add(o.name)
    for stage in ("forward", "backward"):
        if len(used[stage]) > 1:
            enc[stage] += t.regroup_s_per_byte * raw[stage]
            dec[stage] += t.regroup_s_per_byte * raw[stage]
    seconds = {stage: t.seconds(stage, wire[stage]) for stage in STAGES}
    iteration = Breakdown(
        compute=t.before + t.between,
        a2a_forward=seconds["forward"],
        a2a_backward=seconds["backward"],
        allreduce=seconds["dense"],
        codec_forward=enc["forward"] + dec["forward"],
        codec_backward=enc["backward"] + dec["backward"],
        codec_dense=enc["dense"] + dec["dense"],
        compute_overlapped=t.after,
    )
    iteration = with_input(iteration, seconds["input"], enc["input"] + dec["input"])
    # when each collective holds the link: every one waits for its inputs, the previous one is done
    spans: dict[str, tuple[float, float]] = {}
    clock = t.before
    for stage, compute_after in (("forward", t.between), ("backward", 0.0), ("dense", 0.0)):  # not the input
        clock += enc[stage]
        spans[stage] = (clock, clock + seconds[stage])
        clock += seconds[stage] + dec[stage] + compute_after
    return Simulation(iteration.total, spans)


def choose(
    units: Sequence[Unit], t: Timeline, start: Mapping[str, str] | None = None, min_gain: float = 0.0
) -> dict[str, str]:
    """Espresso's greedy: from ``start`` (default: every unit's first option), visit the units in
    descending raw size and give each the option with the lowest simulated iteration time; an
    option replaces the current one only if it is strictly faster. Before that, every stage of the
    all-to-all is tried with one option for all its tables (a move table by table would pay the
    stage's regrouping cost alone and never be taken). The plan found replaces ``start`` only if it
    is at least ``min_gain`` (a fraction) faster: a gain inside the model's error is not one."""
    initial = {u.name: (start or {}).get(u.name, u.options[0].name) for u in units}
    choice = dict(initial)
    best = start_total = simulate(units, choice, t).total
    for stage in ("forward", "backward"):
        members = [u for u in units if u.stage == stage]
        shared = set.intersection(*({o.name for o in u.options} for u in members)) if members else set()
        for name in sorted(shared):
            trial = {**choice, **{u.name: name for u in members}}
            total = simulate(units, trial, t).total
            if total < best:
                best, choice = total, trial
    for u in sorted(units, key=lambda u: (-u.raw_bytes, u.name)):
        for o in u.options:
            trial = {**choice, u.name: o.name}
            total = simulate(units, trial, t).total
            if total < best:
                best, choice = total, trial
    return choice if best <= (1.0 - min_gain) * start_total else initial
