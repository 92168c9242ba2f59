"""The codec's own features as transport stages: duplicate-id gradients, DCT-MP's forward
positions and compression=auto's calibration (see :mod:`dlrm.embedding_comm.stage`)."""

from __future__ import annotations

import torch

from dlrm.embedding_comm.ids import keep_first_duplicates, sum_duplicates
from dlrm.embedding_comm.stage import Incoming, Outgoing, Stage


class DuplicateIds(Stage):
    """Gradients by id (``backward.dedup``): the sender sums the rows of each id and sends the sum
    once; the receiver keeps it on the id's first row and zeros the others (what the owner's
    optimizer sums is then the same). Where the codec does both itself (one op each way on the
    device, :meth:`DirectionCodec.merges_ids`), this stage only asks it to."""

    def before_encode(self, c: Outgoing) -> None:
        if c.ids is not None and c.direction == "backward" and c.dc.dedup:
            if c.dc.merges_ids(c.chunk.device):
                c.summed = True
            else:
                c.chunk = sum_duplicates(c.chunk, c.ids, c.blocks.widths)

    def after_decode(self, r: Incoming, part: torch.Tensor) -> None:
        if r.ids is not None and r.direction == "backward" and r.dc.dedup and not r.dc.merges_ids(r.payload.device):
            keep_first_duplicates(part, r.ids, r.blocks.widths)


class ForwardPositions(Stage):
    """DCT-MP's ``backward.params.forward_positions``: the gradient travels only where the forward
    payload from that peer kept an entry (the derivative of the thresholding). One per collective
    call: the forward's positions per source peer, kept for its backward."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}

    def per_peer(self, direction: str) -> bool:
        return direction == "backward"

    def before_encode(self, c: Outgoing) -> None:
        if c.direction == "backward":
            zero = torch.zeros((), dtype=c.chunk.dtype, device=c.chunk.device)
            c.chunk = torch.where(self.kept[c.peer], c.chunk, zero)

    def after_decode(self, r: Incoming, part: torch.Tensor) -> None:
        if r.direction == "forward" and r.stored:  # the rows as they are: every entry kept
            self.kept[r.peer] = part.new_ones(r.shape, dtype=torch.bool)
        elif r.direction == "forward":
            self.kept[r.peer] = r.dc.kept(r.payload, r.shape, r.head)


class Calibration(Stage):
    """compression=auto while calibrating: every option measured on one real chunk per direction
    and training call (:meth:`DirectionCodec.calibrate`); that direction goes through the codec."""

    def __init__(self) -> None:
        self.pending = {"forward", "backward"}

    def needs_codec(self, direction: str) -> bool:
        return direction in self.pending

    def reads_ids(self, direction: str) -> bool:
        return direction in self.pending  # every option measured with the chunk's ids

    def measure(self, c: Outgoing) -> bool:
        if c.direction not in self.pending:
            return False
        c.dc.samples.extend(c.dc.calibrate(c.chunk, c.blocks.features, c.blocks.widths, c.bounds, c.ids))
        self.pending.discard(c.direction)
        return True
