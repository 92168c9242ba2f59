"""Lossless codec of a jagged batch of ids (the input all-to-all's lengths and values), per key.

Why: an id is 8 bytes and a length 4, but a key's ids in one batch hold few distinct values and
Criteo bags all have one id. Per key the payload carries

* lengths as a frame of reference: the smallest length, then each length minus it at the bits
  of the spread (a constant length costs no bits: the "one flag" case);
* ids as the sorted distinct ids (the first raw, then gaps minus one at the bits of the largest
  gap; gaps wrap modulo 2**64, so the ends of int64 round-trip) plus, per lookup, its index
  among them at ceil(log2(distinct)) bits;
* per-sample weights as they are.

A payload that would code no smaller than its lengths, ids and weights as they are (small
batches, where the per-key plan and the header outweigh what they save, or ids with nothing to
share) is sent **stored**: those tensors' bytes behind a 24-byte header (:data:`STORED_BYTES`),
checked like a coded one. A payload is never more than its raw bytes and that header (and a bag
count per key where the keys' batch sizes differ).

Every destination and every key is coded at once, on the tensors' device, in a number of
dispatcher operations that depends neither on the batch, the keys nor the destinations (the
launch budget of docs/gpu.md): segmented reductions over all keys after one sort by (key, id),
one bit-packing op for every destination's stream, one concatenation that frames them all, one
check op for all of them (:mod:`compression.ops`). :meth:`IdsCodec.encode` takes one host
synchronisation for the whole call (the keys' sizes), :meth:`IdsCodec.decode_all` two for all the
payloads of a collective (their heads and plans with their checks' verdicts, then the
consistency of what they decode to). On a CPU tensor an optional zstd stage codes the packed bits
when that is smaller. A coded payload is the checksummed container of :mod:`compression.format`
(the same bytes as before stored payloads existed); a corrupted or truncated payload of either
kind raises :class:`~compression.format.PayloadError`, never yields wrong ids.

Over 500 lines because encode and decode share one layout (the per-key field table whose first
bits the device's pack and unpack both compute, and the stored payload's header): kept in one
module so that one reading checks both sides of it.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zstandard

from . import format as fmt
from . import ops
from .backend import Backend, backend_for, upload
from .format import PayloadError, view_as

CODEC_ID = 10
_FIELDS = 7  # per key: bags, ids, distinct, length base, length bits, gap bits, index bits
_BAGS, _IDS, _DISTINCT, _LEN_BASE, _LEN_BITS, _GAP_BITS, _IDX_BITS = range(_FIELDS)
_ZSTD, _WEIGHTS, _VALUES32, _LENGTHS64 = 1, 2, 4, 8  # flags in info[1] (a stored payload: in its flags byte)
_BAGS_VARY = 16  # a stored payload's flag: a bag count per key follows its header (else one for all)
_INT_DTYPES = (torch.int32, torch.int64)

# A stored payload: magic | version u8 (:data:`STORED_VERSION`) | codec id u8 | weights' dtype u8
# | flags u8 (bit 0: the check is Adler-32, as the container's) | keys u32 | ids u32 | bags per
# key u32 (0 where they vary) | check u32 (over every other byte, where the container has its)
# | [bags u32 per key, padded to 8] | lengths | pad | ids | pad | weights | pad, as the sender's dtypes.
STORED_VERSION = 2  # the version byte of a stored payload (a coded one is the container's, format.VERSION)
# (the receiver tells the kinds apart by this byte: a bump of format.VERSION must move it too)
_STORED = struct.Struct("<4sBBBBIIII")
STORED_BYTES = _STORED.size
_CHECK_AT = 20  # both kinds: the u32 check after the first 20 bytes
_HEAD_READ = 4096  # bytes read per payload with its verdict when the caller gives no key count
_BIG = 1 << 63


KEY_BYTES = 4 * _FIELDS + 8  # per key: its plan (int32 words) and its first distinct id
PAYLOAD_BYTES = fmt.head_bytes(0, 3)  # the container's header of a payload without weights: no blocks, 3 sections


def expected_bytes(bags: float, ids: float, distinct: float, id_range: float, lengths_vary: bool) -> float:
    """E[payload bytes] of one key (its framing included, not the payload's header): ``ids``
    lookups in ``bags`` bags, ``distinct`` of them distinct, spread over ``id_range`` ids. The
    largest gap between sorted distinct ids is priced as for uniform spread, (range / distinct)
    x (1 + ln distinct); lengths cost no bits when constant, one bit (0 or 1) when ``lengths_vary``.
    """
    if ids <= 0:
        return KEY_BYTES + (bags / 8 if lengths_vary else 0.0)
    d = max(distinct, 1.0)
    index_bits = math.ceil(math.log2(d)) if d > 1 else 0
    gap = id_range / d * (1 + math.log(d))
    gap_bits = min(max(math.ceil(math.log2(gap)), 0), max(int(id_range).bit_length(), 1)) if d > 1 else 0
    length_bits = bags if lengths_vary else 0
    return KEY_BYTES + (ids * index_bits + (d - 1) * gap_bits + length_bits) / 8


@dataclass
class KeyPlans:
    """What the codec computes per key of a batch, for whoever dedups the same ids again
    (the output all-to-all's dedup by id): each lookup's index among its key's sorted distinct
    ids, and how many there are. Sizes on the host (the codec read them), indices on the device."""

    ids_per_key: list[int]
    single: list[bool]  # every bag of the key holds exactly one id (so lookup i is bag i)
    distinct: torch.Tensor  # int64 [keys]
    index: torch.Tensor  # int64 [ids], key after key: each lookup's index among its key's distinct ids

    def key_index(self, k: int) -> torch.Tensor:
        """Key ``k``'s indices (one per lookup)."""
        start = sum(self.ids_per_key[:k])
        return self.index[start : start + self.ids_per_key[k]]


@dataclass
class IdsPart:
    """One destination's share of a jagged batch: keys in order, each key's bags contiguous."""

    lengths: torch.Tensor
    values: torch.Tensor
    bags_per_key: list[int]
    weights: torch.Tensor | None = None
    plan: KeyPlans | None = None  # its keys' distinct ids as the decoder rebuilt them (a stored payload: none)


def _key_plans(host: list[list[int]], distinct: torch.Tensor, index: torch.Tensor) -> KeyPlans:
    """:class:`KeyPlans` from a payload plan read on the host (its rows) and the device values."""
    single = [r[_BAGS] > 0 and r[_LEN_BASE] == 1 and r[_LEN_BITS] == 0 for r in host]
    return KeyPlans([r[_IDS] for r in host], single, distinct, index)


def stored_bytes(
    bags_per_key: Sequence[int], ids: int, lengths_item: int, values_item: int, weights_item: int = 0
) -> int:
    """The bytes of a stored payload of these keys' bags, ``ids`` ids and the dtypes' item sizes
    (``weights_item`` 0: no weights): the header, the bag counts where they vary, the tensors (each
    aligned to its items: the wider first) and zeros to 8 bytes."""
    vary = len(set(bags_per_key)) > 1
    table = _pad8(4 * len(bags_per_key)) if vary else 0
    return STORED_BYTES + table + _pad8(sum(bags_per_key) * lengths_item + ids * (values_item + weights_item))


def _stored_order(items: Sequence[int]) -> list[int]:
    """The order of a stored payload's tensors (lengths, ids, weights by their item sizes): the
    wider first, so that each starts aligned to its items without padding between them."""
    return sorted(range(len(items)), key=lambda i: -items[i])


def _pad8(n: int) -> int:
    return n + (-n % 8)


@dataclass
class _Sorted:
    """One encode's device work before its host read: every key's ids sorted by (key, id), and
    per key the sizes the host reads (``stats``, a row each: ids less 2**63, ~min length, max
    length, distinct ids up to the key's last, the largest gap with its top bit flipped, ~smallest
    id; -2**63 where a key has no bags or no ids)."""

    lens: torch.Tensor  # int64 [bags]
    bag_key: torch.Tensor  # [bags]: each bag's key
    key: torch.Tensor  # [ids] sorted: each sorted id's key
    order: torch.Tensor  # [ids]: each sorted id's place in the batch
    count: torch.Tensor  # [ids] sorted: distinct (key, id) pairs up to here, this one included
    gap: torch.Tensor  # [ids] sorted: at each key's later distinct ids, the gap to the one before minus one; else 0
    stats: torch.Tensor  # int64 [6, keys]


def _sort_by_key_and_id(lengths: torch.Tensor, values: torch.Tensor, bags_per_key: list[int]) -> _Sorted:
    """Every key at once (segmented reductions over a sort by id, then a stable one by key)."""
    dev = values.device
    k, nb, ni = len(bags_per_key), lengths.numel(), values.numel()
    bags = upload(torch.tensor(bags_per_key, dtype=torch.int64), dev)
    bag_key = torch.repeat_interleave(bags, output_size=nb)
    lens = lengths.to(torch.int64)
    stats = torch.full((6, k), -_BIG, dtype=torch.int64, device=dev)  # (a row per figure: the CPU's fast layout)
    ids = stats[0].index_add_(0, bag_key, lens)  # (from -2**63)
    # the smallest length as the largest complement: one amax for both ends
    spread = torch.stack([~lens, lens])
    stats[1:3].scatter_reduce_(1, bag_key[None, :].expand(2, nb), spread, "amax")
    id_key = torch.repeat_interleave(ids + _BIG, output_size=ni)  # a wrong length sum shows as a size error here
    by_id, by_id_at = torch.sort(values.to(torch.int64), stable=True)
    key, at = torch.sort(id_key[by_id_at], stable=True)
    sv, order = by_id[at], by_id_at[at]
    first = torch.empty(ni, dtype=torch.bool, device=dev)  # the first id of its key (in sorted order)
    first[:1] = True
    torch.ne(key[1:], key[:-1], out=first[1:])
    step = torch.empty(ni, dtype=torch.int64, device=dev)  # (step[0] is never read: first[0] holds)
    torch.sub(sv[1:], sv[:-1], out=step[1:])
    moved = step != 0
    count = (first | moved).cumsum(0)
    gap = torch.add(step, moved, alpha=-1).masked_fill_(first, 0)  # wraps mod 2**64: a gap of 2**64-1 fits
    # per key: distinct ids up to its last, the largest gap as unsigned (top bit flipped), the smallest id
    tops = torch.stack([count, gap ^ -_BIG, ~sv])
    stats[3:6].scatter_reduce_(1, key[None, :].expand(3, ni), tops, "amax")
    return _Sorted(lens, bag_key, key, order, count, gap, stats)


def _plan_rows(stats: list[list[int]], bags_per_key: list[int]) -> tuple[list[list[int]], list[int]]:
    """Each key's plan row (:data:`_FIELDS`) and first distinct id, from :class:`_Sorted`'s stats."""
    rows, base, before = [], [], 0
    for nbag, (total, low, high, upto, gap, least) in zip(bags_per_key, zip(*stats, strict=True), strict=True):
        ids = total + _BIG
        lo, hi = (~low, high) if nbag else (0, 0)
        distinct = upto - before if ids else 0
        before = upto if ids else before
        gap_bits = (gap + _BIG).bit_length() if ids else 0
        rows.append([nbag, ids, distinct, lo, (hi - lo).bit_length(), gap_bits, max(distinct - 1, 0).bit_length()])
        base.append(~least if ids else 0)
    return rows, base


def _stream_bits(rows: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """Bits of the lengths, gaps and indices of these keys' stream."""
    return (
        sum(r[_BAGS] * r[_LEN_BITS] for r in rows),
        sum(r[_DISTINCT] * r[_GAP_BITS] for r in rows),
        sum(r[_IDS] * r[_IDX_BITS] for r in rows),
    )


def _u32(values: Sequence[int]) -> bytes:
    """Little-endian u32 words (as the int32 tensor the plan was: wrapping)."""
    return struct.pack(f"<{len(values)}I", *(v & 0xFFFFFFFF for v in values))


def _i64(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


@dataclass
class _Dest:
    """One destination's share and how it travels."""

    keys: range
    bags: range  # its bags in the batch
    ids: range  # its ids in the batch
    rows: list[list[int]]  # its keys' plan rows
    total: int  # bits of its stream
    word: int  # where its stream starts in the packed words
    stored: bool = False
    head: bytes = b""  # its bytes before the device's: the container's header, plan and first ids, or the stored header
    bits: bytes | None = None  # its bits zstd-coded (host payloads), if smaller
    size: int = 0


class IdsCodec:
    """Lengths + ids (+ weights) of a jagged batch -> one payload per destination -> back, exactly.

    ``entropy``: try zstd over the packed bits of host payloads and keep it where smaller;
    ``backend``: where its stages run (:func:`compression.backend.backend_for`'s choice).
    """

    codec_id = CODEC_ID

    def __init__(self, entropy: bool = True, level: int = 1, backend: str = "auto") -> None:
        backend_for("cpu", backend)  # (checks the choice)
        self.entropy, self.level, self.backend = entropy, level, backend

    # -- encode --------------------------------------------------------------------------------

    def encode(
        self,
        lengths: torch.Tensor,
        values: torch.Tensor,
        bags_per_key: list[int],
        weights: torch.Tensor | None = None,
        keys_per_dest: list[int] | None = None,
    ) -> list[torch.Tensor]:
        """One payload per destination, destination d holding the next ``keys_per_dest[d]`` keys
        (default: all keys, one payload). One host synchronisation for the whole call."""
        return self.encode_with_plan(lengths, values, bags_per_key, weights, keys_per_dest)[0]

    def encode_with_plan(
        self,
        lengths: torch.Tensor,
        values: torch.Tensor,
        bags_per_key: list[int],
        weights: torch.Tensor | None = None,
        keys_per_dest: list[int] | None = None,
    ) -> tuple[list[torch.Tensor], KeyPlans]:
        """:meth:`encode`'s payloads, and every key's distinct ids as it computed them. The
        payloads are views of one buffer (every destination's, framed and checked at once)."""
        _check_inputs(lengths, values, bags_per_key, weights)
        bags_per_key = list(bags_per_key)
        keys_per_dest = [len(bags_per_key)] if keys_per_dest is None else list(keys_per_dest)
        if sum(keys_per_dest) != len(bags_per_key):
            raise ValueError(
                f"keys_per_dest {keys_per_dest} sums to {sum(keys_per_dest)}, not {len(bags_per_key)} keys"
            )
        lengths, values = lengths.contiguous(), values.contiguous()
        weights = None if weights is None else weights.contiguous()
        dev = values.device
        b = backend_for(dev, self.backend)
        s = _sort_by_key_and_id(lengths, values, bags_per_key)
        rows, base = _plan_rows(s.stats.tolist(), bags_per_key)  # the one host synchronisation
        dests = _destinations(rows, keys_per_dest)
        zstd = self.entropy and b.on_host and dev.type == "cpu"  # the bits' sizes known after packing
        if not zstd:
            for d in dests:
                self._head(d, base, lengths, values, weights, b)
        table = _pack_table(rows, dests)
        heads = b"".join(d.head for d in dests)
        up = upload(torch.frombuffer(bytearray(table + heads + bytes(8)), dtype=torch.uint8), dev)
        k, n_words = len(rows), sum(-(-d.total // 64) for d in dests)
        t = up[: 64 * k].view(torch.int64).view(k, 8)
        distinct = up[64 * k : 72 * k].view(torch.int64)
        # each field's value and first bit: bags by length, sorted ids by their distinct id's gap
        # and by their own index (an id that repeats the one before adds nothing: 0 at its gap's place)
        by_bag = t[:, 0:3].index_select(0, s.bag_key)
        by_id = t[:, 3:8].index_select(0, s.key)
        index = s.count - by_id[:, 4]
        packed = ops.bits_pack(
            torch.cat([s.lens - by_bag[:, 0], s.gap, index]),
            torch.cat(
                [
                    torch.addcmul(by_bag[:, 1], torch.arange(s.lens.numel(), device=dev), by_bag[:, 2]),
                    torch.addcmul(by_id[:, 0], s.count, by_id[:, 1]),
                    torch.addcmul(by_id[:, 2], s.order, by_id[:, 3]),
                ]
            ),
            n_words,
        ).view(torch.uint8)
        inverse = torch.empty_like(index).index_put_((s.order,), index)
        if zstd:
            host = packed.numpy()
            for d in dests:
                n = -(-d.total // 8)
                if n > 64:
                    frame = zstandard.ZstdCompressor(level=self.level).compress(host[8 * d.word : 8 * d.word + n])
                    d.bits = frame if len(frame) < n else None
                self._head(d, base, lengths, values, weights, b)
        up_heads = up[72 * k :] if not zstd else None
        pieces, at, spans = [], 0, []
        for d in dests:
            head = (
                up_heads[at : at + len(d.head)]
                if up_heads is not None
                else torch.frombuffer(bytearray(d.head), dtype=torch.uint8)
            )
            at += len(d.head)
            pieces += [head, *self._body(d, packed, lengths, values, weights, up[-8:])]
            spans.append(d.size)
        out = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=dev)
        starts = [sum(spans[:i]) for i in range(len(spans))]
        _seal(out, starts, spans, b)
        payloads = [out[a : a + n] for a, n in zip(starts, spans, strict=True)]
        return payloads, _key_plans(rows, distinct, inverse)

    def _head(
        self,
        d: _Dest,
        base: list[int],
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        b: Backend,
    ) -> None:
        """Choose how ``d`` travels (stored where coding saves nothing) and write its header."""
        nk, nb, ni = len(d.keys), len(d.bags), len(d.ids)
        witem = 0 if weights is None else weights.element_size()
        flags = (_VALUES32 if values.dtype == torch.int32 else 0) | (_LENGTHS64 if lengths.dtype == torch.int64 else 0)
        flags |= 0 if weights is None else _WEIGHTS
        wdt = weights.dtype if weights is not None else torch.float32
        nbits = len(d.bits) if d.bits is not None else -(-d.total // 8)
        sections = [4 * _FIELDS * nk, 8 * nk, nbits, *([ni * witem] if weights is not None else [])]
        header = fmt.Header(
            codec_id=CODEC_ID,
            dtype=wdt,
            rows=nb,
            cols=0,
            widths=[],
            bounds=[],
            info=[nk, flags | (_ZSTD if d.bits is not None else 0), d.total & 0xFFFFFFFF, d.total >> 32],
        )
        coded = fmt.header_bytes(header, sections, b.check)
        coded_size = len(coded) + sum(_pad8(n) for n in sections)
        bags = [r[_BAGS] for r in d.rows]
        stored_size = stored_bytes(bags, ni, lengths.element_size(), values.element_size(), witem)
        d.stored = stored_size <= coded_size
        if d.stored:
            vary = len(set(bags)) > 1
            flags |= (_BAGS_VARY if vary else 0) | (fmt.ADLER32 if b.check == "adler32" else 0)
            d.bits, d.size = None, stored_size
            table = _u32(bags) + bytes(-4 * nk % 8) if vary else b""
            one = 0 if vary or not bags else bags[0]
            d.head = _STORED.pack(fmt.MAGIC, STORED_VERSION, CODEC_ID, fmt.DTYPES[wdt], flags, nk, ni, one, 0) + table
        else:
            plan = [v for r in d.rows for v in r]
            keys = base[d.keys.start : d.keys.stop]
            d.head = coded + _u32(plan) + bytes(-4 * len(plan) % 8) + _i64(keys)
            d.size = coded_size

    @staticmethod
    def _body(
        d: _Dest,
        packed: torch.Tensor,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        zeros: torch.Tensor,
    ) -> list[torch.Tensor]:
        """``d``'s bytes after its header, as views where the device holds them (``zeros``: 8 zero
        bytes there, for the padding)."""

        def padded(t: torch.Tensor) -> list[torch.Tensor]:
            raw = t.view(torch.uint8)
            return [raw, zeros[: -raw.numel() % 8]] if raw.numel() % 8 else [raw]

        ids = slice(d.ids.start, d.ids.stop)
        out = []
        if d.stored:
            tensors = [lengths[d.bags.start : d.bags.stop], values[ids], *([] if weights is None else [weights[ids]])]
            raw = [tensors[i].view(torch.uint8) for i in _stored_order([t.element_size() for t in tensors])]
            size = sum(r.numel() for r in raw)
            out += [*raw, zeros[: -size % 8]]
        else:
            if d.bits is not None:
                out += padded(torch.frombuffer(bytearray(d.bits), dtype=torch.uint8))
            else:
                out.append(packed[8 * d.word : 8 * (d.word + -(-d.total // 64))])
            if weights is not None:
                out += padded(weights[ids])
        return [p for p in out if p.numel()]

    # -- decode --------------------------------------------------------------------------------

    def decode(self, payload: torch.Tensor, what: str = "ids payload", keys: int | None = None) -> IdsPart:
        """Rebuild one destination's lengths, values (and weights), in the sender's dtypes."""
        return self.decode_all([payload], what, keys)[0]

    def decode_all(
        self, payloads: Sequence[torch.Tensor], what: str | Sequence[str] = "ids payload", keys: int | None = None
    ) -> list[IdsPart]:
        """:meth:`decode` of every payload of a collective at once (``what``: each one's name in
        errors; ``keys``: the most keys one holds, if known, so that their plans come back with
        the first read). Two host synchronisations for all of them: every head, plan and check's
        verdict; then whether what they decode to is consistent."""
        names = [what] * len(payloads) if isinstance(what, str) else list(what)
        if len(names) != len(payloads):
            raise ValueError(f"{len(names)} names for {len(payloads)} payloads")
        if not payloads:
            return []
        for p, name in zip(payloads, names, strict=True):
            if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1:
                raise PayloadError(f"{name}: payload must be a 1-D torch.uint8 tensor")
            if p.numel() < STORED_BYTES:
                raise PayloadError(
                    f"{name}: payload of {p.numel()} bytes is shorter than the {STORED_BYTES}-byte prefix "
                    "(truncated or not a dlrm-compress payload)"
                )
        dev = payloads[0].device
        if any(p.device != dev for p in payloads):
            raise ValueError("payloads on several devices")
        b = backend_for(dev, self.backend)
        buf, starts = _joined(payloads)
        sizes = [p.numel() for p in payloads]
        read = _HEAD_READ if keys is None else fmt.head_bytes(0, 4) + _pad8(4 * _FIELDS * keys) + 8 * keys
        heads = _read_heads(buf, starts, sizes, read, b)
        parsed: list[_Stored | _Coded] = []
        for p, (data, good), name in zip(payloads, heads, names, strict=True):
            try:
                if data[:4] == fmt.MAGIC and data[4] not in (fmt.VERSION, STORED_VERSION):
                    raise PayloadError(
                        f"payload format version {data[4]}: the ids codec reads versions {fmt.VERSION} "
                        f"(coded) and {STORED_VERSION} (stored); the sender runs another release"
                    )
                if data[:4] == fmt.MAGIC and data[4] == STORED_VERSION:
                    parsed.append(_parse_stored(p, data, good))
                else:
                    parsed.append(_parse_coded(p, data, good, b))
            except PayloadError as e:
                raise PayloadError(str(e) if name in str(e) else f"{name}: {e}") from None
        coded = [(i, c) for i, c in enumerate(parsed) if isinstance(c, _Coded)]
        decoded = _decode_coded(buf, [starts[i] for i, _ in coded], [c for _, c in coded], [names[i] for i, _ in coded])
        out: list[IdsPart | None] = [None] * len(payloads)
        for (i, _), part in zip(coded, decoded, strict=True):
            out[i] = part
        for i, c in enumerate(parsed):
            if isinstance(c, _Stored):
                out[i] = c.part
        return [p for p in out if p is not None]


# -- encode's layout ------------------------------------------------------------------------------


def _destinations(rows: list[list[int]], keys_per_dest: list[int]) -> list[_Dest]:
    """Each destination's keys, bags, ids and bits, its stream word-aligned in the packed words."""
    dests, key0, bag0, id0, word = [], 0, 0, 0, 0
    for nk in keys_per_dest:
        mine = rows[key0 : key0 + nk]
        nb, ni = sum(r[_BAGS] for r in mine), sum(r[_IDS] for r in mine)
        total = sum(_stream_bits(mine))
        dests.append(_Dest(range(key0, key0 + nk), range(bag0, bag0 + nb), range(id0, id0 + ni), mine, total, word))
        key0, bag0, id0, word = key0 + nk, bag0 + nb, id0 + ni, word - (-total // 64)
    return dests


def _pack_table(rows: list[list[int]], dests: list[_Dest]) -> bytes:
    """Per key, where its fields go (int64 [keys, 8]: lowest length, bags' first bit and width,
    distinct ids' first bit and width, ids' first bit and width, its first distinct id's count),
    then each key's distinct ids (int64 [keys]). A field's first bit is its key's, less the
    width times the ordinal its first element has in the device's arrays (the bag, the count of
    distinct ids so far, the id), so that first bit + ordinal x width places every element."""
    table: list[int] = []
    bag0 = id0 = seen = 0
    for d in dests:
        at = 64 * d.word
        len_bits, gap_bits, _ = _stream_bits(d.rows)
        lens_at, gaps_at, idx_at = at, at + len_bits, at + len_bits + gap_bits
        for r in d.rows:
            lb, gb, ib = r[_LEN_BITS], r[_GAP_BITS], r[_IDX_BITS]
            table += [r[_LEN_BASE], lens_at - bag0 * lb, lb, gaps_at - (seen + 1) * gb, gb, idx_at - id0 * ib, ib]
            table.append(seen + 1)
            lens_at, gaps_at, idx_at = lens_at + r[_BAGS] * lb, gaps_at + r[_DISTINCT] * gb, idx_at + r[_IDS] * ib
            bag0, id0, seen = bag0 + r[_BAGS], id0 + r[_IDS], seen + r[_DISTINCT]
    return _i64(table) + _i64([r[_DISTINCT] for r in rows])


def _seal(out: torch.Tensor, starts: list[int], sizes: list[int], b: Backend) -> None:
    """Every payload's check written in place: Adler-32 on the device, all in one op; crc32 on the host."""
    if not starts:
        return
    if b.check == "adler32":
        ops.adler32_segments_seal_(out, starts, sizes, _CHECK_AT, 4, _CHECK_AT)
        return
    host = out.cpu().numpy() if out.device.type != "cpu" else out.numpy()
    checks = [_crc32(host[a : a + n]) for a, n in zip(starts, sizes, strict=True)]
    if out.device.type == "cpu":
        for a, c in zip(starts, checks, strict=True):
            host[a + _CHECK_AT : a + _CHECK_AT + 4] = list(struct.pack("<I", c))
    else:
        for a, c in zip(starts, checks, strict=True):
            out[a + _CHECK_AT : a + _CHECK_AT + 4] = torch.frombuffer(
                bytearray(struct.pack("<I", c)), dtype=torch.uint8
            )


def _crc32(payload: Any) -> int:
    """zlib's crc32 of a payload's bytes but its check field (a uint8 numpy array)."""
    return zlib.crc32(payload[_CHECK_AT + 4 :], zlib.crc32(payload[:_CHECK_AT]))


# -- decode ---------------------------------------------------------------------------------------


def _joined(payloads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One buffer holding every payload, and where each starts: a view where they already lie in
    one tensor's memory (a received buffer split per source), else their concatenation."""
    if len(payloads) == 1:
        return payloads[0], [0]
    storage = payloads[0].untyped_storage().data_ptr()
    if all(p.is_contiguous() and p.untyped_storage().data_ptr() == storage for p in payloads):
        at = [int(p.storage_offset()) for p in payloads]
        lo, hi = min(at), max(a + p.numel() for a, p in zip(at, payloads, strict=True))
        return payloads[0].as_strided((hi - lo,), (1,), lo), [a - lo for a in at]
    sizes = [p.numel() for p in payloads]
    return torch.cat(list(payloads)), [sum(sizes[:i]) for i in range(len(sizes))]


def _read_heads(
    buf: torch.Tensor, starts: list[int], sizes: list[int], read: int, b: Backend
) -> list[tuple[bytes, bool | None]]:
    """Each payload's first ``read`` bytes and, where the device checks, its Adler-32 verdict
    (None: the host checks later), in one host synchronisation for all."""
    n = [min(s, read) for s in sizes]
    pieces = [buf[a : a + k] for a, k in zip(starts, n, strict=True)]
    verdicts = None
    if b.check == "adler32":
        verdicts = ops.adler32_segments_holds(buf, starts, sizes, _CHECK_AT, 4, _CHECK_AT)
        pieces.append(verdicts.view(torch.uint8))
    if buf.device.type == "cpu" and verdicts is None:
        host = buf.numpy()
        return [(host[a : a + k].tobytes(), None) for a, k in zip(starts, n, strict=True)]
    data = torch.cat(pieces).cpu().numpy().tobytes()
    out, at = [], 0
    good = struct.unpack_from(f"<{len(n)}q", data, sum(n)) if verdicts is not None else [None] * len(n)
    for k, g in zip(n, good, strict=True):
        out.append((data[at : at + k], None if g is None else g == 1))
        at += k
    return out


def _verdict(payload: torch.Tensor, flags: int, good: bool | None) -> bool:
    """Whether a payload's check holds: the device's verdict, else computed here."""
    if flags & fmt.ADLER32:
        if good is not None:
            return good
        return bool(ops.adler32_holds(payload, None, payload.numel(), _CHECK_AT, 4, _CHECK_AT))
    raw = payload.cpu().numpy() if payload.device.type != "cpu" else payload.numpy()
    return _crc32(raw) == int.from_bytes(raw[_CHECK_AT : _CHECK_AT + 4].tobytes(), "little")


@dataclass
class _Stored:
    part: IdsPart


def _parse_stored(payload: torch.Tensor, data: bytes, good: bool | None) -> _Stored:
    """A stored payload's tensors, as views of its bytes: its size from its header first, then
    its check, then what the check covers."""
    _, _, codec, dtype_code, flags, nk, ni, one, _ = _STORED.unpack_from(data)
    size = payload.numel()
    vary = bool(flags & _BAGS_VARY)
    at = STORED_BYTES + (_pad8(4 * nk) if vary else 0)
    if at > size:
        raise PayloadError(f"stored payload of {size} bytes cannot hold the bag counts of {nk} keys (truncated)")
    if vary:
        table = data if at <= len(data) else payload[:at].cpu().numpy().tobytes()
        nb = sum(struct.unpack_from(f"<{nk}I", table, STORED_BYTES))
    else:
        nb = one * nk
    litem, vitem = 8 if flags & _LENGTHS64 else 4, 4 if flags & _VALUES32 else 8
    wdt = fmt._DTYPE_OF.get(dtype_code, torch.float32)
    witem = wdt.itemsize if flags & _WEIGHTS else 0
    sizes = (nb * litem, ni * vitem, ni * witem)
    want = at + _pad8(sum(sizes))
    if want != size:
        raise PayloadError(
            f"stored payload is {size} bytes but its header says {want} "
            f"({'truncated' if size < want else 'trailing bytes'})"
        )
    if not _verdict(payload, flags, good):
        raise PayloadError(
            f"checksum mismatch ({'adler32' if flags & fmt.ADLER32 else 'crc32'}): the payload is corrupted"
        )
    # The check covers everything below, so what follows only guards against encoder bugs.
    if codec != CODEC_ID:
        raise PayloadError(f"codec id {codec}, the ids codec is {CODEC_ID}")
    if dtype_code not in fmt._DTYPE_OF:
        raise PayloadError(f"unknown dtype code {dtype_code} in header")
    bags = list(struct.unpack_from(f"<{nk}I", table, STORED_BYTES)) if vary else [one] * nk
    dtypes = (torch.int64 if litem == 8 else torch.int32, torch.int32 if vitem == 4 else torch.int64, wdt)
    parts: list[torch.Tensor | None] = [None, None, None]
    for i in _stored_order((litem, vitem, witem or 1)):  # (no weights: an empty last one)
        n = sizes[i]
        parts[i] = view_as(payload[at : at + n], dtypes[i], ("stored lengths", "stored ids", "stored weights")[i])
        at += n
    assert parts[0] is not None and parts[1] is not None
    weights = parts[2] if flags & _WEIGHTS else None
    return _Stored(IdsPart(lengths=parts[0], values=parts[1], bags_per_key=bags, weights=weights, plan=None))


@dataclass
class _Coded:
    """A coded payload as its header and plan say, before its stream is unpacked."""

    header: fmt.Header
    sections: list[torch.Tensor]
    flags: int
    total: int
    rows: list[list[int]]
    base: list[int]
    bits: torch.Tensor | None = None  # its packed bits where zstd coded them (decoded here)


def _parse_coded(payload: torch.Tensor, data: bytes, good: bool | None, b: Backend) -> _Coded:
    """A coded payload's header (checked) and plan, read from the host's bytes where they came
    with the head (else read here)."""
    if good is None and len(data) >= 8 and data[7] & fmt.ADLER32:
        good = _verdict(payload, data[7], None)
    if good is None:
        header, sections = fmt.unpack(payload, backend=b)  # crc32: on the host
    else:
        header, sections = fmt.unpack(payload, read=fmt.HostHead(data, good, []), backend=b)
    if header.codec_id != CODEC_ID:
        raise PayloadError(f"codec id {header.codec_id}, the ids codec is {CODEC_ID}")
    nk, flags, lo_bits, hi_bits = header.info
    total = lo_bits | (hi_bits << 32)
    want = 4 if flags & _WEIGHTS else 3
    if len(sections) != want:
        raise PayloadError(f"{len(sections)} sections, flags say {want}")
    if sections[0].numel() != 4 * _FIELDS * nk or sections[1].numel() != 8 * nk:
        raise PayloadError(f"plan of {sections[0].numel()} bytes and {sections[1].numel()} of first ids for {nk} keys")
    head = fmt.HostHead(data, True, [])
    plan_bytes = head.section(header, 0, 4 * _FIELDS * nk)
    base_bytes = head.section(header, 1, 8 * nk)
    if plan_bytes is None or base_bytes is None:  # beyond the first read (many keys): read them now
        plan_bytes = sections[0].cpu().numpy().tobytes()
        base_bytes = sections[1].cpu().numpy().tobytes()
    plan = struct.unpack(f"<{_FIELDS * nk}i", plan_bytes)
    rows = [list(plan[_FIELDS * j : _FIELDS * (j + 1)]) for j in range(nk)]
    base = list(struct.unpack(f"<{nk}q", base_bytes))
    if any(min(r) < 0 for r in rows) or any(r[f] > 64 for r in rows for f in (_LEN_BITS, _GAP_BITS, _IDX_BITS)):
        raise PayloadError("negative count or a width over 64 bits in the plan")
    if sum(r[_BAGS] for r in rows) != header.rows:
        raise PayloadError(f"plan holds {sum(r[_BAGS] for r in rows)} bags, header says {header.rows}")
    if any((r[_DISTINCT] > r[_IDS]) or (r[_IDS] > 0) != (r[_DISTINCT] > 0) for r in rows):
        raise PayloadError("a key's distinct ids exceed (or miss) its ids")
    need = sum(_stream_bits(rows))
    if need != total:
        raise PayloadError(f"plan needs {need} bits, header says {total}")
    bits = None
    if flags & _ZSTD:
        bits = _unzstd(sections[2], -(-total // 8))
    n = sections[2].numel() if bits is None else bits.numel()
    if n != -(-total // 8):
        raise PayloadError(f"{n} bytes of packed bits, plan needs {-(-total // 8)}")
    ni = sum(r[_IDS] for r in rows)
    if flags & _WEIGHTS and sections[3].numel() != ni * header.dtype.itemsize:
        raise PayloadError(f"{sections[3].numel()} bytes of weights for {ni} ids")
    return _Coded(header, sections, flags, total, rows, base, bits)


def _decode_coded(buf: torch.Tensor, starts: list[int], coded: list[_Coded], names: list[str]) -> list[IdsPart]:
    """Every coded payload's stream unpacked and rebuilt at once: one table of every key's
    fields (lengths, gaps, indices: where each starts, its width, what it adds), one unpack."""
    if not coded:
        return []
    dev = buf.device
    words, bit0 = _words(buf, starts, coded)
    rows = [r for c in coded for r in c.rows]
    k = len(rows)
    nl, nd, ni = (sum(r[f] for r in rows) for f in (_BAGS, _DISTINCT, _IDS))
    table: list[list[list[int]]] = [[], [], []]  # per section: per key [first bit, width, addend, other]
    bag0 = dist0 = id0 = 0
    for c, at in zip(coded, bit0, strict=True):
        len_bits, gap_bits, _ = _stream_bits(c.rows)
        lens_at, gaps_at, idx_at = at, at + len_bits, at + len_bits + gap_bits
        for r, first in zip(c.rows, c.base, strict=True):
            lb, gb, ib = r[_LEN_BITS], r[_GAP_BITS], r[_IDX_BITS]
            table[0].append([lens_at - bag0 * lb, lb, r[_LEN_BASE], 0])
            table[1].append([gaps_at - (nl + dist0) * gb, gb, first, dist0])
            table[2].append([idx_at - (nl + nd + id0) * ib, ib, dist0, r[_DISTINCT]])
            lens_at, gaps_at, idx_at = lens_at + r[_BAGS] * lb, gaps_at + r[_DISTINCT] * gb, idx_at + r[_IDS] * ib
            bag0, dist0, id0 = bag0 + r[_BAGS], dist0 + r[_DISTINCT], id0 + r[_IDS]
    counts = [r[_BAGS] for r in rows] + [r[_DISTINCT] for r in rows] + [r[_IDS] for r in rows]
    flat = [v for section in table for row in section for v in row]
    blob = _i64([*flat, *counts, *(r[_IDS] for r in rows), 0])  # (never empty)
    up = upload(torch.frombuffer(bytearray(blob), dtype=torch.int64), dev)
    t, counts_t, ids_t = up[: 12 * k].view(3 * k, 4), up[12 * k : 15 * k], up[15 * k : 16 * k]
    n = nl + nd + ni
    seg = torch.repeat_interleave(counts_t, output_size=n)
    field = t.index_select(0, seg)
    first_bit = torch.addcmul(field[:, 0], torch.arange(n, device=dev), field[:, 1])
    stream = ops.bits_unpack(words, first_bit, field[:, 1])
    lens = stream[:nl] + field[:nl, 2]
    gaps, idx = slice(nl, nl + nd), slice(nl + nd, n)
    steps = (stream[gaps] + 1).cumsum(0)  # wraps mod 2**64, as the gaps did
    uniq = steps - steps[field[gaps, 3]] + field[gaps, 2]  # each key's from its first distinct id
    sums = torch.zeros(k, dtype=torch.int64, device=dev).index_add_(0, seg[:nl], lens)
    bad = torch.cat([sums != ids_t, (stream[idx] >= field[idx, 3]).any().view(1)]).tolist()
    if any(bad):  # one check for the collective: only an encoder bug passes the checksum and fails it
        ends = [sum(len(c.rows) for c in coded[: i + 1]) for i in range(len(coded))]
        culprits = [name for name, e, c in zip(names, ends, coded, strict=True) if any(bad[e - len(c.rows) : e])]
        raise PayloadError(
            f"{', '.join(culprits or names)}: lengths do not sum to the ids, or an index past its key's distinct ids"
        )
    values = uniq[stream[idx] + field[idx, 2]]
    lens_out = _as_dtypes(lens, coded, lambda c: c.flags & _LENGTHS64, _BAGS)
    vals_out = _as_dtypes(values, coded, lambda c: not c.flags & _VALUES32, _IDS)
    out, key0, bag0, id0 = [], 0, 0, 0
    for c, lens_c, vals_c in zip(coded, lens_out, vals_out, strict=True):
        nk, ni_c = len(c.rows), sum(r[_IDS] for r in c.rows)
        weights = view_as(c.sections[3], c.header.dtype, "weights") if c.flags & _WEIGHTS else None
        distinct = t[2 * k + key0 : 2 * k + key0 + nk, 3]
        out.append(
            IdsPart(
                lengths=lens_c,
                values=vals_c,
                bags_per_key=[r[_BAGS] for r in c.rows],
                weights=weights,
                plan=_key_plans(c.rows, distinct, stream[nl + nd + id0 : nl + nd + id0 + ni_c]),
            )
        )
        key0, id0 = key0 + nk, id0 + ni_c
    return out


def _as_dtypes(x: torch.Tensor, coded: list[_Coded], wide: Any, field: int) -> list[torch.Tensor]:
    """``x`` (int64, payload after payload) split per payload, each in its sender's dtype (int64
    where ``wide(payload)``): one cast where they agree."""
    dtypes = [torch.int64 if wide(c) else torch.int32 for c in coded]
    sizes = [sum(r[field] for r in c.rows) for c in coded]
    if len(set(dtypes)) == 1:
        return list(torch.split(x.to(dtypes[0]), sizes))
    return [part.to(dt) for part, dt in zip(torch.split(x, sizes), dtypes, strict=True)]


def _words(buf: torch.Tensor, starts: list[int], coded: list[_Coded]) -> tuple[torch.Tensor, list[int]]:
    """The coded payloads' packed bits as int64 words, and the bit each payload's stream starts
    at: the buffer itself where every stream starts at a word of it, else their concatenation."""
    at = [a + c.header.offsets[2] for a, c in zip(starts, coded, strict=True)]
    if (
        all(c.bits is None for c in coded)
        and buf.data_ptr() % 8 == 0
        and buf.numel() % 8 == 0
        and all(a % 8 == 0 for a in at)
    ):
        return buf.view(torch.int64), [8 * a for a in at]
    pieces, bit0, n = [], [], 0
    for c in coded:
        bits = c.bits if c.bits is not None else c.sections[2]
        size = _pad8(bits.numel())
        if c.bits is None:  # (the section's padding follows it in the payload)
            bits = c.sections[2].as_strided((size,), (1,), c.sections[2].storage_offset())
        elif size != bits.numel():
            bits = torch.cat([bits, bits.new_zeros(size - bits.numel())])
        pieces.append(bits)
        bit0.append(8 * n)
        n += size
    return torch.cat(pieces).view(torch.int64) if pieces else buf.new_zeros(0, dtype=torch.int64), bit0


def _unzstd(section: torch.Tensor, n: int) -> torch.Tensor:
    try:
        raw = zstandard.ZstdDecompressor().decompress(section.cpu().numpy(), max_output_size=n)  # type: ignore[arg-type]
    except zstandard.ZstdError as e:
        raise PayloadError(f"zstd frame does not decode ({e})") from None
    return upload(torch.frombuffer(bytearray(raw), dtype=torch.uint8), section.device)


def _check_inputs(lengths: torch.Tensor, values: torch.Tensor, bags: list[int], weights: torch.Tensor | None) -> None:
    if lengths.dtype not in _INT_DTYPES or values.dtype not in _INT_DTYPES:
        raise ValueError(f"lengths and values must be int32 or int64, got {lengths.dtype} and {values.dtype}")
    if lengths.dim() != 1 or values.dim() != 1:
        raise ValueError("lengths and values must be 1-D")
    if sum(bags) != lengths.numel() or min(bags, default=0) < 0:
        raise ValueError(f"bags_per_key {bags} sums to {sum(bags)}, lengths has {lengths.numel()} bags")
    if weights is not None and weights.shape != values.shape:
        raise ValueError(f"weights of shape {tuple(weights.shape)} for {values.numel()} ids")
