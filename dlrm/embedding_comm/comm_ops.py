"""Variable-size compressed all-to-all with autograd, in TorchRec's Req/Wait pattern.

Mirrors ``torchrec.distributed.comm_ops`` (``All2All_Pooled_Req`` / ``_Wait``): ``Req.forward``
sends (:func:`_send`: :mod:`~dlrm.embedding_comm.send`'s plan -> encode -> exchange, the byte
all-to-all left in flight), returning TorchRec's ``Request.dummy_tensor``; ``Wait.forward`` waits
and decodes (:func:`_receive`: :mod:`~dlrm.embedding_comm.receive`). In backward
``Wait.backward`` sends the gradient, ``Req.backward`` waits, decodes and divides by the world
size as TorchRec does (``GRADIENT_DIVISION``). A call's plan for both directions is a
:class:`CompressedA2AInfo` over a layout (:mod:`~dlrm.embedding_comm.layout`).

Features act on the chunks through the stage interface (:mod:`dlrm.embedding_comm.stage`): each
collective call carries its stages, which the transport calls in order, naming none of them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.autograd import Function
from torchrec.distributed.comm_ops import Request, get_gradient_division

from dlrm.embedding_comm.layout import CompressedA2AInfo, PooledA2ALayout, ReduceScatterLayout
from dlrm.embedding_comm.receive import decode
from dlrm.embedding_comm.send import Transfer, a2a_name, encode, exchange, marked, plan, send_raw
from dlrm.embedding_comm.stage import Blocks

__all__ = ["Blocks", "CompressedA2AInfo", "PooledA2ALayout", "ReduceScatterLayout", "compressed_all_to_all"]


def _send(pg: dist.ProcessGroup, info: CompressedA2AInfo, d: str, chunks: list[torch.Tensor]) -> Transfer:
    """Plan, encode and exchange one side of a collective: the byte all-to-all left in flight."""
    sends = plan(info, d, chunks, pg.rank())
    if sends.raw:
        return send_raw(pg, info, d, chunks)
    return exchange(pg, info, sends, encode(info, sends))


def _receive(pg: dist.ProcessGroup, info: CompressedA2AInfo, d: str, tr: Transfer) -> torch.Tensor:
    """Wait for the bytes, then :func:`decode` them into the merged output."""
    t0 = time.perf_counter()
    if tr.work is not None:
        with marked(info, d, a2a_name(info, d)):
            tr.work.wait()
    t1 = time.perf_counter()
    out = decode(info, d, tr, pg.rank())
    info.stats.add(f"{d}/comm_ms", 1e3 * (t1 - t0))
    info.stats.add(f"{d}/codec_ms", 1e3 * (time.perf_counter() - t1))
    return out


class CompressedAll2All_Req(Function):
    """Forward: encode + launch; backward: wait + decode the gradient (cf. All2All_Pooled_Req)."""

    @staticmethod
    def forward(
        ctx, pg: dist.ProcessGroup, myreq: Request, info: CompressedA2AInfo, input: torch.Tensor
    ) -> torch.Tensor:
        transfer = _send(pg, info, "forward", info.layout.split("forward", input))
        myreq.req = transfer.work
        myreq.tensor = transfer
        myreq.a2ai = info
        myreq.wait_function = CompressedAll2All_Wait
        ctx.myreq = myreq
        ctx.pg = pg
        return myreq.dummy_tensor

    @staticmethod
    def backward(ctx, *unused: torch.Tensor) -> tuple[None, None, None, torch.Tensor]:
        myreq, pg = ctx.myreq, ctx.pg
        grad_input = _receive(pg, myreq.a2ai, "backward", myreq.tensor)
        if get_gradient_division():  # as TorchRec: equivalent to running on a single rank
            grad_input.div_(pg.size())
        myreq.req = None
        myreq.tensor = None
        myreq.dummy_tensor = None
        return (None, None, None, grad_input)


class CompressedAll2All_Wait(Function):
    """Forward: wait + decode + merge; backward: encode the gradient + launch (cf. All2All_Pooled_Wait)."""

    @staticmethod
    def forward(ctx, pg: dist.ProcessGroup, myreq: Request, *dummy_tensor: torch.Tensor) -> torch.Tensor:
        info, transfer = myreq.a2ai, myreq.tensor
        myreq.req = None
        myreq.tensor = None
        ctx.myreq = myreq
        ctx.pg = pg
        ctx.info = info
        return _receive(pg, info, "forward", transfer)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        myreq, pg, info = ctx.myreq, ctx.pg, ctx.info
        transfer = _send(pg, info, "backward", info.layout.split("backward", grad_output.contiguous()))
        myreq.req = transfer.work
        myreq.tensor = transfer
        return (None, None, myreq.dummy_tensor)


def compressed_all_to_all(pg: dist.ProcessGroup, info: CompressedA2AInfo, input: torch.Tensor) -> Request:
    """Start one compressed collective; ``.wait()`` on the result gives the merged output."""
    myreq = Request(pg, device=input.device)
    CompressedAll2All_Req.apply(pg, myreq, info, input)
    return myreq
