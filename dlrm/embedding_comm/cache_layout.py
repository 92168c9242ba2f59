"""The layout of a row-cached chunk (``compression.forward.cache``, :mod:`.forward_cache`): its
column blocks as ``[blocks, rows, width]``, every block's unique ids looked up (:class:`Look`),
where each block's fresh then moved rows go in the payload (:func:`laid_out`, rebuilt alike by
both sides from the held ids and the moved bits), the rows both sides hold after a chunk
(:func:`merged`), the held ids' bits, and the device payload's framing (:func:`pack`). Each is a
fixed number of whole-tensor operations on the chunk's device, whatever its number of blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from dlrm.embedding_comm.codec import DirectionCodec
from dlrm_compression import format as fmt
from dlrm_compression import row_ops
from dlrm_compression.row_cache import RowCaches

PAYLOAD_ID = 11  # the format's codec id of the device payload (the codecs' ids run from 1 to 10)


class Columns:
    """A chunk's column blocks (``widths``) as ``[blocks, rows, width]`` (narrower blocks padded
    with zeros to the widest), and back: views where every block has the same width."""

    def __init__(self, widths: Sequence[int]) -> None:
        self.widths = [int(w) for w in widths]
        self.n, self.width = len(self.widths), max(self.widths, default=0)
        self.equal = len(set(self.widths)) <= 1
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _map(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(each padded column's source column, the spare past the chunk's for padding; each
        chunk column's padded column)."""
        if device not in self._maps:
            total, c = sum(self.widths), 0
            src: list[int] = []
            back: list[int] = []
            for k, w in enumerate(self.widths):
                src += [*range(c, c + w), *[total] * (self.width - w)]
                back += range(k * self.width, k * self.width + w)
                c += w
            self._maps[device] = (torch.tensor(src).to(device), torch.tensor(back).to(device))
        return self._maps[device]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, columns] as [rows, blocks, width]."""
        if self.equal:
            return x.view(x.shape[0], self.n, self.width)
        src, _ = self._map(x.device)
        return torch.nn.functional.pad(x, (0, 1)).index_select(1, src).view(x.shape[0], self.n, self.width)

    def chunk(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, blocks, width] (contiguous) as [rows, columns] (into ``out`` if given)."""
        if not self.equal:
            got = rows.reshape(rows.shape[0], self.n * self.width).index_select(1, self._map(rows.device)[1])
            return got if out is None else out.copy_(got)
        if out is None:
            return rows.view(rows.shape[0], self.n * self.width)
        out.view(rows.shape).copy_(rows)
        return out


class Look(NamedTuple):
    """Every block of a chunk at capacity (its unique ids ascending, then padding), looked up in
    its cache: [blocks, rows] each."""

    group: RowCaches
    cols: Columns
    uid: torch.Tensor
    valid: torch.Tensor  # the blocks' unique ids (not padding)
    counts: torch.Tensor  # how many per block (int64 [blocks])
    first: torch.Tensor  # a row of the chunk holding each
    inverse: torch.Tensor  # each chunk row's unique id, per block
    rows: torch.Tensor  # the cache's row holding each (0: not held)
    held: torch.Tensor
    keys: torch.Tensor  # their keys in the cache's index


class Laid(NamedTuple):
    """Where every block's fresh rows, then its moved ones, go in the payload (both sides
    rebuild it from the held ids and the moved bits)."""

    moved: torch.Tensor
    fresh: torch.Tensor  # (the ids a store adds)
    order: torch.Tensor  # the unique id of each payload row (past the block's sent rows: its first's)
    place: torch.Tensor  # each unique id's row in the payload (past its block's sent rows: another)
    sending: torch.Tensor  # the payload's rows (bool [blocks, rows]: its block's first n_sent)
    empty: torch.Tensor  # blocks that send no row
    n_held: torch.Tensor  # held ids per block (int64 [blocks])
    ids: torch.Tensor  # the payload rows' ids, [blocks, rows] (-1: an empty block's)

    @property
    def n_sent(self) -> torch.Tensor:
        """The rows each block sends (int64 [blocks])."""
        return self.sending.sum(1)


def laid_out(look: Look, moved: torch.Tensor) -> Laid:
    """Every block's payload rows: its fresh rows, then its ``moved`` ones, each in ascending id
    order, shorter blocks repeating their first row (:func:`compression.row_ops.row_layout`: one
    kernel; the places of hits and padding, past the sent rows, nothing reads)."""
    return Laid(moved, *row_ops.row_layout(look.valid, look.held, moved, look.uid))


def merge(
    look: Look, laid: Laid, decoded: torch.Tensor, delta: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(every block's unique rows as both sides hold them, at capacity: held for hits, decoded for
    fresh, held + decoded difference for moved (whole where not ``delta``), [blocks, rows, width];
    the chunk's rows, [rows, columns], into ``out`` if given); ``decoded``: the payload's rows,
    [rows, columns]. One kernel (:func:`compression.row_ops.row_merge`) reads the held rows too."""
    unique, rows = row_ops.row_merge(
        look.cols.padded(decoded), laid.place, laid.fresh, laid.moved, look.group.table, look.rows, delta, look.inverse
    )
    return unique, look.cols.chunk(rows, out)


def moved_of(held: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Each held id's bit (1: moved), the blocks' held ids one after another in ``bits``."""
    at = held.reshape(-1).cumsum(0)  # a held id's rank (1-based): its bit after a leading 0
    return torch.nn.functional.pad(bits, (1, 0)).index_select(0, at).view_as(held) & held


def held_bits(held: torch.Tensor, moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's bits of its held ids (1: moved), one block after another, packed at
    capacity, and their byte count (int64 0-d): the host path's bits, with no host wait."""
    return row_ops.row_bits(held, moved)  # (compression.row_ops.row_bits)


def first_rows(x: torch.Tensor, n: int, fill: float = 0.0) -> torch.Tensor:
    """``x``'s first ``n`` rows, padded with ``fill`` rows where it has fewer."""
    if x.shape[0] >= n:
        return x[:n]
    return torch.cat([x, x.new_full((n - x.shape[0], *x.shape[1:]), fill)])


_BITS = (7, 6, 5, 4, 3, 2, 1, 0)  # np.packbits' order: the first bit is the most significant
_MASKS: dict[torch.device, torch.Tensor] = {}


def _masks(device: torch.device) -> torch.Tensor:
    if device not in _MASKS:
        _MASKS[device] = torch.tensor([1 << b for b in _BITS], dtype=torch.uint8).to(device)
    return _MASKS[device]


def unpackbits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """``np.unpackbits(packed, count=count)`` as bool, on its device."""
    return ((packed.unsqueeze(1) & _masks(packed.device)) != 0).reshape(-1)[:count]


def pack(
    x: torch.Tensor,
    widths: Sequence[int],
    coded: torch.Tensor,
    inner: torch.Tensor | fmt.Deferred,
    delta: torch.Tensor,
    bits: tuple[torch.Tensor, torch.Tensor],
) -> fmt.Deferred:
    """The device payload: a format payload (its own check) of the sent rows' lossy payload
    first, where the host reads its head with the collective's, then the flags, then the bits."""
    header = fmt.Header(PAYLOAD_ID, x.dtype, x.shape[0], x.shape[1], list(widths), coded)
    rows: list[tuple[torch.Tensor, fmt.Length]] = (
        [(inner.buffer, inner.length)] if isinstance(inner, fmt.Deferred) else [(inner, inner.numel())]
    )
    flags = delta.view(torch.uint8)
    return fmt.pack_deferred(header, [rows, [(flags, flags.numel())], [bits]], x.device)


SECTIONS = 3  # of the device payload


def code(
    dc: DirectionCodec, cols: torch.Tensor, ids: torch.Tensor, widths: Sequence[int], bounds: Sequence[float]
) -> torch.Tensor:
    """One lossy payload of the blocks' payload rows ``cols`` [n, columns] under ``ids`` [n,
    blocks]: shorter blocks repeat their first row under its id (dedup sends it once); an empty
    block carries one zero row under id -1."""
    return dc.encode(cols, list(widths), list(bounds), ids)


def decode_rows(dc: DirectionCodec, inner: torch.Tensor, ids: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """The payload rows of :func:`_code`'s payload (both sides rebuild the same ids), [n, columns]."""
    return dc.codec.decode(inner, ids)
