"""Build the DLRM-family model (torchrec.models) from the model config and the dataset's tables."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingBagCollectionInterface


def table_names(feature_names: Sequence[str]) -> list[str]:
    """One table per categorical feature, named ``t_<feature>`` as in TorchRec's DLRM example."""
    return [f"t_{name}" for name in feature_names]


def embedding_configs(
    feature_names: Sequence[str], num_embeddings: Sequence[int], dim: int, data_type: DataType = DataType.FP32
) -> list[EmbeddingBagConfig]:
    """The table of each feature (see :func:`table_names`), its rows stored as ``data_type``."""
    return [
        EmbeddingBagConfig(
            name=table, embedding_dim=dim, num_embeddings=int(n), feature_names=[name], data_type=data_type
        )
        for table, name, n in zip(table_names(feature_names), feature_names, num_embeddings, strict=True)
    ]


def build_dlrm(cfg: Mapping[str, Any], ebc: EmbeddingBagCollectionInterface, num_dense: int) -> DLRM:
    """The model config's architecture over the tables of ``ebc`` (a training or a quantized EBC)."""
    dim = int(cfg["embedding_dim"])
    dense_sizes = list(cfg["dense_arch_layer_sizes"])
    if dense_sizes[-1] != dim:
        raise ValueError(f"model.dense_arch_layer_sizes must end with model.embedding_dim ({dim}), got {dense_sizes}")
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=dense_sizes,
        over_arch_layer_sizes=list(cfg["over_arch_layer_sizes"]),
    )
    arch = cfg["arch"]
    if arch == "dlrm":
        return DLRM(**common)
    if arch == "dcnv2":
        return DLRM_DCN(
            **common, dcn_num_layers=int(cfg["dcn_num_layers"]), dcn_low_rank_dim=int(cfg["dcn_low_rank_dim"])
        )
    raise ValueError(f"model.arch must be 'dlrm' or 'dcnv2' (got {arch!r})")


@contextlib.contextmanager
def dense_autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """``torch.autocast`` to ``dtype`` on ``device_type`` (nothing when ``dtype`` is None)."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=dtype):
        yield


def dense_logits(
    model: DLRM, dense_features: torch.Tensor, sparse: Any, dtype: torch.dtype | None, device_type: str
) -> torch.Tensor:
    """DLRM's forward with its dense part (bottom MLP, interaction, top MLP) under autocast to
    ``dtype`` on ``device_type`` and the embedding lookups outside it; fp32 logits of shape [B]."""
    with dense_autocast(device_type, dtype):
        dense = model.dense_arch(dense_features)
    embedded = model.sparse_arch(sparse)
    with dense_autocast(device_type, dtype):
        logits = model.over_arch(model.inter_arch(dense_features=dense, sparse_features=embedded))
    return logits.squeeze(-1).float()


class MixedPrecisionDLRMTrain(DLRMTrain):
    """TorchRec's DLRMTrain whose dense part computes in ``dense_dtype`` (bf16 autocast on fp32
    master weights); same parameters and state-dict keys as DLRMTrain, and its forward when
    ``dense_dtype`` is None. ``device_type`` is fixed here, not read from the batch: TorchRec's
    pipeline traces this forward with torch.fx, where a tensor's device is not known."""

    def __init__(self, module: DLRM, dense_dtype: torch.dtype | None = None, device_type: str = "cpu") -> None:
        super().__init__(module)
        self.dense_dtype, self.device_type = dense_dtype, device_type

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        if self.dense_dtype is None:
            return super().forward(batch)
        logits = dense_logits(
            self.model, batch.dense_features, batch.sparse_features, self.dense_dtype, self.device_type
        )
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_model(
    cfg: Mapping[str, Any],
    feature_names: Sequence[str],
    num_embeddings: Sequence[int],
    num_dense: int,
    data_type: DataType = DataType.FP32,
    dense_dtype: torch.dtype | None = None,
    device_type: str = "cpu",
    table_device: torch.device | str = "meta",
) -> MixedPrecisionDLRMTrain:
    """The unsharded model for ``device_type`` (cpu or cuda); its tables on the meta device by
    default (DMP materializes the shards)."""
    dim = int(cfg["embedding_dim"])
    ebc = EmbeddingBagCollection(
        tables=embedding_configs(feature_names, num_embeddings, dim, data_type), device=torch.device(table_device)
    )
    return MixedPrecisionDLRMTrain(build_dlrm(cfg, ebc, num_dense), dense_dtype, device_type)
