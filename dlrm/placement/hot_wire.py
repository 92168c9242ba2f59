"""One rank's hot-row gradient sync on the wire with ``placement.sync_codec=backward``: its touched
rows coded with the backward all-to-all's error-bounded codec and bound, and their slots.

Each table's bound is what the backward policy gives its feature (times the value range of the
table's rows being sent, in ``rel`` mode), rounded down to a power of two; tables whose rounded
bounds are equal share one codec payload coded at that bound, so a payload header (~120 bytes) is
paid per bound class, not per table, and no row is coded looser than its table's own bound.

Layout (little-endian)::

    prefix "<4sBBHII": magic b"HRW1", version, slot width (2: int16 when every slot fits, else 4:
                       int32), parts, rows, crc32 of everything after the prefix
    slots              rows x slot width, part after part (a part's rows in slot order)
    per part           rows (u32), payload bytes (u32)
    payloads           the parts' codec payloads, back to back (each self-describing, checksummed)

A rank that touched nothing sends the 16-byte prefix alone. Decoding is deterministic, so every
rank that decodes the same bytes gets the same rows, bit for bit.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dlrm.embedding_comm.bounds import host_bounds
from dlrm.embedding_comm.codec import DirectionCodec
from dlrm_compression.composite import PerBlockCodec

MAGIC, VERSION = b"HRW1", 1
_PREFIX = struct.Struct("<4sBBHII")
_PART = struct.Struct("<II")
INT16_SLOTS = 1 << 15  # int16 slot ids hold 0..32767
HEADER_BYTES = _PREFIX.size + _PART.size  # a payload's framing with one bound class


class HotWireError(ValueError):
    """A hot-row sync payload could not be decoded (truncated, corrupted, or not one)."""


def slot_width(n_slots: int) -> int:
    """Bytes per slot id on the wire: int16 when every slot of every table fits, else int32."""
    return 2 if n_slots <= INT16_SLOTS else 4


def bound_class(bound: float) -> float:
    """A bound rounded down to a power of two (0 stays 0: the rows are then sent exactly)."""
    return 0.0 if bound <= 0 else math.ldexp(1.0, math.frexp(bound)[1] - 1)


@dataclass
class Part:
    """Rows of one bound class: their slots and fp32 rows (in slot order, table after table)."""

    bound: float
    slots: list[torch.Tensor]
    rows: list[torch.Tensor]


class SyncWire:
    """Encodes and decodes one rank's sync payload: ``features`` names each table (in slot order,
    ``sizes`` slots each) for the policy, rows of width ``dim``; ``codec`` is the run's backward
    direction codec."""

    def __init__(self, codec: DirectionCodec, features: Sequence[str], sizes: Sequence[int], dim: int) -> None:
        if not codec.bounded:
            raise ValueError(f"the hot-row sync needs an error-bounded backward codec, got {codec.spec.codec!r}")
        self.direction = codec
        # compression=auto: the per_block codec's bounded fallback (no per-table choice to follow here)
        inner = codec.codec
        self.codec = inner.options[inner.fallback] if isinstance(inner, PerBlockCodec) else inner
        self.features, self.sizes, self.dim = list(features), [int(s) for s in sizes], int(dim)
        self.width = slot_width(sum(self.sizes))
        self.slot_dtype = torch.int16 if self.width == 2 else torch.int32
        self.raw_row_bytes = 0  # fp32 bytes of the rows this rank coded
        self.coded_row_bytes = 0  # their codec payloads' bytes

    def bounds(self, rows: Sequence[torch.Tensor], iteration: int) -> list[float]:
        """Each table's absolute bound for its rows: the backward policy's value for the feature
        (a fraction of the rows' value range in rel mode)."""
        out = []
        for f, r in zip(self.features, rows, strict=True):
            if not len(r):  # nothing to send: no bound needed (a range of no rows is undefined)
                out.append(math.inf)
                continue
            (value,) = self.direction.policy([f], iteration)
            b = host_bounds(self.direction.bounds(r, [r.shape[1]], [value]))
            out.append(math.inf if b is None else b[0])
        return out

    def encode(self, slots: Sequence[torch.Tensor], rows: Sequence[torch.Tensor], iteration: int) -> torch.Tensor:
        """The payload (uint8, 1-D) of each table's touched ``slots`` (global, int64) and ``rows``."""
        parts: dict[float, Part] = {}
        for s, r, b in zip(slots, rows, self.bounds(rows, iteration), strict=True):
            if len(s):
                part = parts.setdefault(bound_class(b), Part(bound_class(b), [], []))
                part.slots.append(s)
                part.rows.append(r)
        payloads = []
        for part in parts.values():
            block = torch.cat(part.rows).contiguous()
            payloads.append(self.codec.encode(block, [part.bound], None, blocks=[block.shape[1]]))
            self.raw_row_bytes += block.numel() * 4
            self.coded_row_bytes += int(payloads[-1].numel())
        all_slots = [s for p in parts.values() for s in p.slots]
        ids = torch.cat(all_slots).to(self.slot_dtype) if all_slots else torch.zeros(0, dtype=self.slot_dtype)
        counts = [sum(len(s) for s in p.slots) for p in parts.values()]
        body = b"".join(
            [
                ids.numpy().tobytes(),
                b"".join(_PART.pack(n, int(p.numel())) for n, p in zip(counts, payloads, strict=True)),
                b"".join(p.numpy().tobytes() for p in payloads),
            ]
        )
        prefix = _PREFIX.pack(MAGIC, VERSION, self.width, len(payloads), len(ids), zlib.crc32(body))
        return torch.frombuffer(bytearray(prefix + body), dtype=torch.uint8)

    def decode(self, payload: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots int64, fp32 rows [n, D]) of rank ``src``'s payload; any defect is a HotWireError."""
        raw = payload.numpy().tobytes()

        def fail(why: str) -> HotWireError:
            return HotWireError(f"hot-row sync payload from rank {src} ({len(raw)} bytes): {why}")

        if len(raw) < _PREFIX.size:
            raise fail(f"shorter than its {_PREFIX.size}-byte prefix (truncated)")
        magic, version, width, n_parts, n_rows, crc = _PREFIX.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise fail(f"not a hot-row sync payload (magic {magic!r}, version {version})")
        if width != self.width:
            raise fail(f"slot width {width} bytes, expected {self.width} for {sum(self.sizes)} slots")
        head = _PREFIX.size + n_rows * width + n_parts * _PART.size
        if len(raw) < head:
            raise fail(f"truncated: {n_rows} slots and {n_parts} parts need {head} bytes before the rows")
        if zlib.crc32(raw[_PREFIX.size :]) != crc:
            raise fail("checksum mismatch (corrupted or truncated)")
        slots = torch.from_numpy(np.frombuffer(raw, np.int16 if width == 2 else np.int32, n_rows, _PREFIX.size).copy())
        sizes = [_PART.unpack_from(raw, _PREFIX.size + n_rows * width + i * _PART.size) for i in range(n_parts)]
        if sum(n for n, _ in sizes) != n_rows or head + sum(b for _, b in sizes) != len(raw):
            raise fail(f"parts of {sizes} (rows, bytes) do not add up to {n_rows} rows and the payload's length")
        if n_rows and (int(slots.min()) < 0 or int(slots.max()) >= sum(self.sizes)):
            raise fail(f"slot ids outside 0..{sum(self.sizes) - 1}")
        rows, at = [], head
        for i, (n, size) in enumerate(sizes):
            try:
                block = self.codec.decode(torch.frombuffer(bytearray(raw[at : at + size]), dtype=torch.uint8))
            except Exception as e:  # any codec failure: name the rank and the part
                raise fail(f"part {i}: {type(e).__name__}: {e}") from e
            if tuple(block.shape) != (n, self.dim):
                raise fail(f"part {i} decoded shape {tuple(block.shape)}, its entry says ({n}, {self.dim})")
            rows.append(block.float())
            at += size
        return slots.to(torch.int64), torch.cat(rows) if rows else torch.zeros(0, self.dim)
