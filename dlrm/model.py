"""Build the DLRM-family model (torchrec.models) from the model config and the dataset's tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig


def table_names(feature_names: Sequence[str]) -> list[str]:
    """One table per categorical feature, named ``t_<feature>`` as in TorchRec's DLRM example."""
    return [f"t_{name}" for name in feature_names]


def embedding_configs(
    feature_names: Sequence[str], num_embeddings: Sequence[int], dim: int
) -> list[EmbeddingBagConfig]:
    """The table of each feature (see :func:`table_names`)."""
    return [
        EmbeddingBagConfig(name=table, embedding_dim=dim, num_embeddings=int(n), feature_names=[name])
        for table, name, n in zip(table_names(feature_names), feature_names, num_embeddings, strict=True)
    ]


def build_model(
    cfg: Mapping[str, Any], feature_names: Sequence[str], num_embeddings: Sequence[int], num_dense: int
) -> DLRMTrain:
    """The unsharded model with its embedding tables on the meta device (DMP materializes shards)."""
    dim = int(cfg["embedding_dim"])
    dense_sizes = list(cfg["dense_arch_layer_sizes"])
    if dense_sizes[-1] != dim:
        raise ValueError(f"model.dense_arch_layer_sizes must end with model.embedding_dim ({dim}), got {dense_sizes}")
    ebc = EmbeddingBagCollection(
        tables=embedding_configs(feature_names, num_embeddings, dim), device=torch.device("meta")
    )
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=dense_sizes,
        over_arch_layer_sizes=list(cfg["over_arch_layer_sizes"]),
    )
    arch = cfg["arch"]
    if arch == "dlrm":
        module = DLRM(**common)
    elif arch == "dcnv2":
        module = DLRM_DCN(
            **common, dcn_num_layers=int(cfg["dcn_num_layers"]), dcn_low_rank_dim=int(cfg["dcn_low_rank_dim"])
        )
    else:
        raise ValueError(f"model.arch must be 'dlrm' or 'dcnv2' (got {arch!r})")
    return DLRMTrain(module)
