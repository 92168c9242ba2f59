"""The ``compression`` and ``policy`` groups as a component: our sharders (or TorchRec's QComms),
the bound policy, and the runtime every compressed dist shares (codec state and row caches)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from dlrm.embedding_comm import compression_runtime, make_sharders, parse_compression_cfg
from dlrm.embedding_comm.config import excluded_sharding_types
from dlrm.embedding_comm.dist import CompressionRuntime
from dlrm.embedding_comm.policy import TableStats, TrainingBound, policy_for_run
from dlrm.trainer.component import Component, Sharding
from dlrm.trainer.loop import StepObserver
from dlrm.trainer.sharding import check_supported

log = logging.getLogger("dlrm.train")


class EmbeddingCompression(Component):
    def __init__(
        self,
        cfg: Mapping[str, Any],
        policy_cfg: Mapping[str, Any],
        sharding_cfg: Mapping[str, Any],
        tables: Sequence[TableStats],
        fused_params: dict[str, Any] | None,
    ) -> None:
        self.cfg, self.sharding_cfg, self.fused_params = cfg, sharding_cfg, fused_params
        self.spec = parse_compression_cfg(cfg)
        self.policy = policy_for_run(policy_cfg, self.spec, tables)
        self.runtime: CompressionRuntime | None = None  # None on TorchRec's QComms path
        # the policy as the dists ask it, told by the loop when training segments start and end
        self.bound = TrainingBound(self.policy) if self.policy is not None else None

    @property
    def observers(self) -> list[StepObserver]:
        return [self.bound] if self.bound is not None else []

    def shard(self, sharding: Sharding) -> None:
        bound = self.bound
        sharders = make_sharders(
            self.cfg, bound_fn_forward=bound, bound_fn_backward=bound, fused_params=self.fused_params
        )
        self.runtime = compression_runtime(sharders)
        check_supported(self.sharding_cfg, self.spec.sharding_types, excluded_sharding_types(self.spec))
        sharding.sharders.extend(sharders)

    def validated(self, values: Mapping[str, float | None], iteration: int) -> None:
        """A validation pass's AUC to the policy's plateau rules (every rank: the same AUC, the same bounds)."""
        if self.policy is not None:
            levels = self.policy.validated(values.get("eval/auc"))
            if levels:
                log.info("iteration %d: plateau levels of the bounds %s", iteration, levels)

    @property
    def parts(self) -> Mapping[str, Stateful]:
        both: dict[str, Stateful | None] = {"policy": self.policy, "compression": self.runtime}
        return {name: part for name, part in both.items() if part is not None}
