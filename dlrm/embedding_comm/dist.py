"""Compressed output dists, one per TorchRec pooled dist they replace (same names, ``Compressed`` prefix).

* :class:`CompressedTwPooledEmbeddingDist` - table/column-wise (replaces ``TwPooledEmbeddingDist``).
* :class:`CompressedRwPooledEmbeddingDist` - row-wise: a compressed all-to-all plus a local sum in
  place of the reduce-scatter, a compressed all-to-all in place of the backward all-gather.
* :class:`CompressedTwRwPooledEmbeddingDist` - table-row-wise: the row-wise scheme inside the node,
  then the table-wise scheme across nodes.

Each keeps the identity of its tables (feature names and widths per rank), its own statistics and
the training-iteration count it hands to the bound policies. On one rank they bypass everything.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.dist_data import PooledEmbeddingsAwaitable
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable, NoWait

from dlrm.embedding_comm.cache_probe import CacheProbe
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.codec_stages import Calibration, DuplicateIds, ForwardPositions
from dlrm.embedding_comm.comm_ops import (
    Blocks,
    CompressedA2AInfo,
    PooledA2ALayout,
    ReduceScatterLayout,
    compressed_all_to_all,
)
from dlrm.embedding_comm.forward_cache import CacheStage, ForwardCache
from dlrm.embedding_comm.ids import PendingIds, Region, pending_ids
from dlrm.embedding_comm.input_switch import InputSwitch
from dlrm.embedding_comm.stage import Stage
from dlrm.embedding_comm.stats import CommStats
from dlrm.trainer.state import PerRank
from dlrm_compression.ids_codec import IdsCodec

# Key under which the sharder hands the runtime to the shardings through TorchRec's
# qcomm_codecs_registry (create_embedding_bag_sharding is a classmethod: no instance state). The
# planner and the stock dists only read the CommOp keys and ignore this one.
REGISTRY_KEY = "DLRM_COMPRESSED_POOLED_EMBEDDINGS"


@dataclass
class CompressionRuntime(PerRank):
    """What every compressed dist of a sharder shares: the two direction codecs and sampling."""

    forward: DirectionCodec
    backward: DirectionCodec
    sample_every: int = 10
    name: str = "compressed"
    calibrating: bool = False  # compression=auto: training calls measure every option meanwhile
    cache_probe: CacheProbe | None = None  # compression.stats.cache_probe (training forwards only)
    forward_cache: ForwardCache | None = None  # compression.forward.cache (training forwards only)
    input_codec: IdsCodec | None = None  # compression.input: ids or auto (the KJT all-to-all coded losslessly)
    input_switch: InputSwitch | None = None  # compression.input: auto (the strategy says when to code)

    @property
    def codecs(self) -> dict[str, DirectionCodec]:
        return {"forward": self.forward, "backward": self.backward}

    def stages(self, training: bool) -> list[Stage]:
        """The features acting on one collective call's chunks, in the order the transport
        applies them (fresh per call: DCT-MP's positions and calibration hold per-call state).
        Evaluation sends through the codec alone."""
        out: list[Stage] = [DuplicateIds()]
        if training:
            if self.backward.forward_positions:
                out.append(ForwardPositions())
            if self.forward_cache is not None:
                out.append(CacheStage(self.forward_cache))
            if self.calibrating:
                out.append(Calibration())
            if self.cache_probe is not None:
                out.append(self.cache_probe)
        return out

    @property
    def uses_ids(self) -> bool:
        return self.forward.dedup or self.backward.dedup

    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (DCT-MP thresholds) and row caches (the forward cache, the
        probe's mirrors), for its checkpoint (no side effects: saving changes nothing)."""
        state: dict[str, Any] = {d: c.state_dict() for d, c in self.codecs.items()}
        for name, part in self._caches.items():
            state[name] = part.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for d, c in self.codecs.items():
            c.load_state_dict(state.get(d, {}))
        for name, part in self._caches.items():
            part.load_state_dict(state.get(name, {}))

    @property
    def _caches(self) -> dict[str, ForwardCache | CacheProbe]:
        both = {"forward_cache": self.forward_cache, "cache_probe": self.cache_probe}
        return {name: part for name, part in both.items() if part is not None}


class CompressedDist:
    """State shared by the compressed dists: runtime, stats, iteration count."""

    def _init_compressed(self, runtime: CompressionRuntime, where: str, feature_tables: dict[str, str] | None) -> None:
        self.runtime = runtime
        self.stats = CommStats()
        self.iteration = 0  # training forwards so far; set_iteration() overrides it on resume
        self.where = where
        self.feature_tables = dict(feature_tables or {})
        self._global_ranks: dict[int, list[int]] = {}

    def _tick(self) -> tuple[int, bool]:
        """(iteration for the policy, whether to sample); counts training forwards only."""
        it = self.iteration
        # Grad mode alone (not local_embs.requires_grad: a rank without tables holds a constant
        # dummy) so that every rank counts the same iterations.
        training = torch.is_grad_enabled()
        if training:
            self.iteration += 1
        every = self.runtime.sample_every
        return it, training and every > 0 and it % every == 0

    def _ranks_of(self, pg: dist.ProcessGroup) -> list[int]:
        """Global ranks of a group's members (for messages and hooks), cached per group."""
        if id(pg) not in self._global_ranks:
            self._global_ranks[id(pg)] = [dist.get_global_rank(pg, r) for r in range(pg.size())]
        return self._global_ranks[id(pg)]

    def _info(
        self,
        pg: dist.ProcessGroup,
        layout,
        fwd_send_ids,
        fwd_recv_ids,
        it: int,
        sample: bool,
        forward_scale: float = 1.0,
        backward_scale: float = 1.0,
        collective: str = "a2a",
    ) -> CompressedA2AInfo:
        return CompressedA2AInfo(
            layout=layout,
            codecs=self.runtime.codecs,
            fwd_send_ids=fwd_send_ids,
            fwd_recv_ids=fwd_recv_ids,
            stats=self.stats,
            iteration=it,
            sample=sample,
            where=self.where,
            global_ranks=self._ranks_of(pg),
            feature_tables=self.feature_tables,
            bound_scale={"forward": forward_scale, "backward": backward_scale},
            training=torch.is_grad_enabled(),
            collective=collective,
            stages=self.runtime.stages(torch.is_grad_enabled()),
        )


def _refuse_cache(runtime: CompressionRuntime, where: str) -> None:
    if runtime.forward_cache is not None:
        raise ValueError(
            f"compression.forward.cache cannot apply to {where} sharding (its forward rows are partial "
            "sums, not table rows with ids): keep it to table_wise, column_wise and table_column_wise "
            "(compression.sharding_types) or disable it"
        )


def _check_ctx(ctx: EmbeddingShardingContext | None, where: str) -> None:
    if ctx is not None and ctx.variable_batch_per_feature:
        raise NotImplementedError(
            f"{where}: variable batch per feature (VBE) is not supported by the "
            "compressed dists; feed fixed-stride KJTs"
        )


def _batch_sizes(ctx: EmbeddingShardingContext | None, rows: int, ws: int, where: str) -> list[int]:
    if ctx is not None and ctx.batch_size_per_rank:
        return list(ctx.batch_size_per_rank)
    if rows % ws:
        raise ValueError(
            f"{where}: {rows} rows do not split evenly over {ws} ranks and no batch_size_per_rank was given"
        )
    return [rows // ws] * ws


class CompressedTwPooledEmbeddingDist(CompressedDist, TwPooledEmbeddingDist):
    """Table/column-wise output dist through the compressor, with ids for exact dedup."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        dim_sum_per_rank: list[int],
        emb_dim_per_rank_per_feature: list[list[int]],
        embedding_names_per_rank: list[list[str]],
        runtime: CompressionRuntime,
        keys_per_rank: list[int] | None = None,
        device: torch.device | None = None,
        callbacks: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
        where: str = "table_wise",
        feature_tables: dict[str, str] | None = None,
    ) -> None:
        super().__init__(pg, dim_sum_per_rank, emb_dim_per_rank_per_feature, device=device, callbacks=callbacks)
        self._init_compressed(runtime, where, feature_tables)
        self._blocks = [
            Blocks(list(n), list(d))
            for n, d in zip(embedding_names_per_rank, emb_dim_per_rank_per_feature, strict=True)
        ]
        for r, b in enumerate(self._blocks):
            if b.dim != dim_sum_per_rank[r] or len(b.features) != len(b.widths):
                raise ValueError(
                    f"{where}: rank {r} has features {b.features} of widths {b.widths} "
                    f"but a dim sum of {dim_sum_per_rank[r]}"
                )
        # Ids need KJT key k on rank r to be column block k of rank r's lookup output.
        self._ids_ok = keys_per_rank is not None and keys_per_rank == [len(b.features) for b in self._blocks]
        self._key_starts = list(itertools.accumulate([len(b.features) for b in self._blocks], initial=0))

    def _ids(self, ctx: EmbeddingShardingContext | None, bs: list[int], me: int) -> PendingIds | None:
        """Both sides' ids per peer, [send, recv], before the read of which chunks have them (the
        collective reads that with its size exchange); None: no ids."""
        ws = len(bs)
        if not (self._ids_ok and self.runtime.uses_ids and ctx is not None):
            return None
        starts = list(itertools.accumulate(bs, initial=0))
        n_mine = len(self._blocks[me].features)
        peers = [p for p in range(ws) if p != me]  # our own chunk never travels
        pending = pending_ids(
            [
                # Sender: the post-all-to-all KJT (our tables' bags, source rank then sample).
                (getattr(ctx, "post_a2a_kjt", None), [Region(0, n_mine, starts[r], bs[r]) for r in peers]),
                # Receiver: the KJT we sent in the input dist (all features, our samples).
                (
                    getattr(ctx, "pre_a2a_kjt", None),
                    [Region(self._key_starts[s], len(self._blocks[s].features), 0, bs[me]) for s in peers],
                ),
            ]
        )
        for side in pending.candidates:
            side.insert(me, None)
        # chunks whose ids come with the input codec's plan, of those with ids to plan
        self.stats.add("ids/plans_reused", pending.reused)
        self.stats.add("ids/plans", sum(c is not None for side in pending.candidates for c in side))
        return pending

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        """Compressed all-to-all of pooled embeddings ``[B_global, D_local]`` -> ``[B_local, D_global]``."""
        _check_ctx(sharding_ctx, self.where)
        pg = self._pg
        ws, me = pg.size(), pg.rank()
        if ws == 1:
            out: Awaitable[torch.Tensor] = NoWait(local_embs)
        else:
            bs = _batch_sizes(sharding_ctx, local_embs.size(0), ws, self.where)
            it, sample = self._tick()
            layout = PooledA2ALayout(me, bs, self._blocks)
            info = self._info(pg, layout, [None] * ws, [None] * ws, it, sample)
            info.pending_ids = self._ids(sharding_ctx, bs, me)
            out = compressed_all_to_all(pg, info, local_embs)
        awaitable = PooledEmbeddingsAwaitable(tensor_awaitable=out)
        awaitable.callbacks.extend(self._callbacks or [])
        return awaitable


def _reduce_scatter(
    dist_: CompressedDist,
    pg: dist.ProcessGroup,
    local_embs: torch.Tensor,
    rows_per_rank: list[int],
    blocks: Blocks,
    it: int,
    sample: bool,
    forward_share: float = 1.0,
    backward_share: float = 1.0,
) -> Awaitable[torch.Tensor]:
    """Compressed replacement of a pooled reduce-scatter (no ids: rows are partial sums).

    A summed row adds the errors of ``ws - 1`` decoded partial sums, so each is sent with
    ``forward_share / (ws - 1)`` of the bound; the gradient travels once per peer.
    """
    ws = pg.size()
    if ws == 1:
        return NoWait(local_embs)
    layout = ReduceScatterLayout(pg.rank(), rows_per_rank, blocks, ws)
    info = dist_._info(
        pg,
        layout,
        [None] * ws,
        [None] * ws,
        it,
        sample,
        forward_scale=forward_share / (ws - 1),
        backward_scale=backward_share,
        collective="reduce_scatter",
    )
    return compressed_all_to_all(pg, info, local_embs)


class CompressedRwPooledEmbeddingDist(CompressedDist, RwPooledEmbeddingDist):
    """Row-wise output dist: compressed all-to-all + local sum (forward), compressed all-to-all (backward)."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        embedding_names: list[str],
        embedding_dims: list[int],
        runtime: CompressionRuntime,
        where: str = "row_wise",
        feature_tables: dict[str, str] | None = None,
    ) -> None:
        super().__init__(pg, embedding_dims=embedding_dims)
        self._init_compressed(runtime, where, feature_tables)
        _refuse_cache(runtime, where)
        self._blocks = Blocks(list(embedding_names), list(embedding_dims))

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        """Partial sums ``[B_global, D]`` -> this rank's summed rows ``[B_local, D]``."""
        _check_ctx(sharding_ctx, self.where)
        ws = self._pg.size()
        bs = _batch_sizes(sharding_ctx, local_embs.size(0), ws, self.where)
        it, sample = self._tick() if ws > 1 else (self.iteration, False)
        return PooledEmbeddingsAwaitable(
            tensor_awaitable=_reduce_scatter(self, self._pg, local_embs, bs, self._blocks, it, sample)
        )


class CompressedTwRwPooledEmbeddingDist(CompressedDist, TwRwPooledEmbeddingDist):
    """Table-row-wise: compressed reduce-scatter inside the node, then compressed all-to-all across nodes."""

    def __init__(
        self,
        rank: int,
        cross_pg: dist.ProcessGroup,
        intra_pg: dist.ProcessGroup,
        dim_sum_per_node: list[int],
        emb_dim_per_node_per_feature: list[list[int]],
        embedding_names_per_node: list[list[str]],
        runtime: CompressionRuntime,
        device: torch.device | None = None,
        where: str = "table_row_wise",
        feature_tables: dict[str, str] | None = None,
    ) -> None:
        super().__init__(rank, cross_pg, intra_pg, dim_sum_per_node, emb_dim_per_node_per_feature, device=device)
        self._init_compressed(runtime, where, feature_tables)
        _refuse_cache(runtime, where)
        self._node_blocks = [
            Blocks(list(n), list(d))
            for n, d in zip(embedding_names_per_node, emb_dim_per_node_per_feature, strict=True)
        ]

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> Awaitable[torch.Tensor]:
        """Reduce over the node's row shards, then send each sample's rows to its node's rank."""
        _check_ctx(sharding_ctx, self.where)
        local_size, nodes = self._intra_pg.size(), self._cross_pg.size()
        local_rank, node = self._rank % local_size, self._rank // local_size
        if sharding_ctx is not None and sharding_ctx.batch_size_per_rank:
            by_cross, sum_by_cross = self._preprocess_batch_size_per_rank(
                local_size, nodes, sharding_ctx.batch_size_per_rank
            )
        else:
            b = _batch_sizes(None, local_embs.size(0), local_size * nodes, self.where)[0]
            by_cross, sum_by_cross = [[b] * nodes for _ in range(local_size)], [b * nodes] * local_size
        it, sample = self._tick() if local_size * nodes > 1 else (self.iteration, False)
        # Both stages add errors in each direction: with two stages each gets half of the bound.
        # Backward, the intra stage sends gradients already divided by the number of nodes: an
        # absolute bound shrinks by that factor to stay within half the bound on the original
        # gradient; a relative one already scales with the divided chunk's range.
        share = 0.5 if local_size > 1 and nodes > 1 else 1.0
        divided = get_gradient_division() and self.runtime.backward.spec.mode == "abs"
        # Stock TorchRec waits for the intra-node reduce-scatter here too.
        reduced = _reduce_scatter(
            self,
            self._intra_pg,
            local_embs,
            sum_by_cross,
            self._node_blocks[node],
            it,
            sample,
            share,
            share / nodes if divided else share,
        ).wait()
        if nodes == 1:
            out: Awaitable[torch.Tensor] = NoWait(reduced)
        else:
            layout = PooledA2ALayout(self._cross_pg.rank(), by_cross[local_rank], self._node_blocks)
            info = self._info(self._cross_pg, layout, [None] * nodes, [None] * nodes, it, sample, share, share)
            out = compressed_all_to_all(self._cross_pg, info, reduced)
        return PooledEmbeddingsAwaitable(tensor_awaitable=out)
