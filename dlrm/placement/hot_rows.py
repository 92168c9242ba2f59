"""Hot-row replication: the hottest ids of a table live on every rank and are looked up locally.

In the data path, each replicated feature ``f`` of a batch is split in two: ``f`` keeps its cold
ids (they travel through the sharded table's compressed all-to-all as before), and a new feature
``f@hot`` carries the hot ids remapped to replica slots 0..H-1 (the hottest id is slot 0). The
model's sparse arch adds the replica's pooled rows to the sharded table's: with sum pooling the
pooled embedding of a bag is the sum over its ids, so hot pooled + cold pooled is exactly the
bag's embedding (for single-valued Criteo features exactly one of the two is an empty bag).
The sharded table keeps its own (unused, stale) copy of the hot rows; the replica is the one that
trains, and the one a checkpoint keeps (DCP writes a tensor replicated on every rank once), with the
replicated ids in each rank's state file (:meth:`dlrm.placement.replication.Replication.state_dict`); dlrm-export
folds the replicas back into their tables (:func:`fold_into_tables`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm.process.env import collective_device
from dlrm.trainer.model import table_names
from dlrm_compression.backend import backend_for
from dlrm_compression.row_cache import compact

HOT_SUFFIX = "@hot"


class HotSplit:
    """Splits each batch's replicated features into cold ids and hot replica slots; ``backend``
    (``compression.backend``: auto, host or device) chooses, from each batch's device, how the
    ids are compacted (:func:`dlrm_compression.row_cache.compact`)."""

    def __init__(self, hot_ids: Mapping[str, torch.Tensor], backend: str = "auto") -> None:
        backend_for("cpu", backend)  # refuse an unknown choice here, not at the first batch
        self.backend = backend
        self.features = list(hot_ids)  # feature -> int64 ids, hottest first (slot order)
        self.sorted_ids, self.slot_of_sorted = {}, {}
        for f, ids in hot_ids.items():
            ids = torch.as_tensor(ids, dtype=torch.int64)
            self.sorted_ids[f], self.slot_of_sorted[f] = ids.sort()

    def __call__(self, batch: Batch) -> Batch:
        """The batch with each replicated feature's hot ids split off, on the batch's device; the
        host reads every key's new length at once (the jagged tensor's ``length_per_key``)."""
        kjt = batch.sparse_features
        parts = kjt.to_dict()
        keys = list(kjt.keys())
        hot_keys = [k for k in keys if k in self.sorted_ids]
        values = {k: parts[k].values() for k in keys}
        lengths = {k: parts[k].lengths() for k in keys}
        hot, slots, hot_lengths = {}, {}, {}
        for key in hot_keys:
            v, n = values[key], lengths[key]
            ids = self.sorted_ids[key].to(v.device)
            pos = torch.searchsorted(ids, v).clamp_(max=len(ids) - 1)
            hot[key] = ids[pos] == v
            slots[key] = self.slot_of_sorted[key].to(v.device)[pos]
            bag = torch.repeat_interleave(torch.arange(len(n), device=v.device), n.long(), output_size=v.numel())
            hot_lengths[key] = torch.zeros_like(n).index_add_(0, bag, hot[key].to(n.dtype))
            lengths[key] = n - hot_lengths[key]
        all_lengths = [lengths[k] for k in keys] + [hot_lengths[k] for k in hot_keys]
        sizes = torch.stack([n.sum() for n in all_lengths]).tolist()  # the one host read
        size = dict(zip(keys, sizes, strict=False))
        host = backend_for(kjt.values().device, self.backend).host_compaction
        cold = [compact(values[k], ~hot[k], size[k], host) if k in hot else values[k] for k in keys]
        hot_values = [compact(slots[k], hot[k], m, host) for k, m in zip(hot_keys, sizes[len(keys) :], strict=True)]
        out = KeyedJaggedTensor(
            keys=keys + [k + HOT_SUFFIX for k in hot_keys],
            values=torch.cat(cold + hot_values),
            lengths=torch.cat(all_lengths),
            stride=kjt.stride(),
            length_per_key=[int(m) for m in sizes],
        )
        return Batch(dense_features=batch.dense_features, sparse_features=out, labels=batch.labels)

    def batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        return (self(b) for b in batches)


class HotRows(torch.nn.Module):
    """The replicas: one [H, D] weight per replicated feature's table, looked up with sum pooling
    and added to the sharded tables' pooled rows. A leaf of TorchRec's pipeline tracer (it holds
    no sharded module), so its Python control flow never meets an fx proxy."""

    def __init__(self, sizes: Mapping[str, int], dim: int, feature_names: list[str]) -> None:
        super().__init__()
        self.features, self.feature_names, self.dim = list(sizes), list(feature_names), dim
        # zeros, not a random init: the values come from the sharded tables (copy_from_tables)
        self.weights = torch.nn.ParameterDict({f: torch.nn.Parameter(torch.zeros(h, dim)) for f, h in sizes.items()})

    def forward(self, features: KeyedJaggedTensor, pooled: KeyedTensor) -> torch.Tensor:
        """[B, F, D]: every feature's pooled embedding, replicas' rows included."""
        parts, sharded = features.to_dict(), pooled.to_dict()
        values = []
        for f in self.feature_names:
            if f in self.weights:
                jt = parts[f + HOT_SUFFIX]
                hot = F.embedding_bag(
                    jt.values(), self.weights[f], jt.offsets(), mode="sum", sparse=True, include_last_offset=True
                )
                values.append(sharded[f] + hot)
            else:
                values.append(sharded[f])
        return torch.cat(values, dim=1).reshape(-1, len(self.feature_names), self.dim)


class HotSparseArch(torch.nn.Module):
    """TorchRec's DLRM ``SparseArch`` with the replicas' pooled rows added to the sharded ones."""

    def __init__(self, sparse_arch: torch.nn.Module, hot: HotRows) -> None:
        super().__init__()
        self.embedding_bag_collection = cast(torch.nn.Module, sparse_arch.embedding_bag_collection)
        self.hot = hot
        self.D, self.F = sparse_arch.D, sparse_arch.F

    @property
    def sparse_feature_names(self) -> list[str]:
        return self.hot.feature_names

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.hot(features, self.embedding_bag_collection(features))


REPLICA_PREFIX = "sparse_arch.hot.weights."  # a replica's key in DLRM's state dict


def fold_into_tables(
    state: Mapping[str, torch.Tensor], hot_ids: Mapping[str, Sequence[int]], where: str
) -> dict[str, torch.Tensor]:
    """A DLRM state dict with each replica's trained rows written over its table's stale copy of
    them, replicas dropped: the state of the plain DLRM the run trained (tables widened to fp32,
    the replicas' precision). ``where`` names the checkpoint in errors."""
    replicas = {k[len(REPLICA_PREFIX) :]: v for k, v in state.items() if k.startswith(REPLICA_PREFIX)}
    if set(replicas) != set(hot_ids):
        raise ValueError(
            f"{where} holds replicas of features {sorted(replicas)} but its state file records hot ids of "
            f"{sorted(hot_ids)} (a checkpoint written before the hot ids were recorded cannot be exported)"
        )
    out = {k: v for k, v in state.items() if not k.startswith(REPLICA_PREFIX)}
    for f, ids in hot_ids.items():
        (table,) = table_names([f])
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.{table}.weight"
        out[key] = out[key].float().clone()
        out[key][torch.as_tensor(list(ids), dtype=torch.int64)] = replicas[f].float()
    return out


def install(
    model: torch.nn.Module, hot_ids: Mapping[str, torch.Tensor], dim: int, device: torch.device | None = None
) -> HotRows:
    """Put replicas of ``hot_ids`` (feature -> ids, hottest first) into a sharded DLRMTrain, on
    ``device`` (default: its dense parameters'), initialised from the sharded tables' rows (a
    collective on that device: the process group's)."""
    dlrm = get_unwrapped_module(model).model
    if device is None:
        device = next(dlrm.dense_arch.parameters()).device
    hot = HotRows({f: len(ids) for f, ids in hot_ids.items()}, dim, list(dlrm.sparse_arch.sparse_feature_names))
    hot.to(device)
    copy_from_tables(dlrm.sparse_arch.embedding_bag_collection, hot, hot_ids)
    dlrm.sparse_arch = HotSparseArch(dlrm.sparse_arch, hot)
    return hot


@torch.no_grad()
def copy_from_tables(ebc: torch.nn.Module, hot: HotRows, hot_ids: Mapping[str, torch.Tensor]) -> None:
    """Each rank writes the hot rows held by its shards (row and column offsets), zeros elsewhere;
    a sum over ranks gives every rank the full rows exactly."""
    state = ebc.state_dict()
    for f, ids in hot_ids.items():
        (table,) = table_names([f])
        weight, replica = state[f"embedding_bags.{table}.weight"], hot.weights[f]
        ids = torch.as_tensor(ids, dtype=torch.int64).to(replica.device)
        shards = weight.local_shards() if hasattr(weight, "local_shards") else []
        if not hasattr(weight, "local_shards") and (not dist.is_initialized() or dist.get_rank() == 0):
            replica.copy_(
                weight[ids.to(weight.device)]
            )  # data-parallel table: every rank has it all; one rank contributes
        for shard in shards:
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            mine = (ids >= r0) & (ids < r0 + nr)  # once, at setup: the masks' syncs do not recur
            replica[mine, c0 : c0 + nc] = shard.tensor[(ids[mine] - r0).to(shard.tensor.device)].to(replica)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat([w.flatten() for w in hot.weights.values()]).to(collective_device())
        dist.all_reduce(flat)
        offset = 0
        for w in hot.weights.values():
            w.copy_(flat[offset : offset + w.numel()].view_as(w))
            offset += w.numel()
