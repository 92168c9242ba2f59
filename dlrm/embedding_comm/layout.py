"""One collective call: how its tensor is cut into per-peer chunks, where received chunks go, and its plan.

:class:`PooledA2ALayout` (table/column-wise: rows out, columns back) and
:class:`ReduceScatterLayout` (row-wise: rows out and summed, the whole gradient back to every
rank), the analogue of the splits TorchRec's ``All2AllPooledInfo`` and reduce-scatter info carry.
The transport (:mod:`dlrm.embedding_comm.comm_ops`) asks a layout alone; chunks that are
concatenated are decoded straight into their window of :meth:`output`, summed ones apart and
added by :meth:`ReduceScatterLayout.merge`. :class:`CompressedA2AInfo` is a call's plan for both
directions (TorchRec's ``All2AllPooledInfo``): its layout, codecs, ids, stages and statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.ids import PendingIds
from dlrm.embedding_comm.stage import Blocks, Stage
from dlrm.embedding_comm.stats import CommStats


class PooledA2ALayout:
    """Table/column-wise: rows go to their sample's rank; each owner gets its columns' gradient."""

    def __init__(self, rank: int, batch_size_per_rank: Sequence[int], blocks_per_rank: Sequence[Blocks]) -> None:
        self.rank, self.bs, self.blocks = rank, list(batch_size_per_rank), list(blocks_per_rank)

    def split(self, direction: str, x: torch.Tensor) -> list[torch.Tensor]:
        if direction == "forward":
            return list(x.split(self.bs, dim=0))
        return list(x.split([b.dim for b in self.blocks], dim=1))

    def features(self) -> list[str]:
        """Every feature that crosses this collective, from any rank (the same list on every rank)."""
        return [f for b in self.blocks for f in b.features]

    def send_blocks(self, direction: str, peer: int) -> Blocks:
        return self.blocks[self.rank] if direction == "forward" else self.blocks[peer]

    def recv_blocks(self, direction: str, peer: int) -> Blocks:
        return self.blocks[peer] if direction == "forward" else self.blocks[self.rank]

    def recv_shape(self, direction: str, peer: int) -> tuple[int, int]:
        if direction == "forward":
            return self.bs[self.rank], self.blocks[peer].dim
        return self.bs[peer], self.blocks[self.rank].dim

    def output(self, direction: str, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The merged output and each peer's window of it (columns forward, rows backward)."""
        shapes = [self.recv_shape(direction, p) for p in range(len(self.bs))]
        dim = 1 if direction == "forward" else 0
        size = [shapes[0][0], sum(s[1] for s in shapes)] if dim else [sum(s[0] for s in shapes), shapes[0][1]]
        out = like.new_empty(size)
        return out, list(out.split([s[dim] for s in shapes], dim=dim))


class ReduceScatterLayout:
    """Row-wise: every rank holds partial sums of every sample; rows go to their sample's rank
    and are summed there (in source-rank order); the gradient goes back whole to every rank."""

    def __init__(self, rank: int, rows_per_rank: Sequence[int], blocks: Blocks, world_size: int) -> None:
        self.rank, self.bs, self.blocks, self.ws = rank, list(rows_per_rank), blocks, world_size

    def split(self, direction: str, x: torch.Tensor) -> list[torch.Tensor]:
        if direction == "forward":
            return list(x.split(self.bs, dim=0))
        return [x] * self.ws  # the same tensor: encoded once, sent to every peer

    def features(self) -> list[str]:
        return list(self.blocks.features)

    def send_blocks(self, direction: str, peer: int) -> Blocks:
        return self.blocks

    recv_blocks = send_blocks

    def recv_shape(self, direction: str, peer: int) -> tuple[int, int]:
        return (self.bs[self.rank] if direction == "forward" else self.bs[peer]), self.blocks.dim

    def output(self, direction: str, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Backward: the whole gradient, each peer's rows a window of it; forward sums (None)."""
        if direction == "forward":
            return None
        out = like.new_empty(sum(self.bs), self.blocks.dim)
        return out, list(out.split(self.bs, dim=0))

    def merge(self, direction: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """Forward: the partial sums, added in source-rank order."""
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out


@dataclass
class CompressedA2AInfo:
    """One collective's plan for both directions (the analogue of TorchRec's All2AllPooledInfo)."""

    layout: PooledA2ALayout | ReduceScatterLayout
    codecs: dict[str, DirectionCodec]  # "forward" / "backward"
    # Ids of the rows sent to / received from each peer in forward (None: value dedup); the
    # backward sends to the forward's sources, so it uses them the other way round.
    fwd_send_ids: list[torch.Tensor | None]
    fwd_recv_ids: list[torch.Tensor | None]
    stats: CommStats
    iteration: int
    sample: bool  # measure errors and per-feature sizes on this call
    where: str  # names the sharding in error messages
    global_ranks: list[int] = field(default_factory=list)
    feature_tables: dict[str, str] = field(default_factory=dict)  # for error messages
    # Multiplies the policy's bounds per direction, so that errors that add up (row-wise partial
    # sums, the two stages of table-row-wise) stay within the policy's bound in total.
    bound_scale: dict[str, float] = field(default_factory=lambda: {"forward": 1.0, "backward": 1.0})
    training: bool = True  # a training forward (evaluation refreshes no DCT-MP threshold)
    collective: str = "a2a"  # "a2a" or "reduce_scatter" (table-row-wise runs both, each with its own thresholds)
    stages: list[Stage] = field(default_factory=list)  # the features acting on this call's chunks, in order
    # The forward's ids before the read of which chunks are single-valued ([send, recv] per peer):
    # the forward's first read settles them into fwd_send_ids / fwd_recv_ids.
    pending_ids: PendingIds | None = None

    def settle_ids(self, single: list[bool]) -> None:
        """Keep the ids of the chunks ``single`` (the pending flags, read) says have them."""
        assert self.pending_ids is not None
        self.fwd_send_ids, self.fwd_recv_ids = self.pending_ids.settle(single)
        self.pending_ids = None

    def send_ids(self, direction: str) -> list[torch.Tensor | None]:
        return self.fwd_send_ids if direction == "forward" else self.fwd_recv_ids

    def recv_ids(self, direction: str) -> list[torch.Tensor | None]:
        return self.fwd_recv_ids if direction == "forward" else self.fwd_send_ids

    def naming(self, features: list[str], src: int, dst: int, where: str | None = None) -> dict[str, Any]:
        """What names one transfer of this collective in an error."""
        tables = sorted({self.feature_tables.get(f, f) for f in features})
        return dict(
            src=src, dst=dst, features=features, tables=tables, iteration=self.iteration, where=where or self.where
        )
