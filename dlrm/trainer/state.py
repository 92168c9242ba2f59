"""The vocabulary of checkpoint state: :class:`PerRank` (a rank's own state, beside the state every
rank shares), the random streams as plain data, and :class:`CheckpointError`. Everything a part
saves must survive ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


class CheckpointError(RuntimeError):
    pass


class PerRank:
    """Marks a :class:`Stateful` whose state is this rank's own (saved under ``<part>.rank<r>``);
    any other Stateful holds the same on every rank (saved once, under ``<part>.shared``)."""


def numpy_rng_state(state: Any) -> list[Any]:
    """``np.random.RandomState.get_state()`` as plain data (its key array as an int64 tensor)."""
    name, keys, pos, has_gauss, cached = state
    return [str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def numpy_rng_tuple(state: list[Any]) -> tuple[Any, ...]:
    """The inverse of :func:`numpy_rng_state`, for ``set_state``."""
    name, keys, pos, has_gauss, cached = state
    return (name, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached)


class RngState(PerRank):
    """This rank's random streams: torch (CPU, and every CUDA device once CUDA is initialised),
    numpy and Python's."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": numpy_rng_state(np.random.get_state()),
            "python": [version, list(internal), gauss],
        }
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "torch" not in state:
            raise CheckpointError("it holds no random streams of this rank (written by an older version)")
        torch.set_rng_state(state["torch"].cpu())
        np.random.set_state(numpy_rng_tuple(state["numpy"]))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state:
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
