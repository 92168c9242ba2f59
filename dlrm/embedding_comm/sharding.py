"""Sharding subclasses whose ``create_output_dist`` returns a compressed dist (inputs and lookups stock).

The runtime (codecs, policies) arrives through ``qcomm_codecs_registry[REGISTRY_KEY]``, the one
channel TorchRec passes from the sharder to every sharding, including resharding.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding

from dlrm.embedding_comm.dist import (
    REGISTRY_KEY,
    CompressedRwPooledEmbeddingDist,
    CompressedTwPooledEmbeddingDist,
    CompressedTwRwPooledEmbeddingDist,
    CompressionRuntime,
)


def runtime_of(sharding: Any) -> CompressionRuntime:
    """The runtime the sharder put in the sharding's registry (a clear error when it is missing)."""
    registry = sharding.qcomm_codecs_registry or {}
    runtime = registry.get(REGISTRY_KEY)
    if not isinstance(runtime, CompressionRuntime):
        raise ValueError(
            f"{type(sharding).__name__}: qcomm_codecs_registry has no {REGISTRY_KEY!r} "
            "entry; build the sharder with dlrm.embedding_comm.make_sharders"
        )
    return runtime


def feature_tables(groups_per_rank: Any) -> dict[str, str]:
    """embedding (feature) name -> table name, for error messages."""
    return {
        name: table.name
        for groups in groups_per_rank
        for g in groups
        for table in g.embedding_tables
        for name in table.embedding_names
    }


def _names_per_rank(sharding: Any) -> list[list[str]]:
    return [[n for g in groups for n in g.embedding_names()] for groups in sharding._grouped_embedding_configs_per_rank]


def _pooled_a2a_dist(
    sharding: Any, device: torch.device | None, where: str, callbacks: list | None = None
) -> CompressedTwPooledEmbeddingDist:
    """The compressed pooled all-to-all of a table- or column-wise ``sharding``."""
    assert sharding._pg is not None
    return CompressedTwPooledEmbeddingDist(
        pg=sharding._pg,
        dim_sum_per_rank=sharding._dim_sum_per_rank(),
        emb_dim_per_rank_per_feature=sharding._emb_dim_per_rank_per_feature(),
        embedding_names_per_rank=_names_per_rank(sharding),
        runtime=runtime_of(sharding),
        keys_per_rank=sharding.features_per_rank(),
        device=device if device is not None else sharding._device,
        callbacks=callbacks,
        where=where,
        feature_tables=feature_tables(sharding._grouped_embedding_configs_per_rank),
    )


class CompressedTwPooledEmbeddingSharding(TwPooledEmbeddingSharding):
    """Table-wise sharding with a compressed output dist."""

    def create_output_dist(self, device: torch.device | None = None) -> CompressedTwPooledEmbeddingDist:
        return _pooled_a2a_dist(self, device, "table_wise")


class CompressedCwPooledEmbeddingSharding(CwPooledEmbeddingSharding):
    """Column-wise sharding with a compressed output dist (keeps TorchRec's column-stitching callback)."""

    _where = "column_wise"

    def create_output_dist(self, device: torch.device | None = None) -> CompressedTwPooledEmbeddingDist:
        stock = super().create_output_dist(device)  # only to reuse its permute callback; sends nothing
        return _pooled_a2a_dist(self, device, self._where, list(stock._callbacks or []))


class CompressedTwCwPooledEmbeddingSharding(CompressedCwPooledEmbeddingSharding, TwCwPooledEmbeddingSharding):
    """Table-column-wise sharding with a compressed output dist."""

    _where = "table_column_wise"


class CompressedRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """Row-wise sharding: compressed all-to-all + local sum instead of the reduce-scatter."""

    def create_output_dist(self, device: torch.device | None = None) -> CompressedRwPooledEmbeddingDist:
        assert self._pg is not None
        return CompressedRwPooledEmbeddingDist(
            self._pg,
            embedding_names=self.embedding_names(),
            embedding_dims=self.embedding_dims(),
            runtime=runtime_of(self),
            feature_tables=feature_tables([self._grouped_embedding_configs]),
        )


class CompressedTwRwPooledEmbeddingSharding(TwRwPooledEmbeddingSharding):
    """Table-row-wise sharding: compressed intra-node reduce-scatter and cross-node all-to-all."""

    def create_output_dist(self, device: torch.device | None = None) -> CompressedTwRwPooledEmbeddingDist:
        names_per_node = [
            [n for g in groups for n in g.embedding_names()] for groups in self._grouped_embedding_configs_per_node
        ]
        return CompressedTwRwPooledEmbeddingDist(
            rank=self._rank,
            cross_pg=self._cross_pg,
            intra_pg=self._intra_pg,
            dim_sum_per_node=self._dim_sum_per_node(),
            emb_dim_per_node_per_feature=self._emb_dim_per_node_per_feature(),
            embedding_names_per_node=names_per_node,
            runtime=runtime_of(self),
            device=device if device is not None else self._device,
            feature_tables=feature_tables(self._grouped_embedding_configs_per_node),
        )


COMPRESSED_SHARDINGS = {
    "table_wise": CompressedTwPooledEmbeddingSharding,
    "column_wise": CompressedCwPooledEmbeddingSharding,
    "table_column_wise": CompressedTwCwPooledEmbeddingSharding,
    "row_wise": CompressedRwPooledEmbeddingSharding,
    "table_row_wise": CompressedTwRwPooledEmbeddingSharding,
}
