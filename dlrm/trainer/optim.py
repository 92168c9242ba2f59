"""Optimizers: a fused embedding optimizer applied in backward, a dense optimizer, an LR schedule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

SPARSE_OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}
DENSE_OPTIMIZERS = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def _kwargs(name: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"lr": float(cfg["lr"])}
    if name in ("adagrad", "rowwise_adagrad", "adam"):
        kwargs["eps"] = float(cfg.get("eps", 1e-8))
    return kwargs


def apply_sparse_optimizer(model: torch.nn.Module, cfg: Mapping[str, Any]) -> None:
    """Attach the embedding optimizer to the (unsharded) tables; TorchRec fuses it into the kernel."""
    name = cfg["sparse"]["name"]
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"optimizer.sparse.name must be one of {sorted(SPARSE_OPTIMIZERS)} (got {name!r})")
    params = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    apply_optimizer_in_backward(SPARSE_OPTIMIZERS[name], params, _kwargs(name, cfg["sparse"]))


def build_optimizer(
    model: torch.nn.Module, cfg: Mapping[str, Any], extra: Sequence[KeyedOptimizer] = ()
) -> CombinedOptimizer:
    """The sharded model's fused optimizer combined with the dense one (one object to step/save);
    ``extra`` optimizers (e.g. of replicated hot rows) own their parameters, the dense one the rest."""
    name = cfg["dense"]["name"]
    if name not in DENSE_OPTIMIZERS:
        raise ValueError(f"optimizer.dense.name must be one of {sorted(DENSE_OPTIMIZERS)} (got {name!r})")
    dense_cls, kwargs = DENSE_OPTIMIZERS[name], _kwargs(name, cfg["dense"])
    owned = {id(p) for o in extra for p in o.params.values()}
    dense = KeyedOptimizerWrapper(
        {n: p for n, p in in_backward_optimizer_filter(model.named_parameters()) if id(p) not in owned},
        lambda params: dense_cls(params, **kwargs),
    )
    return CombinedOptimizer([model.fused_optimizer, dense, *extra])


class WarmupDecayLR:
    """DLRM's schedule: linear warmup, constant, then polynomial (power 2) decay to zero.

    Scales every param group (fused embedding groups included) from its base LR. The state is
    the step count alone, so it checkpoints as an int.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, warmup_steps: int = 0, decay_start: int = 0, decay_steps: int = 0
    ) -> None:
        self.optimizer = optimizer
        self.warmup_steps, self.decay_start, self.decay_steps = warmup_steps, decay_start, decay_steps
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.step_count = 0
        self._apply()

    def factor(self, step: int) -> float:
        """The LR factor of the iteration after ``step`` optimizer steps (DLRM counts it from 1)."""
        s = step + 1
        if self.warmup_steps and s < self.warmup_steps:
            return s / self.warmup_steps
        if self.decay_steps and s >= self.decay_start:
            done = min(s - self.decay_start, self.decay_steps)
            return (1 - done / self.decay_steps) ** 2
        return 1.0

    def _apply(self) -> None:
        f = self.factor(self.step_count)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * f

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, int]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.step_count = int(state["step_count"])
        self._apply()
