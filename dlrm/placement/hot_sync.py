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

Every table's rows are one flat buffer (slots ``0..N-1``, table after table): the replicas'
weights (each parameter a view of it), their optimizer state, the pending gradients and the
touched rows, so a sync's work is a fixed number of operations over all tables at once, none per
table. Only the gradients' own coalescing stays per table (per step, before the sync): the order
in which it sums a row's duplicate lookups is the device's sort's, which one sort of every table's
lookups together would not keep on a CPU (its sort is not stable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.optim.keyed import KeyedOptimizer

from dlrm.placement.hot_wire import SyncWire, TableLayout, held_slots
from dlrm.placement.traffic import ID_BYTES
from dlrm.process.timeout import named_collective
from dlrm_compression.backend import backend_for
from dlrm_compression.format import Deferred
from dlrm_compression.row_cache import positions

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
    device, how touched rows are compacted (:func:`dlrm_compression.row_cache.compact`).

    The parameters become views of one flat buffer of every table's rows (their values kept;
    checked at every sync, and joined again if something gave a parameter storage of its own),
    and so do their optimizer state, pending gradients and touched flags (module docstring)."""

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
        plist = list(params.values())
        if not plist or len({p.shape[1:] for p in plist}) != 1 or len({(p.device, p.dtype) for p in plist}) != 1:
            raise ValueError("hot-row replication needs [H, D] replicas of one width, device and dtype")
        self.layout = TableLayout([p.shape[0] for p in plist])
        n, dim, like = self.layout.n_slots, plist[0].shape[1], plist[0]
        self._weights = like.new_empty(n, dim)
        self._join(plist)  # the parameters: views of the flat weights, their values kept
        self._momentum: torch.Tensor | None = None
        state: dict[Any, Any] = {}
        if rule in ("adagrad", "rowwise_adagrad"):
            self._momentum = like.new_zeros(n, dim) if rule == "adagrad" else like.new_zeros(n)
            for p, m in zip(plist, self.layout.split(self._momentum), strict=True):
                state[p] = {"momentum": m}
        group = {"params": plist, "lr": lr, "eps": eps}
        super().__init__(dict(params), state, [group])
        self.rule, self.sync_every, self.wire = rule, int(sync_every), wire  # wire None: the exact sync
        backend_for("cpu", backend)  # refuse an unknown choice here, not at the first sync
        self.backend = backend
        self.names = list(params)
        self._pending = like.new_zeros(n, dim)  # gradients not yet applied, every table's rows
        self._touched = torch.zeros(n, dtype=torch.bool, device=like.device)
        self.pending = dict(zip(self.names, self.layout.split(self._pending), strict=True))  # views
        self.touched = dict(zip(self.names, self.layout.split(self._touched), strict=True))
        self.steps = 0  # optimizer steps since the start (or the resumed checkpoint's count)
        self.sent_bytes = 0  # this rank's bytes on the wire for synchronisation

    def init_state(self) -> None:  # state is created eagerly; no dummy step (it would be a collective)
        return

    def _replicas(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def _join(self, plist: list[torch.nn.Parameter]) -> None:
        """Make every parameter a view of the flat weights, keeping its values (one copy)."""
        with torch.no_grad():
            torch.cat([p.detach() for p in plist], out=self._weights)
        for p, view in zip(plist, self.layout.split(self._weights), strict=True):
            p.data = view

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The flat weights and momentum, the parameters and their state still views of them:
        checked on the host by their addresses (no device work), joined again (one copy) where
        something gave one storage of its own (a parameter moved, a state tensor replaced)."""
        plist = self._replicas()
        if not _views_of(self._weights, plist, self.layout.bases):
            self._join(plist)
        m = self._momentum
        if m is not None and not _views_of(m, [self.state[p]["momentum"] for p in plist], self.layout.bases):
            with torch.no_grad():
                torch.cat([self.state[p]["momentum"].detach() for p in plist], out=m)
            for p, view in zip(plist, self.layout.split(m), strict=True):
                self.state[p]["momentum"] = view
        return self._weights, m

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = [(k, p.grad) for k, p in enumerate(self._replicas()) if p.grad is not None]
        if grads:
            # each table's gradient coalesced on its own (its duplicate lookups summed in the
            # device's order), then every table's rows added and flagged at once
            parts = [_coalesced(g) for _, g in grads]
            rows, values = torch.cat([r for r, _ in parts]), torch.cat([v for _, v in parts])
            rows = rows + self.layout.offsets([k for k, _ in grads], [len(r) for r, _ in parts], rows.device)
            if get_gradient_division():  # as TorchRec's backward all-to-all: the mean over ranks
                values = values / (dist.get_world_size() if dist.is_initialized() else 1)
            self._pending.index_add_(0, rows, values)
            self._touched.index_fill_(0, rows, True)
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self._sync_and_apply()

    def _sync_and_apply(self) -> None:
        """All-gather every rank's touched rows (slots across all tables), sum in rank order, update.
        On the replicas' device; the host reads, for each collective, what it needs after it: the
        sizes with this rank's touched counts, then the hit counts (with the heads, coded)."""
        weights, momentum = self._flat()
        touched = self.layout.sums(self._touched)  # per table, on the device
        gathered = self._gather(touched) if self.wire is None else self._gather_coded(touched)
        total = torch.zeros_like(self._pending)
        for s, r in gathered.parts:
            total.index_add_(0, s, r)
        lr, eps = self.param_groups[0]["lr"], self.param_groups[0]["eps"]
        sel = self._positions(gathered.hit, sum(gathered.n_hit))
        self._apply(weights, momentum, sel, total.index_select(0, sel), lr, eps)
        self._pending.zero_()
        self._touched.zero_()

    def _touched_rows(self, n_touched: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every table's touched slots (ascending: table after table) and pending rows, given
        how many there are as read."""
        slots = self._positions(self._touched, n_touched)
        return slots, self._pending.index_select(0, slots)

    def _positions(self, keep: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` set places of ``keep`` in ascending order, the host knowing ``n``: the host
        backend's ``nonzero`` (:func:`positions`), else one stable sort (no host wait)."""
        host = self._host(keep.device)
        if host or n in (0, keep.numel()):
            return positions(keep, n, host)
        return torch.argsort(keep.to(torch.uint8), descending=True, stable=True)[:n]

    def _host(self, device: torch.device) -> bool:
        """Whether compactions on ``device`` take the host's ``nonzero`` (the backend's choice)."""
        return backend_for(device, self.backend).host_compaction

    def _at_capacity(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each table's slots (global) at its capacity, [tables, largest table], its touched ones
        first in slot order (``counts`` of them), the rest repeating its first touched one (a
        table shorter than the largest: its last slot), and their pending rows as one block per
        table, [largest table, tables x D] (the same value range; the padding never read back): on the
        device, without the touched counts on the host (sorted as [largest table, tables], the
        rows' layout: gathered without a copy)."""
        touched = self.layout.padded(self._touched).t().to(torch.uint8, memory_format=torch.contiguous_format)
        order = torch.argsort(touched, dim=0, descending=True, stable=True)
        pick = torch.where(self.layout.column(touched.device)[:, None] < counts, order, order[:1])
        slots = self.layout.globalise(pick.t())
        return slots, self._pending[slots.t()].reshape(slots.shape[1], -1)

    def _gather(self, touched: torch.Tensor) -> Gathered:
        """Every rank's (slots, rows), in rank order; rows of each rank padded to the largest count.
        Tensors on the rows' device (the process group's: NCCL takes CUDA tensors, gloo CPU ones)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return self._hits([self._touched_rows(sum(touched.tolist()))])
        dev = touched.device
        with named_collective("the hot-row gradient all-gather (placement.hot_rows)"):
            counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
            dist.all_gather(counts, touched.sum().reshape(1))
            read = torch.cat([touched, *counts]).tolist()  # the size exchange, with this rank's touched counts
            n_touched, sizes = read[: len(touched)], read[len(touched) :]
            slots, rows = self._touched_rows(sum(n_touched))
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

    def _gather_coded(self, touched: torch.Tensor) -> Gathered:
        """Every rank's decoded (slots, rows), in rank order, this rank's own payload decoded too:
        the sizes all-gathered, then each rank's bytes to every rank unpadded (all_to_all_single of
        the payload repeated per destination: a variable-size all-gather)."""
        assert self.wire is not None
        iteration = self.steps - 1  # the iteration of the last step synced
        coded: torch.Tensor | Deferred
        slots, rows = self._at_capacity(touched)
        if self.wire.defers(touched.device):  # built at the tables' capacity: its length read with the sizes
            coded = self.wire.encode_capacity(slots, rows, touched, iteration)
        else:
            # The bounds from each table's rows at capacity (the touched rows' value range), read
            # with the touched counts the rows are then compacted by
            bounds, n_touched = self.wire.bounds(rows, iteration, touched)
            flat_slots, flat_rows = self._touched_rows(sum(n_touched))
            coded = self.wire.encode(
                list(flat_slots.split(n_touched)), list(flat_rows.split(n_touched)), iteration, bounds
            )
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
        hit, counts = held_slots([s for s, _ in parts], [None] * len(parts), self.layout)
        return Gathered(parts, hit, counts.tolist())

    def _apply(
        self,
        weights: torch.Tensor,
        momentum: torch.Tensor | None,
        sel: torch.Tensor,
        g: torch.Tensor,
        lr: float,
        eps: float,
    ) -> None:
        """FBGEMM's exact update of rows ``sel`` (every table's) of the flat weights with their
        summed gradient ``g``."""
        if self.rule == "sgd":
            weights.index_add_(0, sel, g, alpha=-lr)
            return
        assert momentum is not None  # (the rows' new state kept, not read back; ``w - x`` is ``w + -1 * x``)
        if self.rule == "adagrad":
            m = momentum.index_select(0, sel) + g * g
            step = lr * g / (m.sqrt() + eps)
        else:
            m = momentum.index_select(0, sel) + (g * g).mean(dim=1)
            step = (lr / (m.sqrt() + eps)).unsqueeze(1) * g
        momentum.index_copy_(0, sel, m)
        weights.index_add_(0, sel, step, alpha=-1)

    def pending_state(self) -> dict[str, Any]:
        """This rank's accumulated, not yet synchronised gradients (differ per rank: saved in its checkpoint file)."""
        return {"steps": self.steps, "pending": dict(self.pending), "touched": dict(self.touched)}

    def load_pending_state(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])
        for n in self.names:
            self.pending[n].copy_(state["pending"][n])
            self.touched[n].copy_(state["touched"][n])


def _views_of(flat: torch.Tensor, tensors: Sequence[torch.Tensor], bases: list[int]) -> bool:
    """Whether each of ``tensors`` starts at row ``bases[i]`` of ``flat`` (their host addresses)."""
    start, row = flat.data_ptr(), flat.element_size() * flat.stride(0)
    return all(t.data_ptr() == start + b * row for t, b in zip(tensors, bases, strict=True))


def _coalesced(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, values) of one table's gradient with each row once: a sparse gradient's duplicate
    lookups summed by the device's own coalescing (the order of those sums is its sort's), a
    dense gradient's non-zero rows."""
    c = (g if g.is_sparse else g.to_sparse(1)).coalesce()
    return c._indices()[0], c._values()
