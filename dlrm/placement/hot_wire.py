"""One rank's hot-row gradient sync on the wire with ``placement.sync_codec=backward``: its touched
rows coded with the backward all-to-all's error-bounded codec and bound, and their slots.

Each table's bound is what the backward policy gives its feature (times the value range of the
table's rows being sent, in ``rel`` mode), rounded down to a power of two; on the CPU, tables whose
rounded bounds are equal share one codec payload coded at that bound, so a payload header (~120
bytes) is paid per bound class, not per table, and no row is coded looser than its table's own
bound. On an accelerator (version 2) that grouping would need the bounds on the host: there every
table is one block of a single codec payload, coded at its bound's class computed on the device,
of its rows at their capacity (the touched ones first, then padding: rows of the same table,
never read back; the table's row count says how many are sent), so the header is paid once. Its
rows go by the codec's id path, each row's id its position in its table's block (the rows sent
are distinct rows of the table; the padding takes id 0, and the codec codes each id's first row),
which drops the padding without the value dedup's hashes, sort and index: both ends know the ids'
plan from the row counts (the receiver computes their fingerprint on the host). The codec
quantises value by value, so a row decodes to the same bits either way.

Layout (little-endian)::

    prefix "<4sBBHII": magic b"HRW1", version (1: the check is zlib's crc32, built on the CPU; 2:
                       Adler-32, built on an accelerator, where a crc32 would copy the payload to
                       the host), slot width (2: int16 when every slot fits, else 4: int32),
                       parts (version 2: tables), rows, the check of everything after the prefix
    slots              rows x slot width, part after part (a part's rows in slot order)
    version 1:
    per part           rows (u32), payload bytes (u32)
    payloads           the parts' codec payloads, back to back (each self-describing, checksummed)
    version 2:
    per table          rows (u32)
    payload            one codec payload, a block per table at its capacity (its first rows sent)

A CPU rank that touched nothing sends the 16-byte prefix alone. Decoding is deterministic, so every
rank that decodes the same bytes gets the same rows, bit for bit. The payload is built and decoded
on the rows' device. On the CPU the host reads the bounds (all tables at once) to encode; on an
accelerator every size stays on the device (the size exchange reads the length). To decode every
rank's payload the host reads all their heads at once (prefix, part table, the check's verdict
and, version 2, the codec payload's head, whose check the payload's stands for), their slots, part
tables and codec heads taken on the device at their capacity by one gather a payload.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dlrm.embedding_comm.codec import DirectionCodec
from dlrm_compression import dedup, ops
from dlrm_compression import format as fmt
from dlrm_compression.composite import PerBlockCodec
from dlrm_compression.lossy import LossyCodec

MAGIC = b"HRW1"
CHECKS = {1: "crc32", 2: "adler32"}  # version -> the payload's check
VERSION = 1  # the CPU's (crc32)
_CHECK_AT = 12  # the check's offset in the prefix
_PREFIX = struct.Struct("<4sBBHII")
_PART = struct.Struct("<II")
_COUNT = struct.Struct("<I")  # version 2: a table's rows
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


class TableLayout:
    """Tables of ``sizes`` rows as one run of slots, table after table (``bases``: each table's
    first slot), and the constant index tensors that take a per-slot tensor to per-table answers
    in a fixed number of operations, whatever the number of tables (kept per device)."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = [int(s) for s in sizes]
        self.bases = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.n_slots, self.n_tables = sum(self.sizes), len(self.sizes)
        self.capacity = max(self.sizes, default=0)  # the largest table
        self.equal = len(set(self.sizes)) <= 1 and self.capacity > 0  # every table a row of a [tables, rows] view
        self._consts: dict[torch.device, dict[str, torch.Tensor]] = {}

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Each table's part of a per-slot tensor (views)."""
        return list(t.split(self.sizes))

    def _const(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._consts:
            sizes, cap = torch.tensor(self.sizes, dtype=torch.int64), max(self.capacity, 1)
            col = torch.arange(cap)
            clamp = torch.minimum(col[None, :], (sizes - 1).clamp(min=0)[:, None])  # a short table's last row
            consts = {
                "bases": torch.tensor(self.bases, dtype=torch.int64)[:, None],
                "column": col,
                "clamp": clamp,
                "live": col[None, :] < sizes[:, None],
                "table_of": torch.repeat_interleave(torch.arange(self.n_tables), sizes, output_size=self.n_slots),
            }
            self._consts[device] = {k: v.to(device) for k, v in consts.items()}
        return self._consts[device]

    def sums(self, flags: torch.Tensor) -> torch.Tensor:
        """Per table, how many of its slots ``flags`` (bool, per slot) holds: int64 [tables]."""
        if self.equal:
            return flags.view(self.n_tables, -1).sum(1)
        table_of = self._const(flags.device)["table_of"]
        return torch.zeros(self.n_tables, dtype=torch.int64, device=flags.device).index_add_(0, table_of, flags.long())

    def padded(self, flags: torch.Tensor) -> torch.Tensor:
        """A per-slot bool tensor as [tables, largest table] (False past a table's rows)."""
        if self.equal:
            return flags.view(self.n_tables, -1)
        c = self._const(flags.device)
        return flags[c["bases"] + c["clamp"]] & c["live"]

    def column(self, device: torch.device) -> torch.Tensor:
        """0..largest table - 1, int64 on ``device``."""
        return self._const(device)["column"]

    def globalise(self, pick: torch.Tensor) -> torch.Tensor:
        """Global slots of [tables, largest table] rows within each table; past a table's rows,
        its last one again."""
        c = self._const(pick.device)
        return (pick if self.equal else pick.gather(1, c["clamp"])) + c["bases"]

    def offsets(self, tables: Sequence[int], counts: Sequence[int], device: torch.device) -> torch.Tensor:
        """The first slot of table ``tables[i]``, ``counts[i]`` times each, int64 on ``device``."""
        bases = _on_int([self.bases[k] for k in tables], device)
        return torch.repeat_interleave(bases, _on_int(list(counts), device), output_size=sum(counts))


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
        if min(self.sizes, default=1) < 1:
            raise ValueError(f"the hot-row sync needs at least one row per table, got {self.sizes}")
        self.layout = TableLayout(self.sizes)
        self.width = slot_width(sum(self.sizes))
        self.slot_dtype = torch.int16 if self.width == 2 else torch.int32
        # fp32 bytes of the rows this rank coded, and their codec payloads' bytes (on the device
        # path device values, added there and read when reported)
        self._raw: int | torch.Tensor = 0
        self._coded: int | torch.Tensor = 0
        self._reads: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._halves_on: dict[torch.device, torch.Tensor] = {}

    @property
    def raw_row_bytes(self) -> int:
        return int(self._raw)

    @property
    def coded_row_bytes(self) -> int:
        return int(self._coded)

    def bounds(
        self, rows: torch.Tensor | Sequence[torch.Tensor], iteration: int, also: torch.Tensor | None = None
    ) -> tuple[list[float], list[int]]:
        """Each table's absolute bound for its rows: the backward policy's value for the feature
        (a fraction of the rows' value range in rel mode), read on the host all at once, with the
        caller's int64 device values ``also`` (returned as read). ``rows``: every table's rows as
        one block each at their capacity ([rows, tables x D], :meth:`encode_capacity`'s), or a
        list of each table's rows (a table with none: no bound needed, inf)."""
        empty: list[bool] = [False] * len(self.features)
        if not isinstance(rows, torch.Tensor):
            empty = [not len(r) for r in rows]
            capacity = max([1, *(len(r) for r in rows)])
            no_slots = [torch.zeros(len(r), dtype=torch.int64) for r in rows]
            rows = _at_capacity(no_slots, list(rows), self.dim, capacity)[1]
        values = self.direction.policy(self.features, iteration)
        found = self.direction.bounds(rows, [self.dim] * len(self.features), values)
        tensors = [found.reshape(-1).double()] if isinstance(found, torch.Tensor) else []
        extra = [] if also is None else [also.reshape(-1).to(torch.int64)]
        pieces = [t.view(torch.uint8) for t in [*tensors, *extra]]
        raw = _host(torch.cat(pieces)) if pieces else b""  # one read
        n = len(self.features) if tensors else 0
        if found is None:  # an unbounded codec (refused at construction)
            bounds = [math.inf] * len(self.features)
        else:
            bounds = list(struct.unpack_from(f"<{n}d", raw)) if tensors else [float(b) for b in found]
        bounds = [math.inf if e else b for b, e in zip(bounds, empty, strict=True)]
        return bounds, list(struct.unpack_from(f"<{len(raw) // 8 - n}q", raw, 8 * n))

    def encode(
        self,
        slots: Sequence[torch.Tensor],
        rows: Sequence[torch.Tensor],
        iteration: int,
        bounds: Sequence[float] | None = None,
    ) -> torch.Tensor | fmt.Deferred:
        """The payload (uint8, 1-D, on the rows' device) of each table's touched ``slots``
        (global, int64) and ``rows``; ``bounds``: :meth:`bounds`' of the rows, read already.
        Where :meth:`defers`, its length is still on the device (:meth:`settle` cuts it)."""
        device = rows[0].device if rows else torch.device("cpu")
        if self.defers(device):  # version 2 (a table with no rows: one row, not sent)
            sent = _on_int([len(s) for s in slots], device)
            if max(len(s) for s in slots) > self.layout.capacity:
                raise ValueError(f"more rows than the largest table's {self.layout.capacity} in one table")
            at_capacity = _at_capacity(list(slots), list(rows), self.dim, self.layout.capacity)
            return self.encode_capacity(*at_capacity, sent, iteration)
        parts: dict[float, Part] = {}
        if bounds is None:
            bounds = self.bounds(rows, iteration)[0]
        for s, r, b in zip(slots, rows, bounds, strict=True):
            if len(s):
                part = parts.setdefault(bound_class(b), Part(bound_class(b), [], []))
                part.slots.append(s)
                part.rows.append(r)
        payloads = []
        for part in parts.values():
            block = torch.cat(part.rows).contiguous()
            payloads.append(self.codec.encode(block, [part.bound], None, blocks=[block.shape[1]]))
            self._raw += block.numel() * 4
            self._coded += int(payloads[-1].numel())
        all_slots = [s for p in parts.values() for s in p.slots]
        ids = torch.cat(all_slots).to(device, self.slot_dtype) if all_slots else torch.zeros(0, dtype=self.slot_dtype)
        counts = [sum(len(s) for s in p.slots) for p in parts.values()]
        table = b"".join(_PART.pack(n, int(p.numel())) for n, p in zip(counts, payloads, strict=True))
        body = torch.cat([ids.to(device).view(torch.uint8), _on(table, device), *(p.reshape(-1) for p in payloads)])
        version = 2 if self.codec.backend_for(device).check == "adler32" else VERSION  # the codec payloads' choice
        check = zlib.crc32(body.numpy().data) if CHECKS[version] == "crc32" else 0  # .data: a buffer to every numpy
        out = torch.cat([_on(_PREFIX.pack(MAGIC, version, self.width, len(payloads), len(ids), check), device), body])
        if CHECKS[version] == "adler32":  # computed and written on the device
            ops.adler32_seal_(out, None, out.numel(), 0, _PREFIX.size, _CHECK_AT)
        return out

    def defers(self, device: torch.device) -> bool:
        """Whether payloads built on ``device`` are made without a host wait (:meth:`encode_capacity`):
        where the codec's are (the lossy codec's fixed-length coder and the device's check)."""
        return isinstance(self.codec, LossyCodec) and self.codec.defers(device)

    def encode_capacity(
        self, slots: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, iteration: int
    ) -> fmt.Deferred:
        """The device's payload (version 2, where :meth:`defers`), built without a host wait: every
        table's rows at their capacity, ``rows`` [capacity, tables x D] (table k's block: its first
        ``counts[k]`` rows, an int64 device tensor per table, are its touched rows, ``slots[k]``
        [tables, capacity] their global slots; the others are padding, rows of the same table that
        keep its range and are never read back), as one block each of one payload of
        :meth:`LossyCodec.encode_deferred` with the rows' positions as ids (:func:`dedup.position_ids`),
        each block at its table's bound class computed on the device. The slots and the counts
        are written from the device, the payload gathered behind them; the length stays on the
        device (the size exchange reads it, :meth:`settle`). A fixed number of operations whatever
        the number of tables."""
        assert isinstance(self.codec, LossyCodec)
        device, n_tables = counts.device, len(self.features)
        values = self.direction.policy(self.features, iteration)
        found = self.direction.bounds(rows, [self.dim] * n_tables, values)
        assert found is not None  # (a bounded codec)
        bounds = found if isinstance(found, torch.Tensor) else torch.tensor(found, dtype=torch.float64)  # abs: floats
        bounds = bounds.to(device, torch.float64, non_blocking=bounds.device.type == "cpu")
        classes = device_bound_class(bounds, self._halves(device)).masked_fill_(counts == 0, 1.0)  # (unread)
        keys = dedup.position_ids(counts, rows.shape[0])
        d = self.codec.encode_deferred(rows, classes, keys, blocks=[self.dim] * n_tables)
        coded = d if isinstance(d, fmt.Deferred) else fmt.Deferred(d, _on_int(d.numel(), device))
        slot_bytes = slots.to(self.slot_dtype, memory_format=torch.contiguous_format).view(torch.uint8)
        row_counts = counts.to(torch.int32).view(torch.uint8)  # u32s (each under the capacity)
        pieces = [*slot_bytes.unbind(0), row_counts, coded.buffer]
        lengths = [*(counts * self.width).unbind(0), _on_int(row_counts.numel(), device), coded.length]
        prefix = torch.frombuffer(bytearray(_PREFIX.pack(MAGIC, 2, self.width, n_tables, 0, 0)), dtype=torch.uint8)
        n_sent = counts.sum()
        rows_sent = n_sent.reshape(1).view(torch.uint8)[:4]  # a device value, in the prefix (2: Adler-32)
        out, total = ops.frame(
            prefix, [rows_sent], [8], pieces, [n.reshape(()) for n in lengths],
            [-1] * len(pieces), [0] * len(pieces), 1, 1, -1, -1,
        )  # fmt: skip
        ops.adler32_seal_(out, total, 0, 0, _PREFIX.size, _CHECK_AT)
        if not isinstance(self._raw, torch.Tensor) or not isinstance(self._coded, torch.Tensor):  # the first
            self._raw, self._coded = _on_int(int(self._raw), device), _on_int(int(self._coded), device)
        self._raw.add_(n_sent, alpha=self.dim * 4)
        self._coded.add_(coded.length)
        return fmt.Deferred(out, total)

    def _halves(self, device: torch.device) -> torch.Tensor:
        """0.5 (float64) per table on ``device``, kept."""
        if device not in self._halves_on:
            self._halves_on[device] = torch.full((len(self.features),), 0.5, dtype=torch.float64, device=device)
        return self._halves_on[device]

    @staticmethod
    def settle(payload: torch.Tensor | fmt.Deferred, n: int) -> torch.Tensor:
        """:meth:`encode`'s payload once its length ``n`` is read (a deferred one cut there)."""
        return payload.take(n) if isinstance(payload, fmt.Deferred) else payload

    def decode(self, payload: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots int64, fp32 rows [n, D]) of rank ``src``'s payload, on its device; any defect is
        a HotWireError."""
        return self.decode_all([payload], [src])[0][0]

    def decode_all(
        self, payloads: Sequence[torch.Tensor], srcs: Sequence[int] | None = None
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, list[int]]:
        """:meth:`decode` of every payload (rank ``srcs[i]``'s; default: rank i), and the slots any
        of them holds (bool per slot, and their count per table): one host read for all, of each
        payload's prefix, its part table and slots' range found on the device at their capacity
        (the most tables and slots there can be), the verdict of its check and the counts."""
        srcs = list(range(len(payloads))) if srcs is None else list(srcs)
        n_slots, n_tables = self.layout.n_slots, self.layout.n_tables

        def fail(i: int, why: str) -> HotWireError:
            return HotWireError(f"hot-row sync payload from rank {srcs[i]} ({payloads[i].numel()} bytes): {why}")

        on_device = bool(payloads) and self.codec.backend_for(payloads[0].device).check == "adler32"  # (else crc32)
        # where payloads are the device's (version 2), the codec's head is read here too
        codec_heads = on_device and self.defers(payloads[0].device)
        head_size = (self.codec.head_size(n_tables) or 0) if codec_heads else 0
        device = payloads[0].device if payloads else torch.device("cpu")
        at, column = self._read_at(device, head_size)
        n_bytes, pieces, slots = n_slots * self.width, [], []
        held = torch.zeros(n_slots + 1, dtype=torch.bool, device=device)  # the last: a spare for unsent slots
        for i, payload in enumerate(payloads):
            size = payload.numel()
            if size < _PREFIX.size:
                raise fail(i, f"shorter than its {_PREFIX.size}-byte prefix (truncated)")
            # one gather of its slots at capacity, prefix, part table and codec head (those two
            # past the slots: moved by its row count, read on the device)
            n_rows = payload[8:12].clone().view(torch.int32)
            got = payload[torch.addcmul(at[0], at[1], n_rows).clamp_(0, size - 1)]
            s = got[:n_bytes].view(self.slot_dtype).long()
            clamped, unsent = s.clamp(0, n_slots - 1), column >= n_rows
            in_range = ((clamped == s) | unsent).all()
            # the check's verdict: its int64's low byte (in_range: a placeholder, not read)
            check = _adler_holds(payload).reshape(1).view(torch.uint8)[:1] if on_device else in_range.reshape(1)
            pieces += [got[n_bytes:], check, in_range.reshape(1)]
            held.index_fill_(0, clamped.masked_fill(unsent, n_slots), True)
            slots.append(clamped)
        hit = held[:n_slots]
        counts = self.layout.sums(hit)
        raw = _host(torch.cat([*pieces, counts.view(torch.uint8)]))  # the one read
        base = _PREFIX.size + n_tables * _PART.size  # prefix, part table (then the codec head, the flags)
        out, step = [], base + head_size + 2
        for i, payload in enumerate(payloads):
            head = raw[i * step : i * step + base] + raw[(i + 1) * step - 2 : (i + 1) * step]  # with the flags
            codec_head = raw[i * step + base : (i + 1) * step - 2]
            magic, version, width, n_parts, n_rows, check = _PREFIX.unpack_from(head)
            if magic != MAGIC or version not in CHECKS:
                raise fail(i, f"not a hot-row sync payload (magic {magic!r}, version {version})")
            if width != self.width:
                raise fail(i, f"slot width {width} bytes, expected {self.width} for {n_slots} slots")
            start = _PREFIX.size + n_rows * width  # the part table (version 2: the row counts)
            end = start + n_parts * (_PART.size if version == 1 else _COUNT.size)
            if payload.numel() < end:
                raise fail(i, f"truncated: {n_rows} slots and {n_parts} parts need {end} bytes before the rows")
            if CHECKS[version] == "crc32":  # the CPU's: the bytes themselves (no wait there)
                good = zlib.crc32(_host(payload[_PREFIX.size :])) == check
            else:  # the device's verdict (a payload from another kind of device: checked here)
                good = head[-2] == 1 if on_device else bool(_adler_holds(payload))
            if not good:
                raise fail(i, "checksum mismatch (corrupted or truncated)")
            if n_rows > n_slots or n_parts > n_tables or (version == 2 and n_parts != n_tables):  # an encoder's bug
                raise fail(i, f"{n_rows} slots in {n_parts} parts, for {n_slots} slots of {n_tables} tables")
            if head[-1] != 1:
                raise fail(i, f"slot ids outside 0..{n_slots - 1}")
            if version == 1:
                rows = self._rows(payload, head, end, n_rows, functools.partial(fail, i))
            else:  # the codec's check: the payload's, which covers its bytes (the device's verdict)
                read = fmt.HostHead(codec_head, True, []) if codec_heads else None
                rows = self._tables(payload, head, end, n_rows, functools.partial(fail, i), read)
            out.append((slots[i][:n_rows], rows))
        n_held = list(struct.unpack_from(f"<{n_tables}q", raw, len(payloads) * step))
        return out, hit, n_held

    def _read_at(self, device: torch.device, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode_all`'s gather of a payload: its byte offsets and, [2, n] int64, how far
        each moves per row sent (the slots at capacity, the prefix, the part table, ``head_size``
        bytes of codec head), and each slot's column (kept per device and head size)."""
        if (device, head_size) not in self._reads:
            n, w, t, p = self.layout.n_slots * self.width, self.width, self.layout.n_tables, _PREFIX.size
            head = torch.arange(p + t * _COUNT.size, p + t * _COUNT.size + head_size)
            at = torch.cat([p + torch.arange(n), torch.arange(p), p + torch.arange(t * _PART.size), head])
            moves = (torch.arange(at.numel()) >= n + p) * w
            consts = (torch.stack([at, moves]), torch.arange(self.layout.n_slots))
            self._reads[device, head_size] = tuple(c.to(device) for c in consts)  # type: ignore[assignment]
        return self._reads[device, head_size]

    def _rows(
        self, payload: torch.Tensor, head: bytes, at: int, n_rows: int, fail: Callable[[str], HotWireError]
    ) -> torch.Tensor:
        """The fp32 rows of a version-1 payload's parts (their rows and bytes in the part table
        of ``head``, the payloads from ``at``)."""
        n_parts = _PREFIX.unpack_from(head)[3]
        sizes = [_PART.unpack_from(head, _PREFIX.size + k * _PART.size) for k in range(n_parts)]
        if sum(n for n, _ in sizes) != n_rows or at + sum(b for _, b in sizes) != payload.numel():
            raise fail(f"parts of {sizes} (rows, bytes) do not add up to {n_rows} rows and the payload's length")
        rows = []
        for i, (n, nbytes) in enumerate(sizes):
            try:
                block = self.codec.decode(payload[at : at + nbytes].clone())
            except Exception as e:  # any codec failure: name the rank and the part
                raise fail(f"part {i}: {type(e).__name__}: {e}") from e
            if tuple(block.shape) != (n, self.dim):
                raise fail(f"part {i} decoded shape {tuple(block.shape)}, its entry says ({n}, {self.dim})")
            rows.append(block.float())
            at += nbytes
        return torch.cat(rows) if rows else torch.zeros(0, self.dim, device=payload.device)

    def _tables(
        self,
        payload: torch.Tensor,
        head: bytes,
        at: int,
        n_rows: int,
        fail: Callable[[str], HotWireError],
        read: fmt.HostHead | None,
    ) -> torch.Tensor:
        """The fp32 rows of a version-2 payload: each table's first rows (its count in ``head``)
        of its block of the codec payload at ``at`` (``read``: its head, read already)."""
        counts = struct.unpack_from(f"<{len(self.sizes)}I", head, _PREFIX.size)
        if sum(counts) != n_rows:
            raise fail(f"row counts {list(counts)} do not add up to {n_rows} rows")
        past = [k for k, c in enumerate(counts) if c > self.layout.capacity]
        if past:  # (an encoder's bug, or a forged check: they would index past the codec's rows)
            k = past[0]
            raise fail(f"table {self.features[k]!r}: {counts[k]} rows, past the capacity of {self.layout.capacity}")
        try:
            assert isinstance(self.codec, LossyCodec)  # (a version-2 payload is its encode_deferred's)
            # the rows' ids as the sender's (the rows of the codec payload: checked against them)
            keys = dedup.host_position_ids(list(counts), self.layout.capacity, payload.device)
            block = self.codec.decode(payload[at:].clone(), keys, head=read)
        except Exception as e:  # any codec failure: name the rank
            raise fail(f"rows: {type(e).__name__}: {e}") from e
        if block.shape[0] < max(counts, default=0) or block.shape[1] != self.dim * len(counts):  # (an encoder's bug)
            raise fail(f"decoded shape {tuple(block.shape)}, for {len(counts)} tables of up to {max(counts)} rows")
        rows = [b[:n] for b, n in zip(block.float().split(self.dim, 1), counts, strict=True)]
        return torch.cat(rows) if rows else torch.zeros(0, self.dim, device=payload.device)


def held_slots(
    slots: Sequence[torch.Tensor], valid: Sequence[torch.Tensor | None], layout: TableLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the tables' slots (``layout``'s) any of ``slots`` holds where ``valid`` (None:
    all), as bool, and their count per table (int64): on the slots' device, no host wait, a
    fixed number of operations per part whatever the number of tables."""
    total = layout.n_slots
    device = slots[0].device if slots else torch.device("cpu")
    held = torch.zeros(total + 1, dtype=torch.bool, device=device)  # the last: a spare for what is not valid
    for s, ok in zip(slots, valid, strict=True):
        held.index_fill_(0, s if ok is None else torch.where(ok, s, total), True)
    held = held[:total]
    return held, layout.sums(held)


def _at_capacity(
    slots: list[torch.Tensor], rows: list[torch.Tensor], dim: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each table's ``slots`` [tables, capacity] and ``rows`` as one block per table
    [capacity, tables x dim] (``capacity``: at least the longest list's rows), every table's repeating its
    first past its own (a table with none: a zero row, slot 0): :meth:`SyncWire.encode_capacity`'s
    layout of per-table lists."""
    at = torch.arange(capacity)
    s_out, r_out = [], []
    for s, r in zip(slots, rows, strict=True):
        if not len(s):
            s, r = s.new_zeros(1), r.new_zeros(1, dim)
        pick = torch.where(at < len(s), at, 0).to(s.device)
        s_out.append(s.index_select(0, pick))
        r_out.append(r.index_select(0, pick.to(r.device)))
    return torch.stack(s_out), torch.cat(r_out, 1)


def _adler_holds(payload: torch.Tensor) -> torch.Tensor:
    """Whether a payload's Adler-32 check holds (0-d int64, 1 or 0, on its device)."""
    return ops.adler32_holds(payload, None, payload.numel(), 0, _PREFIX.size, _CHECK_AT)


def _on(raw: bytes, device: torch.device) -> torch.Tensor:
    """Host bytes (the framing) as a uint8 tensor on ``device``, sent without waiting for its queue."""
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def device_bound_class(bound: torch.Tensor, halves: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`bound_class` of float64 bounds on their device (no host wait); ``halves``: 0.5 each."""
    halves = torch.full_like(bound, 0.5) if halves is None else halves
    return torch.ldexp(halves, torch.frexp(bound).exponent) * (bound > 0)  # (a power of two, or 0)


def _on_int(values: int | list[int], device: torch.device) -> torch.Tensor:
    """Host integers as an int64 tensor on ``device``, sent without waiting for its queue."""
    t = torch.tensor(values, dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _host(t: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor on the host (a copy and a wait on a device)."""
    return t.cpu().numpy().tobytes()
