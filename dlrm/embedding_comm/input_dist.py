"""The input (KJT) all-to-all with its ids and lengths coded losslessly (``compression.input: ids``).

Mirrors TorchRec's ``KJTAllToAll`` (``torchrec/distributed/dist_data.py``) and keeps its two
awaitables, so that ``TrainPipelineSparseDist`` still runs the input dist one batch ahead: the
first exchanges TorchRec's splits plus each payload's size (one collective, one host
synchronisation), the second sends the payloads of :class:`compression.ids_codec.IdsCodec` in
one byte all-to-all and rebuilds, with TorchRec's own ``dist_init`` and recat, exactly the
``KeyedJaggedTensor`` the stock all-to-all delivers. A rank's own share never travels or is coded.

Both ends leave the codec's sorted ids on the KJT they coded (the sender's) or rebuilt (the
receiver's, per source rank's bags), where the output all-to-all's dedup by id of the same batch
takes them instead of sorting again (:func:`dlrm.embedding_comm.ids.attach_plans`): carried by
the batch's own KJT, so the pipeline running the input dist a batch ahead cannot mix them up.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllTensorsAwaitable, _get_recat
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.embedding_comm.ids import attach_plans
from dlrm.embedding_comm.input_switch import InputSwitch
from dlrm.embedding_comm.stats import CommStats
from dlrm_compression.format import PayloadError
from dlrm_compression.ids_codec import IdsCodec, IdsPart, KeyPlans


def stock_input_bytes(pg: Any, splits: list[int], kjt: KeyedJaggedTensor) -> int:
    """Bytes a rank's stock KJT all-to-all sends to other ranks: each tensor's share for the
    peers, and the splits exchange before it (one int64 per tensor and the stride, per peer)."""
    ws, me = pg.size(), pg.rank()
    if ws == 1:
        return 0
    sent = 0
    for tsplits, t in zip(kjt.dist_splits(splits), kjt.dist_tensors(), strict=True):
        sent += sum(n for p, n in enumerate(tsplits) if p != me) * t.element_size()
    words = len(kjt.dist_labels()) + (0 if kjt.variable_stride_per_key() else 1)
    return sent + 8 * words * (ws - 1)


class CompressedKJTAllToAll(KJTAllToAll):
    """``KJTAllToAll`` whose lengths, ids and weights travel as one coded payload per peer."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        splits: list[int],
        stagger: int,
        codec: IdsCodec,
        stats: CommStats,
        switch: InputSwitch | None = None,
    ):
        super().__init__(pg, splits, stagger)
        self.codec, self.stats = codec, stats
        self.switch = switch  # compression.input=auto: the strategy says whether to code
        if switch is not None and pg.size() > 1:  # a group of one never calls the switch
            switch.dists += 1
        self.calls = 0

    @classmethod
    def from_stock(
        cls, stock: KJTAllToAll, codec: IdsCodec, stats: CommStats, switch: InputSwitch | None = None
    ) -> CompressedKJTAllToAll:
        return cls(stock._pg, stock._splits, stock._stagger, codec, stats, switch)

    def __setattr__(self, name: str, value: Any) -> None:
        """Keep our ``forward``: TrainPipelineSparseDist replaces every input dist's forward by one
        that hands TorchRec's splits to a fused exchange, which would send the ids uncoded."""
        if name != "forward":
            super().__setattr__(name, value)

    def forward(self, input: KeyedJaggedTensor) -> Awaitable[KJTAllToAllTensorsAwaitable]:
        if self._pg.size() == 1:
            return super().forward(input)
        if self.switch is not None and not self.switch.coded:  # read once per call, when it starts
            raw = stock_input_bytes(self._pg, self._splits, input)
            self.switch.raw_call(self._pg, self._splits, input, self.codec, self.stats, raw)
            return super().forward(input)
        with torch.no_grad():
            self.calls += 1
            return _CodedSplitsAwaitable(self, input)


class _CodedSplitsAwaitable(Awaitable[KJTAllToAllTensorsAwaitable]):
    """Codes the payloads and launches the splits + sizes exchange; its wait launches the bytes."""

    def __init__(self, module: CompressedKJTAllToAll, kjt: KeyedJaggedTensor) -> None:
        super().__init__()
        pg, splits = module._pg, module._splits
        ws, me = pg.size(), pg.rank()
        self.module, self.kjt = module, kjt
        self.labels = kjt.dist_labels()
        self.input_splits = kjt.dist_splits(splits)
        self.tensors = kjt.dist_tensors()
        device = kjt.device()
        weights = kjt.weights_or_none()
        t0 = time.perf_counter()
        payloads, plans = module.codec.encode_with_plan(
            kjt.lengths(), kjt.values(), kjt.stride_per_key(), weights, splits
        )
        if not kjt.variable_stride_per_key():
            attach_plans(kjt, plans, 0, [0] * len(kjt.keys()))  # each key's bags from the first
        module.stats.add("input/codec_ms", 1e3 * (time.perf_counter() - t0))
        payloads[me] = torch.zeros(0, dtype=torch.uint8, device=device)  # our own share stays raw
        self.payloads = payloads
        words = [list(s) for s in self.input_splits]
        if not kjt.variable_stride_per_key():
            words.append([kjt.stride()] * ws)
        words.append([p.numel() for p in payloads])
        send = torch.tensor(words, dtype=torch.int64, device=device).t().contiguous()
        self.recv = torch.empty_like(send)
        self.work = dist.all_to_all_single(self.recv, send, group=pg, async_op=True)
        module.stats.add("input/wire_bytes", sum(p.numel() for p in payloads) + 8 * len(words) * (ws - 1))
        module.stats.add("input/raw_bytes", stock_input_bytes(pg, splits, kjt))
        module.stats.add("input/calls", 1)

    def _wait_impl(self) -> KJTAllToAllTensorsAwaitable:
        self.work.wait()
        got = self.recv.t().tolist()  # the one host synchronisation of the exchange
        output_splits, sizes = got[: len(self.labels)], got[-1]
        stride_per_rank = None if self.kjt.variable_stride_per_key() else got[len(self.labels)]
        return _CodedTensorsAwaitable(self, output_splits, sizes, stride_per_rank)


class _CodedTensorsAwaitable(KJTAllToAllTensorsAwaitable):
    """The byte all-to-all of the payloads; its wait decodes them into TorchRec's output tensors.

    A ``KJTAllToAllTensorsAwaitable`` (its attributes set as TorchRec sets them), so that TorchRec
    copies its splits, recat and batch sizes into the sharding context as for the stock one."""

    def __init__(
        self, req: _CodedSplitsAwaitable, output_splits: list[list[int]], sizes: list[int], stride: list[int] | None
    ) -> None:
        Awaitable.__init__(self)
        module, kjt = req.module, req.kjt
        self._pg, self._workers, self._device = module._pg, module._pg.size(), kjt.device()
        self._input, self._splits, self._stagger = kjt, module._splits, module._stagger
        self._input_splits_list, self._output_splits_list = req.input_splits, output_splits
        self._input_splits = dict(zip(req.labels, req.input_splits, strict=True))
        self._output_splits = dict(zip(req.labels, output_splits, strict=True))
        me = self._pg.rank()
        self._keys = kjt.keys()[sum(self._splits[:me]) : sum(self._splits[: me + 1])]
        self._stride_per_rank = stride
        self._recat = _get_recat(
            local_split=self._splits[me],
            num_splits=len(self._splits),
            stagger=self._stagger,
            device=self._device,
            batch_size_per_rank=stride,
        )
        self._req, self._sizes, self._labels = req, sizes, req.labels
        self._input_tensors: list[torch.Tensor] = []  # the stock clear_inputs frees nothing of ours
        self._awaitables: list[Any] = []
        self._plans: dict[int, KeyPlans] = {}  # per source rank, as decoded
        self._bags: dict[int, list[int]] = {}
        self._buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self._device)
        send = torch.cat(req.payloads)
        self._work = dist.all_to_all_single(
            self._buffer, send, sizes, [p.numel() for p in req.payloads], group=self._pg, async_op=True
        )

    def _wait_impl(self) -> KeyedJaggedTensor:
        self._work.wait()
        me, req = self._pg.rank(), self._req
        chunks = torch.split(self._buffer, self._sizes)
        t0 = time.perf_counter()
        decoded = iter(self._decode_all([(src, c) for src, c in enumerate(chunks) if src != me]))
        req.module.stats.add("input/codec_ms", 1e3 * (time.perf_counter() - t0))
        parts: list[list[torch.Tensor]] = [[] for _ in self._labels]
        for src in range(len(chunks)):
            if src == me:
                got = [t[sum(s[:me]) : sum(s[: me + 1])] for t, s in zip(req.tensors, req.input_splits, strict=True)]
            else:
                got = next(decoded)
            for out, t in zip(parts, got, strict=True):
                out.append(t)
        tensors = [torch.cat(p) for p in parts]
        out = type(self._input).dist_init(
            keys=self._keys,
            tensors=tensors,
            variable_stride_per_key=self._input.variable_stride_per_key(),
            num_workers=self._workers,
            recat=self._recat,
            stride_per_rank=self._stride_per_rank,
            stagger=self._stagger,
        )
        self._attach_plans(out)
        return out

    def _attach_plans(self, out: KeyedJaggedTensor) -> None:
        """Each decoded source's key plans on ``out``, at its bags: recat puts key after key and,
        within a key, source rank after source rank (fixed strides and no stagger only)."""
        stride = self._stride_per_rank
        if stride is None or self._stagger != 1 or out.stride() != sum(stride):
            return
        for src, plans in self._plans.items():
            if all(n == stride[src] for n in self._bags[src]):
                attach_plans(out, plans, 0, [sum(stride[:src])] * len(self._keys))

    def _where(self, src: int) -> str:
        return (
            f"input all-to-all payload from rank {src} to rank {self._pg.rank()} "
            f"(keys {self._keys}, call {self._req.module.calls})"
        )

    def _decode_all(self, chunks: list[tuple[int, torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Every peer's share as TorchRec's tensors, in its labels' order: their payloads decoded
        together (one head read and one consistency check for all of them)."""
        wheres = [self._where(src) for src, _ in chunks]
        try:
            parts = self._req.module.codec.decode_all([c for _, c in chunks], wheres, keys=len(self._keys))
        except PayloadError as e:
            named = any(w in str(e) for w in wheres)
            raise PayloadError(str(e) if named or len(wheres) != 1 else f"{wheres[0]}: {e}") from None
        return [self._taken(part, src) for (src, _), part in zip(chunks, parts, strict=True)]

    def _taken(self, part: IdsPart, src: int) -> list[torch.Tensor]:
        """One peer's decoded share as TorchRec's tensors, checked against the splits exchanged."""
        where = self._where(src)
        if part.plan is not None and len(part.bags_per_key) == len(self._keys):
            self._plans[src], self._bags[src] = part.plan, part.bags_per_key
        by_label = {"lengths": part.lengths, "values": part.values, "weights": part.weights}
        if "strides" in self._labels:  # (variable strides per key)
            by_label["strides"] = torch.tensor(part.bags_per_key, dtype=torch.int64, device=part.lengths.device)
        expect = {label: self._output_splits[label][src] for label in self._labels}
        out = []
        for label in self._labels:
            t = by_label.get(label)
            if t is None or t.numel() != expect[label]:
                raise PayloadError(
                    f"{where}: {label} holds {None if t is None else t.numel()}, splits say {expect[label]}"
                )
            out.append(t)
        return out
