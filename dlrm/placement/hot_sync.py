"""Keep the replicated hot rows identical on every rank: sum their gradients across ranks, sending
only the rows a rank touched, then apply the embedding optimizer's own update to them.

The sharded rows of a table train with TorchRec's fused optimizer on the gradient summed over
every rank's lookups (the backward all-to-all brings them to the owner). The replicas must follow
the same math, so :class:`HotRowOptimizer` sums the same gradients (divided by the world size where
TorchRec divides them; an all-gather of each rank's touched rows, added in rank order so every
rank computes the same bits) and applies the same
update rule (FBGEMM's exact SGD, Adagrad or row-wise Adagrad) to the rows touched anywhere.

With ``placement.sync_codec=backward`` each rank's touched rows travel coded by
:class:`dlrm.placement.hot_wire.SyncWire` (the backward all-to-all's codec and bound, slots as int16/int32,
no padding); every rank decodes every rank's payload, its own included, and sums them in rank
order, so the replicas stay identical while each summed gradient is within the ranks' bounds of
the exact sum.

With ``sync_every=k > 1`` the gradients of k iterations are accumulated and applied together:
replicas stay identical, but lookups see rows up to k-1 updates old (bounded staleness, a change
of the optimisation math that a user opts into).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.optim.keyed import KeyedOptimizer

from dlrm.placement.hot_wire import SyncWire, held_slots
from dlrm.placement.traffic import ID_BYTES
from dlrm.process.timeout import named_collective
from dlrm_compression.backend import backend_for
from dlrm_compression.format import Deferred
from dlrm_compression.row_cache import compact, positions

RULES = ("sgd", "adagrad", "rowwise_adagrad")


@dataclass
class Gathered:
    """Every rank's (slots, rows) of one sync, in rank order, and the slots touched anywhere."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]
    hit: torch.Tensor  # bool, per slot
    n_hit: list[int]  # per table, read on the host


class HotRowOptimizer(KeyedOptimizer):
    """The optimizer of the replicated rows (``params``: name -> [H, D] weight with a sparse grad);
    ``backend`` (``compression.backend``: auto, host or device) chooses, from the replicas'
    device, how touched rows are compacted (:func:`dlrm_compression.row_cache.compact`)."""

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        rule: str,
        lr: float,
        eps: float,
        sync_every: int,
        wire: SyncWire | None = None,
        backend: str = "auto",
    ):
        if rule not in RULES:
            raise ValueError(f"hot-row replication supports optimizer.sparse.name in {RULES} (got {rule!r})")
        state: dict[Any, Any] = {}
        for p in params.values():
            if rule == "adagrad":
                state[p] = {"momentum": torch.zeros_like(p)}
            elif rule == "rowwise_adagrad":
                state[p] = {"momentum": torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)}
        group = {"params": list(params.values()), "lr": lr, "eps": eps}
        super().__init__(dict(params), state, [group])
        self.rule, self.sync_every, self.wire = rule, int(sync_every), wire  # wire None: the exact sync
        backend_for("cpu", backend)  # refuse an unknown choice here, not at the first sync
        self.backend = backend
        self.names = list(params)
        self.pending = {n: torch.zeros_like(p) for n, p in params.items()}  # gradients not yet applied
        self.touched = {n: torch.zeros(p.shape[0], dtype=torch.bool, device=p.device) for n, p in params.items()}
        self.steps = 0  # optimizer steps since the start (or the resumed checkpoint's count)
        self.sent_bytes = 0  # this rank's bytes on the wire for synchronisation

    def init_state(self) -> None:  # state is created eagerly; no dummy step (it would be a collective)
        return

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for name, p in self.params.items():
            if p.grad is None:
                continue
            g = p.grad.coalesce() if p.grad.is_sparse else p.grad.to_sparse(1).coalesce()
            rows, values = g.indices()[0], g.values()
            if get_gradient_division():  # as TorchRec's backward all-to-all: the mean over ranks
                values = values / (dist.get_world_size() if dist.is_initialized() else 1)
            self.pending[name].index_add_(0, rows, values)
            self.touched[name][rows] = True
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self._sync_and_apply()

    def _sync_and_apply(self) -> None:
        """All-gather every rank's touched rows (slots across all tables), sum in rank order, update.
        On the replicas' device; the host reads, for each collective, what it needs after it: the
        sizes with this rank's touched counts, then the hit counts (with the heads, coded)."""
        params = [self.params[n] for n in self.names]
        bases = list(itertools.accumulate((p.shape[0] for p in params), initial=0))
        touched = torch.stack([self.touched[n].sum() for n in self.names])  # per table, on the device
        gathered = self._gather(touched, bases) if self.wire is None else self._gather_coded(touched, bases)
        total = params[0].new_zeros(bases[-1], params[0].shape[1])
        for s, r in gathered.parts:
            total.index_add_(0, s, r)
        lr, eps = self.param_groups[0]["lr"], self.param_groups[0]["eps"]
        hits = [gathered.hit[b : b + p.shape[0]] for p, b in zip(params, bases, strict=False)]
        host = self._host(params[0].device)
        for name, p, b, h, k in zip(self.names, params, bases, hits, gathered.n_hit, strict=False):
            sel = positions(h, k, host)
            self._apply(p, sel, total[b + sel], lr, eps)
            self.pending[name].zero_()
            self.touched[name].zero_()

    def _touched_rows(self, n_touched: list[int], bases: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each table's touched slots (global) and pending rows, given their counts as read."""
        touched = [self.touched[n] for n in self.names]
        host = self._host(touched[0].device) if touched else False
        slots = [positions(t, k, host) + b for t, k, b in zip(touched, n_touched, bases, strict=False)]
        rows = [compact(self.pending[n], t, k, host) for n, t, k in zip(self.names, touched, n_touched, strict=True)]
        return slots, rows

    def _host(self, device: torch.device) -> bool:
        """Whether compactions on ``device`` take the host's ``nonzero`` (the backend's choice)."""
        return backend_for(device, self.backend).host_compaction

    def _any_touched(self, name: str) -> torch.Tensor:
        """Table ``name``'s pending rows, each untouched one replaced by its first touched row."""
        t = self.touched[name]
        if not t.numel():
            return self.pending[name]
        rows = torch.arange(t.numel(), device=t.device)
        return self.pending[name].index_select(0, torch.where(t, rows, t.to(torch.uint8).argmax()))

    def _at_capacity(self, bases: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each table's slots (global), its touched ones first in slot order, and its pending rows
        in that order, each untouched one replaced by its first touched row (the same value range,
        deduplicated away): on the device, without the touched counts on the host."""
        slots, rows = [], []
        for name, base in zip(self.names, bases, strict=False):
            t = self.touched[name]
            order = torch.argsort(t.logical_not().to(torch.uint8), stable=True)
            pick = torch.where(torch.arange(t.numel(), device=t.device) < t.sum(), order, order[:1])
            slots.append(pick + base)
            rows.append(self.pending[name].index_select(0, pick))
        return slots, rows

    def _gather(self, touched: torch.Tensor, bases: list[int]) -> Gathered:
        """Every rank's (slots, rows), in rank order; rows of each rank padded to the largest count.
        Tensors on the rows' device (the process group's: NCCL takes CUDA tensors, gloo CPU ones)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            mine = self._touched_rows(touched.tolist(), bases)
            return self._hits([(torch.cat(mine[0]), torch.cat(mine[1]))])
        dev = touched.device
        with named_collective("the hot-row gradient all-gather (placement.hot_rows)"):
            counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
            dist.all_gather(counts, touched.sum().reshape(1))
            read = torch.cat([touched, *counts]).tolist()  # the size exchange, with this rank's touched counts
            n_touched, sizes = read[: len(bases) - 1], read[len(bases) - 1 :]
            per_table = self._touched_rows(n_touched, bases)
            slots, rows = torch.cat(per_table[0]), torch.cat(per_table[1])
            dim, n = rows.shape[1], max(sizes)
            packed = torch.zeros(n, dim + 2, dtype=torch.float32, device=dev)  # int64 slot as two float32 words
            packed[: len(slots), :2] = slots.to(torch.int64).view(-1, 1).view(torch.float32).view(-1, 2)
            packed[: len(slots), 2:] = rows
            out = [torch.empty_like(packed) for _ in range(world)]
            dist.all_gather(out, packed)
        self.sent_bytes += (world - 1) * (packed.numel() * 4 + ID_BYTES)  # padded rows and the count
        parts = [
            (o[:c, :2].contiguous().view(torch.int64).flatten(), o[:c, 2:]) for o, c in zip(out, sizes, strict=True)
        ]
        return self._hits(parts)  # the rows' all-gather's read: the hit counts

    def _gather_coded(self, touched: torch.Tensor, bases: list[int]) -> Gathered:
        """Every rank's decoded (slots, rows), in rank order, this rank's own payload decoded too:
        the sizes all-gathered, then each rank's bytes to every rank unpadded (all_to_all_single of
        the payload repeated per destination: a variable-size all-gather)."""
        assert self.wire is not None
        iteration = self.steps - 1  # the iteration of the last step synced
        coded: torch.Tensor | Deferred
        if self.wire.defers(touched.device):  # built at the tables' capacity: its length read with the sizes
            coded = self.wire.encode_capacity(*self._at_capacity(bases), touched, iteration)
        else:
            # The bounds from each table's rows at capacity (untouched rows replaced by a touched one: the
            # same value range), read with the touched counts the rows are then compacted by
            bounds, n_touched = self.wire.bounds([self._any_touched(n) for n in self.names], iteration, touched)
            slots, rows = self._touched_rows(n_touched, bases)
            coded = self.wire.encode(slots, rows, iteration, bounds)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self._decoded([self.wire.settle(coded, int(coded.length) if isinstance(coded, Deferred) else 0)])
        length = coded.length if isinstance(coded, Deferred) else torch.tensor(coded.numel())
        world, rank = dist.get_world_size(), dist.get_rank()
        dev = coded.buffer.device if isinstance(coded, Deferred) else coded.device
        with named_collective("the coded hot-row gradient exchange (placement.sync_codec=backward)"):
            sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
            dist.all_gather(sizes, length.reshape(1).to(dev, non_blocking=True))
            recv = torch.cat(sizes).tolist()  # the size exchange: one host read (this rank's length too)
            payload, n = self.wire.settle(coded, recv[rank]), recv[rank]
            out = torch.empty(sum(recv), dtype=torch.uint8, device=dev)
            dist.all_to_all_single(out, payload.repeat(world), recv, [n] * world)
        self.sent_bytes += (world - 1) * (n + ID_BYTES)  # the payload and its size to every peer
        return self._decoded(list(out.split(recv)))

    def _decoded(self, payloads: list[torch.Tensor]) -> Gathered:
        """Every rank's payload decoded; the hit counts read with their heads."""
        assert self.wire is not None
        return Gathered(*self.wire.decode_all(payloads))

    def _hits(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> Gathered:
        """``parts`` with the slots they hit, the counts read on the host."""
        sizes = [self.params[n].shape[0] for n in self.names]
        hit, counts = held_slots([s for s, _ in parts], [None] * len(parts), sizes)
        return Gathered(parts, hit, counts.tolist())

    def _apply(self, p: torch.Tensor, sel: torch.Tensor, g: torch.Tensor, lr: float, eps: float) -> None:
        """FBGEMM's exact update of rows ``sel`` of ``p`` with their summed gradient ``g``."""
        if self.rule == "sgd":
            p.index_add_(0, sel, g, alpha=-lr)
            return
        m = self.state[p]["momentum"]
        if self.rule == "adagrad":
            m[sel] += g * g
            p[sel] -= lr * g / (m[sel].sqrt() + eps)
        else:
            m[sel] += (g * g).mean(dim=1)
            p[sel] -= (lr / (m[sel].sqrt() + eps)).unsqueeze(1) * g

    def pending_state(self) -> dict[str, Any]:
        """This rank's accumulated, not yet synchronised gradients (differ per rank: saved in its checkpoint file)."""
        return {"steps": self.steps, "pending": dict(self.pending), "touched": dict(self.touched)}

    def load_pending_state(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])
        for n in self.names:
            self.pending[n].copy_(state["pending"][n])
            self.touched[n].copy_(state["touched"][n])
