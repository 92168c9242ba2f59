"""The `precision` config group: the storage type of the embedding tables and the compute type of
the dense part (bottom MLP, interaction, top MLP) in training, and the table bytes each rank holds.

* ``embeddings: fp32 | fp16``: TorchRec's ``data_type`` of every table, so FBGEMM's fused kernel
  stores the rows in that type and updates them in place (the row-wise Adagrad state stays fp32).
  We ask FBGEMM for stochastic rounding of the fp16 updates (``stochastic_rounding``, used by its
  CUDA kernel); its CPU kernel rounds to nearest whatever the flag (measured with
  fbgemm-gpu-cpu 1.8.0: an update under half an fp16 step never moves a row). fp16 tables stay
  out of TorchRec's data-parallel sharding: those are plain fp16 parameters outside the fused
  kernel, and with them the loss turned NaN within 40 iterations (2 ranks, synthetic data).
* ``dense: fp32 | bf16``: the MLPs and the interaction run under ``torch.autocast`` in bf16 on
  fp32 master weights; the embedding lookups and the loss stay fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_configs import DataType

from dlrm.process.config_checks import check_keys, one_of, plain_config
from dlrm.process.timeout import named_collective

EMBEDDING_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}
DENSE_TYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionSpec:
    """A validated `precision` config."""

    embeddings: str = "fp32"
    dense: str = "fp32"

    @property
    def data_type(self) -> DataType:
        return EMBEDDING_TYPES[self.embeddings]

    @property
    def fused_only(self) -> bool:
        """Whether every table must live in FBGEMM's fused kernel (fp16 tables: see the module doc)."""
        return self.embeddings != "fp32"

    @property
    def fused_params(self) -> dict[str, Any] | None:
        """FBGEMM options of the tables' fused kernel (None: TorchRec's defaults)."""
        return {"stochastic_rounding": True} if self.embeddings == "fp16" else None

    @property
    def dense_dtype(self) -> torch.dtype | None:
        """The autocast type of the dense part (None: plain fp32)."""
        return DENSE_TYPES[self.dense]


def parse_precision_cfg(cfg: Mapping[str, Any] | None) -> PrecisionSpec:
    """The `precision` group as a :class:`PrecisionSpec` (absent: fp32 everywhere)."""
    cfg = plain_config(cfg) or {}
    check_keys(cfg, {"embeddings", "dense"}, "precision")
    d = PrecisionSpec()
    return PrecisionSpec(
        embeddings=one_of(cfg, "embeddings", "precision", sorted(EMBEDDING_TYPES), d.embeddings),
        dense=one_of(cfg, "dense", "precision", sorted(DENSE_TYPES), d.dense),
    )


def embedding_bytes(model: torch.nn.Module) -> int:
    """Bytes of the embedding-table rows this rank holds (its shards; replicated tables whole; the
    replicas of hot rows, dlrm/placement/hot_rows.py)."""
    total = 0
    for name, tensor in model.state_dict().items():
        if "embedding_bags" not in name and ".hot.weights." not in name:
            continue
        if isinstance(tensor, ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in tensor.local_shards())
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def embedding_bytes_per_rank(model: torch.nn.Module) -> list[int]:
    """:func:`embedding_bytes` of every rank, in rank order (a collective: every rank calls it)."""
    mine = embedding_bytes(model)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    with named_collective("the all-gather of every rank's embedding bytes"):
        dist.all_gather_object(gathered, mine)
    return [int(b) for b in gathered]
