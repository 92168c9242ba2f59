"""The one interface through which features act on the all-to-all's chunks.

The transport (:mod:`dlrm.embedding_comm.comm_ops`) encodes a chunk per peer with the direction's
codec and decodes what arrives; every feature that changes or watches that trip (duplicate-id
gradient sums, DCT-MP's forward positions, the row cache, its probe, auto's calibration) is a
:class:`Stage`, and the transport calls a collective's stages in order without naming any. A new
feature adds a stage, not a branch. Each hook's default does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dlrm.embedding_comm.bounds import Bounds
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm.embedding_comm.stats import CommStats
from dlrm_compression.format import Deferred, HostHead, read_heads


class Blocks(NamedTuple):
    """The column blocks of a chunk: one per (feature, shard), in column order."""

    features: list[str]
    widths: list[int]

    @property
    def dim(self) -> int:
        return sum(self.widths)


@dataclass
class Settle:
    """Device numbers (int64, 1-D) that an encoding stage needs on the host, and what it does
    with them once they are: the transport reads them with the collective's sizes."""

    values: torch.Tensor
    then: Callable[[list[int]], None]


@dataclass
class Outgoing:
    """A chunk on its way to one peer. Stages may replace ``chunk`` before it is encoded; an
    encoding stage sets ``payload`` and ``held`` (the chunk as the peer will decode it). Where
    ``deferrable``, the payload may keep its length on the device (a :class:`Deferred`) and the
    stage may leave work for after the collective's one read (``settle``)."""

    direction: str
    peer: int  # rank in the collective's group
    dst: int  # global rank
    chunk: torch.Tensor
    ids: torch.Tensor | None  # [rows, n_blocks], or None (dedup by value)
    blocks: Blocks
    bounds: Bounds | None  # absolute, per block (None: an unbounded codec)
    dc: DirectionCodec
    stats: CommStats
    payload: torch.Tensor | Deferred | None = None
    held: torch.Tensor | None = None
    deferrable: bool = False
    settle: Settle | None = None
    # Where set, whether ``ids`` hold is not read yet: a 0-d bool on the device says (only
    # stages that do not :meth:`Stage.reads_ids` see it; the row cache chooses on the device)
    single: torch.Tensor | None = None
    # each id's rows summed by the codec as it encodes (a gradient's; ``chunk`` keeps the rows)
    summed: bool = False


@dataclass
class Incoming:
    """A payload from one peer, with what names it in errors."""

    direction: str
    peer: int  # rank in the collective's group
    src: int  # global ranks of the sender and of this rank
    dst: int
    payload: torch.Tensor
    shape: tuple[int, int]
    ids: torch.Tensor | None
    blocks: Blocks
    window: torch.Tensor | None  # where the decoded chunk goes in the merged output, if anywhere
    dc: DirectionCodec
    stats: CommStats
    iteration: int
    where: str
    head: HostHead | None = None  # its head, check and a stage's prepared values, read with the collective's
    # decoded with no head read first, its verdict read after the collective's every decode
    # (DirectionCodec.checks_in_decode)
    checked_later: bool = False
    stored: bool = False  # the rows as they are (DirectionCodec.stored_size): no coder's payload


Prepared = tuple[int, torch.Tensor | None, Any]  # a payload's head bytes, device values read with it, state


def read_prepared(payloads: list[torch.Tensor], prepared: list[Prepared]) -> list[HostHead]:
    """Every payload's head with its prepared device values (a stage's or the codec's
    ``prepare_decode``), in one host synchronisation for all."""
    heads = read_heads(payloads, [p[1] for p in prepared], [p[0] for p in prepared]) if prepared else []
    for p, head in zip(prepared, heads, strict=True):
        head.state = p[2]
    return heads


class Stage:
    """A feature's hooks on a chunk's trip, in the order the transport calls them."""

    def needs_codec(self, direction: str) -> bool:
        """Whether this direction's chunks must be encoded even where every table chose ``none``."""
        return False

    def per_peer(self, direction: str) -> bool:
        """Whether this stage makes one chunk differ per peer (no payload is reused across peers)."""
        return False

    def reads_ids(self, direction: str) -> bool:
        """Whether this stage looks at this direction's chunk ids before they are encoded and
        needs them read (so which chunks hold ids is read first, not with the sizes); a stage
        that takes the device flag instead (``Outgoing.single``) does not."""
        return False

    def before_encode(self, c: Outgoing) -> None:
        """Change ``c.chunk`` before it is encoded."""

    def encode(self, c: Outgoing) -> bool:
        """Encode ``c`` in place of the codec (set ``c.payload``, ``c.held``); False: leave it."""
        return False

    def measure(self, c: Outgoing) -> bool:
        """Measure the encoded chunk without changing it; True if it did (its time is sampling's)."""
        return False

    def sees_payloads(self, direction: str) -> bool:
        """Whether this stage reads this direction's payloads as they are sent (measures them):
        they are then made one by one, their lengths read at once."""
        return False

    def decodes(self, r: Incoming) -> bool:
        """Whether this stage decodes ``r`` in place of the codec (then only its own
        :meth:`prepare_decode` may prepare it)."""
        return False

    def prepare_decode(self, r: Incoming) -> Prepared | None:
        """Where this stage decodes ``r`` and can read all it needs with the collective's one
        read: (bytes of the payload's head, int64 device values, state), which :meth:`decode`
        then finds in ``r.head`` (``data``, ``good``, ``extra``, ``state``); None: not so."""
        return None

    def decode(self, r: Incoming) -> torch.Tensor | None:
        """Decode ``r`` in place of the codec (into ``r.window`` if given); None: leave it."""
        return None

    def after_decode(self, r: Incoming, part: torch.Tensor) -> None:
        """Change or note the decoded chunk."""
