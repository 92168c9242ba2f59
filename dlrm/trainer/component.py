"""The one interface every feature of a run presents to the trainer.

Each feature (embedding compression, dense-gradient communication, the automatic strategy,
placement and hot rows, precision, telemetry) is built from its config group by its own package's
``component.py`` into a :class:`Component`. ``dlrm.train.run`` builds them in order and asks each
the same things, so a new feature adds a component, not lines in ``run()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from dlrm.trainer.loop import StepObserver, TrainState


@dataclass
class Sharding:
    """What components add at sharding time: sharders, the dense part's DDP wrapper, a planner,
    and whether the tables must be FBGEMM-fused kernels."""

    sharders: list[Any] = field(default_factory=list)
    data_parallel_wrapper: Any = None
    planner: Any = None
    fused_only: bool = False

    @property
    def options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`dlrm.trainer.sharding.shard_model` beside the sharders."""
        return {
            "data_parallel_wrapper": self.data_parallel_wrapper,
            "fused_only": self.fused_only,
            "planner": self.planner,
        }


class Component:
    """A feature of the run. ``shard``: what it adds at sharding time; ``parts``: its checkpoint
    state (named Stateful objects; a component with nothing to save has none); ``observers``: it
    watches training steps; ``validated``: a validation pass's metrics (``eval/<key>``, the same on
    every rank); ``metrics``: its metrics.json keys, asked once on every rank at the end (a
    collective allowed); ``close``: training is over."""

    def shard(self, sharding: Sharding) -> None:
        return

    @property
    def parts(self) -> Mapping[str, Stateful]:
        return {}

    @property
    def observers(self) -> list[StepObserver]:
        return []

    def validated(self, values: Mapping[str, float | None], iteration: int) -> None:
        return

    def metrics(self, model: torch.nn.Module, state: TrainState) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return


def checkpoint_parts(components: Iterable[Component], **own: Stateful) -> dict[str, Stateful]:
    """The trainer's ``own`` parts and every component's, in component order; a name taken twice is a bug."""
    out: dict[str, Stateful] = {}
    for name, part in [*own.items(), *((n, p) for c in components for n, p in c.parts.items())]:
        if name in out:
            raise ValueError(f"two checkpoint parts are named {name!r}")
        out[name] = part
    return out
