"""``compression.input: auto``: the input all-to-all sends raw or coded as ``compression=auto`` plans.

The strategy (``dlrm/strategy/controller.py``) sets :attr:`InputSwitch.coded` on every rank at
the same iteration boundary, and each call reads it once, when TorchRec's pipeline starts it (a
batch ahead), and keeps it to its end: sender and receiver of a batch's input always agree,
whatever the pipeline holds in flight when the plan changes. While the strategy calibrates, a
raw call also codes its payloads on the side (not sent) and decodes them, for the coded option's
ratio and time on this run's own batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.embedding_comm.stats import CommStats
from dlrm_compression.ids_codec import IdsCodec


@dataclass
class InputSwitch:
    """Whether the input dists send coded ids, shared by all of a sharder's input dists."""

    coded: bool = False  # raw until a plan says ``ids``
    calibrating: bool = False
    training: bool = True  # set by the sharded EBC per call: only training batches are sampled
    dists: int = 0  # input dists switched (each runs once per batch)
    # one per raw call while calibrating: (raw bytes, coded bytes, encode s, decode s) this rank sends
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)

    def raw_call(
        self, pg: Any, splits: list[int], kjt: KeyedJaggedTensor, codec: IdsCodec, stats: CommStats, raw: int
    ) -> None:
        """Count a call that sends ``kjt`` raw (``raw`` bytes to the peers, TorchRec's own
        all-to-all); while calibrating, also code it on the side."""
        stats.add("input/wire_bytes", raw)
        stats.add("input/raw_bytes", raw)
        stats.add("input/calls", 1)
        if self.calibrating and self.training:
            self.samples.append(_measure(pg, splits, kjt, codec, raw))


def _measure(pg: Any, splits: list[int], kjt: KeyedJaggedTensor, codec: IdsCodec, raw: int) -> tuple:
    """What the coded call would send (the payloads and the splits + sizes exchange, as
    ``CompressedKJTAllToAll`` counts them) and the seconds to encode them and decode the peers'."""
    ws, me = pg.size(), pg.rank()
    with torch.no_grad():
        t0 = time.perf_counter()
        payloads = codec.encode(kjt.lengths(), kjt.values(), kjt.stride_per_key(), kjt.weights_or_none(), splits)
        t1 = time.perf_counter()
        peers = [p for p in range(len(payloads)) if p != me]  # what the peers decode, decoded here
        codec.decode_all(
            [payloads[p] for p in peers], [f"input calibration payload of rank {me} for rank {p}" for p in peers]
        )
        t2 = time.perf_counter()
    words = len(kjt.dist_labels()) + (0 if kjt.variable_stride_per_key() else 1) + 1
    wire = sum(p.numel() for i, p in enumerate(payloads) if i != me) + 8 * words * (ws - 1)
    return float(raw), float(wire), t1 - t0, t2 - t1
