"""The compressed sharded EBC and its sharder (mirror ``torchrec.distributed.embeddingbag``).

:class:`CompressedShardedEmbeddingBagCollection` builds compressed shardings and hands ids to
their dists: the KJT each rank sends in the input all-to-all (its own samples, for decoding what
comes back) and the KJT each rank receives (its tables' bags, for encoding) are stashed on the
sharding context, which TorchRec carries from ``input_dist`` to ``compute_and_output_dist``
(also across ``TrainPipelineSparseDist`` stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import EmbeddingSharding, EmbeddingShardingInfo
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.types import Awaitable, LazyAwaitable, ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm.embedding_comm.config import ALL_SHARDING_TYPES
from dlrm.embedding_comm.dist import REGISTRY_KEY, CompressedDist, CompressionRuntime
from dlrm.embedding_comm.input_dist import CompressedKJTAllToAll, stock_input_bytes
from dlrm.embedding_comm.sharding import COMPRESSED_SHARDINGS
from dlrm.embedding_comm.stats import CommStats


class CompressedShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """Sharded EBC whose TW/CW/TWCW/RW/TWRW output dists go through the compressor (DP is stock)."""

    @classmethod
    def create_embedding_bag_sharding(
        cls,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        runtime = (qcomm_codecs_registry or {}).get(REGISTRY_KEY)
        if runtime is None or sharding_type == "data_parallel":  # DP has no output all-to-all
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry
            )
        if sharding_type not in COMPRESSED_SHARDINGS:
            tables = [i.embedding_config.name for i in sharding_infos]
            raise ValueError(
                f"tables {tables}: sharding type {sharding_type!r} has no compressed dist; "
                f"use one of {sorted(COMPRESSED_SHARDINGS)} or data_parallel"
            )
        if device is not None and device.type == "meta":
            replace_placement_with_meta_device(sharding_infos)
        kwargs: dict[str, Any] = {"qcomm_codecs_registry": qcomm_codecs_registry}
        if sharding_type in ("column_wise", "table_column_wise"):
            kwargs["permute_embeddings"] = permute_embeddings
        return COMPRESSED_SHARDINGS[sharding_type](sharding_infos, env, device, **kwargs)

    # -- ids for the dists --------------------------------------------------------------------

    def _create_input_dist(self, input_feature_names: list[str]) -> None:
        super()._create_input_dist(input_feature_names)
        self._pre_a2a_kjts: list[KeyedJaggedTensor | None] = [None] * len(self._input_dists)
        runtime = (self._qcomm_codecs_registry or {}).get(REGISTRY_KEY)
        codec = runtime.input_codec if isinstance(runtime, CompressionRuntime) else None
        switch = runtime.input_switch if isinstance(runtime, CompressionRuntime) else None
        for i, input_dist in enumerate(self._input_dists):
            input_dist.register_forward_pre_hook(self._stash_hook(i))
            for m in list(input_dist.modules()):
                for name, child in list(m.named_children()):
                    if type(child) is KJTAllToAll and codec is not None:  # compression.input: ids or auto
                        coded = CompressedKJTAllToAll.from_stock(child, codec, self.input_stats, switch)
                        setattr(m, name, coded)
                    elif type(child) is KJTAllToAll:
                        child.register_forward_pre_hook(self._count_input)

    @property
    def input_stats(self) -> CommStats:
        """``input/wire_bytes`` and ``input/calls``: what this module's KJT all-to-alls send."""
        if not hasattr(self, "_input_stats"):
            self._input_stats = CommStats()
        return self._input_stats

    def _count_input(self, module: KJTAllToAll, args: tuple) -> None:
        """Bytes this rank's stock KJT all-to-all sends to other ranks (the coded one counts its own)."""
        if module._pg.size() == 1:
            return
        self.input_stats.add("input/wire_bytes", stock_input_bytes(module._pg, module._splits, args[0]))
        self.input_stats.add("input/calls", 1)

    def _stash_hook(self, i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self._pre_a2a_kjts[i] = args[0]  # the KJT this rank sends: its own samples

        return hook

    def input_dist(
        self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KJTList]]:
        runtime = (self._qcomm_codecs_registry or {}).get(REGISTRY_KEY)
        if isinstance(runtime, CompressionRuntime) and runtime.input_switch is not None:
            # evaluation batches are no calibration samples; TorchRec keeps the input dists in a
            # plain list, so eval() never reaches them: they learn it here
            runtime.input_switch.training = self.training
        first = len(ctx.sharding_contexts)
        out = super().input_dist(ctx, features)
        for i, sharding_ctx in enumerate(ctx.sharding_contexts[first:]):
            sharding_ctx.pre_a2a_kjt = self._pre_a2a_kjts[i]
        self._pre_a2a_kjts = [None] * len(self._pre_a2a_kjts)  # the context holds them now
        return out

    def _stash_post_a2a(self, ctx: EmbeddingBagCollectionContext, dist_input: Sequence[KeyedJaggedTensor]) -> None:
        for sharding_ctx, kjt in zip(ctx.sharding_contexts, dist_input, strict=True):
            sharding_ctx.post_a2a_kjt = kjt  # the bags of our tables, by source rank then sample

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> list[torch.Tensor]:
        self._stash_post_a2a(ctx, dist_input)
        return super().compute(ctx, dist_input)

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input: KJTList) -> LazyAwaitable[KeyedTensor]:
        self._stash_post_a2a(ctx, input)
        return super().compute_and_output_dist(ctx, input)

    def compressed_dists(self) -> list[CompressedDist]:
        """The compressed output dists of this module (TorchRec keeps them in a plain list)."""
        return [d for d in self._output_dists if isinstance(d, CompressedDist)]


class CompressedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """EBC sharder that builds :class:`CompressedShardedEmbeddingBagCollection`; allows RW/TWRW on CPU."""

    def __init__(
        self,
        runtime: CompressionRuntime,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        sharding_types: Sequence[str] = ALL_SHARDING_TYPES,
    ) -> None:
        registry: dict[str, Any] = dict(qcomm_codecs_registry or {})
        registry[REGISTRY_KEY] = runtime
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=registry)
        self.runtime = runtime
        self._allowed = list(sharding_types)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """Every type with a compressed dist (RW/TWRW included on CPU: gloo runs them), plus DP."""
        return list(self._allowed)

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> CompressedShardedEmbeddingBagCollection:
        return CompressedShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )

    @property
    def sharded_module_type(self) -> type[CompressedShardedEmbeddingBagCollection]:
        return CompressedShardedEmbeddingBagCollection


class StockEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's own sharder (QComms or plain), only with the same sharding-type choice as ours."""

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
        sharding_types: Sequence[str] = ALL_SHARDING_TYPES,
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._allowed = list(sharding_types)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """The configured types (TorchRec's stock CPU list lacks RW/TWRW, which gloo runs fine)."""
        return list(self._allowed)
