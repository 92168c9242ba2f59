"""Lossless codec of a jagged batch of ids (the input all-to-all's lengths and values), per key.

Why: an id is 8 bytes and a length 4, but a key's ids in one batch hold few distinct values and
Criteo bags all have one id. Per key the payload carries

* lengths as a frame of reference: the smallest length, then each length minus it at the bits
  of the spread (a constant length costs no bits: the "one flag" case);
* ids as the sorted distinct ids (the first raw, then gaps minus one at the bits of the largest
  gap; gaps wrap modulo 2**64, so the ends of int64 round-trip) plus, per lookup, its index
  among them at ceil(log2(distinct)) bits;
* per-sample weights as they are.

Every value is bit-packed by torch ops on the tensors' device; a key never costs a host
synchronisation. :meth:`IdsCodec.encode` takes one for the whole call (the sizes of what it
packs), :meth:`IdsCodec.decode` one for the plan and one for its consistency check. On a CPU
tensor an optional zstd stage codes the packed bits when that is smaller. The payload is the
checksummed container of :mod:`compression.format`: a corrupted or truncated one raises
:class:`~compression.format.PayloadError`, never yields wrong ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zstandard

from . import format as fmt
from .backend import backend_for
from .format import PayloadError, view_as

CODEC_ID = 10
_FIELDS = 7  # per key: bags, ids, distinct, length base, length bits, gap bits, index bits
_BAGS, _IDS, _DISTINCT, _LEN_BASE, _LEN_BITS, _GAP_BITS, _IDX_BITS = range(_FIELDS)
_ZSTD, _WEIGHTS, _VALUES32, _LENGTHS64 = 1, 2, 4, 8  # flags in info[1]
_INT_DTYPES = (torch.int32, torch.int64)


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
    plan: KeyPlans | None = None  # its keys' distinct ids as the decoder rebuilt them


def _key_plans(host: list[list[int]], distinct: torch.Tensor, index: torch.Tensor) -> KeyPlans:
    """:class:`KeyPlans` from a payload plan read on the host (its rows) and the device values."""
    single = [r[_BAGS] > 0 and r[_LEN_BASE] == 1 and r[_LEN_BITS] == 0 for r in host]
    return KeyPlans([r[_IDS] for r in host], single, distinct, index)


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bits needed for each int64 read as unsigned 64-bit (0 for 0, 64 for a negative)."""
    powers = torch.ones(63, dtype=torch.int64, device=x.device).cumsum(0).sub_(1)  # 0..62
    below = (x.unsqueeze(-1) >= torch.ones_like(powers).bitwise_left_shift(powers)).sum(-1)
    return torch.where(x < 0, torch.full_like(below, 64), below)


def _low_mask(bits: torch.Tensor) -> torch.Tensor:
    """int64 with the low ``bits`` (0..64) set (64: all ones, as -1)."""
    one = torch.ones_like(bits)
    return torch.where(bits >= 64, -one, one.bitwise_left_shift(bits.clamp(max=63)) - 1)


def _shift_right(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 ``x`` by ``s`` in 0..63."""
    return x.bitwise_right_shift(s).bitwise_and_(_low_mask(64 - s))


def pack_bits(values: torch.Tensor, widths: torch.Tensor, total_bits: int) -> torch.Tensor:
    """Concatenate the low ``widths[i]`` bits of each int64 ``values[i]`` (LSB first) into bytes:
    each value lands in one or two 64-bit words (bits never overlap, so sums are ORs)."""
    nbytes = -(-total_bits // 8)
    words = torch.zeros(total_bits // 64 + 2, dtype=torch.int64, device=values.device)
    if total_bits:
        start = widths.cumsum(0) - widths
        w, s = start.bitwise_right_shift(6), start.bitwise_and(63)
        v = values.bitwise_and(_low_mask(widths))
        spill = torch.where(s > 0, _shift_right(v, (64 - s).clamp(max=63)), torch.zeros_like(v))
        words.index_add_(0, w, v.bitwise_left_shift(s)).index_add_(0, w + 1, spill)
    return words.view(torch.uint8)[:nbytes]


def unpack_bits(data: torch.Tensor, widths: torch.Tensor, total_bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``widths.numel()`` int64 values (bit patterns, wrapping)."""
    if total_bits == 0:
        return torch.zeros(widths.numel(), dtype=torch.int64, device=data.device)
    padded = torch.zeros((total_bits // 64 + 2) * 8, dtype=torch.uint8, device=data.device)
    padded[: data.numel()] = data
    words = padded.view(torch.int64)
    start = widths.cumsum(0) - widths
    w, s = start.bitwise_right_shift(6), start.bitwise_and(63)
    high = torch.where(s > 0, words[w + 1].bitwise_left_shift((64 - s).clamp(max=63)), torch.zeros_like(s))
    return (_shift_right(words[w], s) | high).bitwise_and_(_low_mask(widths))


def _segments(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Segment index of each of ``total`` items, segment s holding ``counts[s]`` (no sync)."""
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)


def _starts(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0) - counts


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
        """:meth:`encode`'s payloads, and every key's distinct ids as it computed them."""
        _check_inputs(lengths, values, bags_per_key, weights)
        dev = values.device
        keys_per_dest = [len(bags_per_key)] if keys_per_dest is None else list(keys_per_dest)
        if sum(keys_per_dest) != len(bags_per_key):
            raise ValueError(
                f"keys_per_dest {keys_per_dest} sums to {sum(keys_per_dest)}, not {len(bags_per_key)} keys"
            )
        k = len(bags_per_key)
        bags = torch.tensor(bags_per_key, dtype=torch.int64, device=dev)
        n_bags, n_ids = lengths.numel(), values.numel()
        lens = lengths.to(torch.int64)
        bag_key = _segments(bags, n_bags)
        ids_per_key = torch.zeros(k, dtype=torch.int64, device=dev).index_add_(0, bag_key, lens)
        big = torch.iinfo(torch.int64).max
        lo = torch.full((k,), big, dtype=torch.int64, device=dev).scatter_reduce_(0, bag_key, lens, "amin")
        hi = torch.zeros(k, dtype=torch.int64, device=dev).scatter_reduce_(0, bag_key, lens, "amax")
        lo = torch.where(bags > 0, lo, torch.zeros_like(lo))
        id_key = _segments(ids_per_key, n_ids)  # a wrong length sum shows as a size error here
        # sort by (key, id): stable sort by id, then by key
        vals = values.to(torch.int64)
        by_id = torch.sort(vals, stable=True).indices
        order = by_id[torch.sort(id_key[by_id], stable=True).indices]
        sv, sk = vals[order], id_key[order]
        new = torch.ones(n_ids, dtype=torch.bool, device=dev)
        new[1:] = (sv[1:] != sv[:-1]) | (sk[1:] != sk[:-1])
        rank = new.to(torch.int64).cumsum(0) - 1  # global distinct index of each sorted id
        distinct = torch.zeros(k, dtype=torch.int64, device=dev).index_add_(0, sk, new.to(torch.int64))
        first = _starts(distinct)
        inverse = torch.empty(n_ids, dtype=torch.int64, device=dev)
        inverse[order] = rank - first[sk]
        uniq = torch.zeros(n_ids, dtype=torch.int64, device=dev).scatter_(0, rank, sv)  # first D_total used
        uniq_key = torch.zeros(n_ids, dtype=torch.int64, device=dev).scatter_(0, rank, sk)
        gaps = uniq - torch.cat([uniq[:1], uniq[:-1]]) - 1  # wraps mod 2**64: a gap of 2**64-1 fits
        keep = (torch.arange(n_ids, device=dev) < distinct.sum()) & ~_firsts(first, distinct, n_ids)
        gaps = torch.where(keep, gaps, torch.zeros_like(gaps))
        gap_max = torch.zeros(k, dtype=torch.int64, device=dev)
        if n_ids:  # unsigned max: a gap with its top bit set (negative as int64) needs all 64 bits
            neg = gaps < 0
            gap_max = gap_max.scatter_reduce_(0, uniq_key, torch.where(neg, 0, gaps), "amax")
            any_neg = torch.zeros(k, dtype=torch.int64, device=dev).scatter_reduce_(0, uniq_key, neg.long(), "amax")
            gap_max = torch.where(any_neg > 0, torch.full_like(gap_max, -1), gap_max)  # bit_length(-1) = 64
        base = torch.zeros(k, dtype=torch.int64, device=dev)
        if n_ids:
            base = torch.where(distinct > 0, uniq[first.clamp(max=n_ids - 1)], base)
        plan = torch.stack(
            [
                bags,
                ids_per_key,
                distinct,
                lo,
                bit_length(hi - lo),
                bit_length(gap_max),
                bit_length((distinct - 1).clamp(min=0)),
            ],
            1,
        )
        host = plan.tolist()  # the one host synchronisation: every size below comes from it
        out, key0, id0, bag0, uniq0 = [], 0, 0, 0, 0
        for nk in keys_per_dest:
            rows = host[key0 : key0 + nk]
            nb, ni, nd = (sum(r[f] for r in rows) for f in (_BAGS, _IDS, _DISTINCT))
            part_plan = plan[key0 : key0 + nk]
            bits_plan = [(r[_BAGS], r[_LEN_BITS], r[_DISTINCT], r[_GAP_BITS], r[_IDS], r[_IDX_BITS]) for r in rows]
            stream_vals = torch.cat(
                [
                    lens[bag0 : bag0 + nb]
                    - lo[key0 : key0 + nk].repeat_interleave(part_plan[:, _BAGS], output_size=nb),
                    gaps[uniq0 : uniq0 + nd],
                    inverse[id0 : id0 + ni],
                ]
            )
            widths, total = _stream_widths(part_plan, bits_plan, nb, nd, ni)
            out.append(
                self._frame(
                    nk,
                    nb,
                    part_plan.to(torch.int32),
                    base[key0 : key0 + nk],
                    pack_bits(stream_vals, widths, total),
                    total,
                    lengths.dtype,
                    values.dtype,
                    None if weights is None else weights[id0 : id0 + ni],
                )
            )
            key0, id0, bag0, uniq0 = key0 + nk, id0 + ni, bag0 + nb, uniq0 + nd
        return out, _key_plans(host, distinct, inverse)

    def _frame(
        self,
        nk: int,
        nb: int,
        plan32: torch.Tensor,
        base: torch.Tensor,
        bits: torch.Tensor,
        total: int,
        len_dtype: torch.dtype,
        val_dtype: torch.dtype,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        flags = (_VALUES32 if val_dtype == torch.int32 else 0) | (_LENGTHS64 if len_dtype == torch.int64 else 0)
        b = backend_for(bits.device, self.backend)
        if self.entropy and b.on_host and bits.device.type == "cpu" and bits.numel() > 64:
            frame = zstandard.ZstdCompressor(level=self.level).compress(bits.numpy())  # type: ignore[arg-type]
            if len(frame) < bits.numel():
                bits, flags = torch.frombuffer(bytearray(frame), dtype=torch.uint8), flags | _ZSTD
        sections = [plan32, base, bits]
        if weights is not None:
            sections.append(weights.contiguous())
            flags |= _WEIGHTS
        wdt = weights.dtype if weights is not None else torch.float32
        header = fmt.Header(
            codec_id=CODEC_ID,
            dtype=wdt,
            rows=nb,
            cols=0,
            widths=[],
            bounds=[],
            info=[nk, flags, total & 0xFFFFFFFF, total >> 32],
        )
        return fmt.pack(header, sections, device=base.device, backend=b)

    # -- decode --------------------------------------------------------------------------------

    def decode(self, payload: torch.Tensor, what: str = "ids payload") -> IdsPart:
        """Rebuild one destination's lengths, values (and weights), in the sender's dtypes."""
        header, sections = fmt.unpack(payload, backend=backend_for(payload.device, self.backend))
        if header.codec_id != CODEC_ID:
            raise PayloadError(f"{what}: codec id {header.codec_id}, the ids codec is {CODEC_ID}")
        nk, flags, lo_bits, hi_bits = header.info
        total = lo_bits | (hi_bits << 32)
        want = 4 if flags & _WEIGHTS else 3
        if len(sections) != want:
            raise PayloadError(f"{what}: {len(sections)} sections, flags say {want}")
        plan32 = view_as(sections[0], torch.int32, f"{what} plan")
        base = view_as(sections[1], torch.int64, f"{what} first ids")
        if plan32.numel() != nk * _FIELDS or base.numel() != nk:
            raise PayloadError(f"{what}: plan of {plan32.numel()} words and {base.numel()} first ids for {nk} keys")
        plan = plan32.view(nk, _FIELDS).to(torch.int64)
        host = plan.tolist()  # sizes of everything below
        if any(min(r) < 0 for r in host) or any(r[f] > 64 for r in host for f in (_LEN_BITS, _GAP_BITS, _IDX_BITS)):
            raise PayloadError(f"{what}: negative count or a width over 64 bits in the plan")
        nb, ni, nd = (sum(r[f] for r in host) for f in (_BAGS, _IDS, _DISTINCT))
        if nb != header.rows:
            raise PayloadError(f"{what}: plan holds {nb} bags, header says {header.rows}")
        if any((r[_DISTINCT] > r[_IDS]) or (r[_IDS] > 0) != (r[_DISTINCT] > 0) for r in host):
            raise PayloadError(f"{what}: a key's distinct ids exceed (or miss) its ids")
        bits_plan = [(r[_BAGS], r[_LEN_BITS], r[_DISTINCT], r[_GAP_BITS], r[_IDS], r[_IDX_BITS]) for r in host]
        widths, need = _stream_widths(plan, bits_plan, nb, nd, ni)
        if need != total:
            raise PayloadError(f"{what}: plan needs {need} bits, header says {total}")
        data = sections[2]
        if flags & _ZSTD:
            data = _unzstd(data, -(-total // 8), what)
        if data.numel() != -(-total // 8):
            raise PayloadError(f"{what}: {data.numel()} bytes of packed bits, plan needs {-(-total // 8)}")
        stream = unpack_bits(data, widths, total)
        dev = payload.device
        bags, ids, distinct = plan[:, _BAGS], plan[:, _IDS], plan[:, _DISTINCT]
        lens = stream[:nb] + plan[:, _LEN_BASE].repeat_interleave(bags, output_size=nb)
        gaps, idx = stream[nb : nb + nd], stream[nb + nd :]
        uniq_key = _segments(distinct, nd)
        first = _starts(distinct)
        steps = torch.where(_firsts(first, distinct, nd), torch.zeros_like(gaps), gaps + 1)
        uniq = steps.cumsum(0)  # wraps mod 2**64, as the gaps did
        if nd:
            uniq = uniq - uniq[first[uniq_key]] + base[uniq_key]
        id_key = _segments(ids, ni)
        bag_key = _segments(bags, nb)
        sums = torch.zeros(nk, dtype=torch.int64, device=dev).index_add_(0, bag_key, lens)
        bad = (sums != ids).any()
        if ni:
            bad = bad | (idx >= distinct[id_key]).any()
        if bool(bad):  # one check per payload: only an encoder bug passes the checksum and fails it
            raise PayloadError(f"{what}: lengths do not sum to the ids, or an index past its key's distinct ids")
        values = uniq[first[id_key] + idx] if ni else torch.zeros(0, dtype=torch.int64, device=dev)
        weights = None
        if flags & _WEIGHTS:
            weights = view_as(sections[3], header.dtype, f"{what} weights")
            if weights.numel() != ni:
                raise PayloadError(f"{what}: {weights.numel()} weights for {ni} ids")
        return IdsPart(
            lengths=lens.to(torch.int64 if flags & _LENGTHS64 else torch.int32),
            values=values.to(torch.int32 if flags & _VALUES32 else torch.int64),
            bags_per_key=[r[_BAGS] for r in host],
            weights=weights,
            plan=_key_plans(host, distinct, idx),
        )


def _firsts(first: torch.Tensor, distinct: torch.Tensor, n: int) -> torch.Tensor:
    """Mask of the n positions where a key's distinct ids begin (keys without ids mark nothing)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=first.device)
    marks = torch.zeros(n, dtype=torch.int64, device=first.device)
    return marks.scatter_reduce_(0, first.clamp(max=n - 1), (distinct > 0).to(torch.int64), "amax").bool()


def _stream_widths(
    plan: torch.Tensor, bits_plan: Sequence[Sequence[int]], nb: int, nd: int, ni: int
) -> tuple[torch.Tensor, int]:
    """Per-element bit widths of one payload's stream (lengths | gaps | indices) and their sum."""
    total = sum(b * lb + d * gb + i * ib for b, lb, d, gb, i, ib in bits_plan)
    widths = torch.cat(
        [
            plan[:, _LEN_BITS].repeat_interleave(plan[:, _BAGS], output_size=nb),
            plan[:, _GAP_BITS].repeat_interleave(plan[:, _DISTINCT], output_size=nd),
            plan[:, _IDX_BITS].repeat_interleave(plan[:, _IDS], output_size=ni),
        ]
    ).to(torch.int64)
    return widths, total


def _unzstd(section: torch.Tensor, n: int, what: str) -> torch.Tensor:
    try:
        raw = zstandard.ZstdDecompressor().decompress(section.cpu().numpy(), max_output_size=n)  # type: ignore[arg-type]
    except zstandard.ZstdError as e:
        raise PayloadError(f"{what}: zstd frame does not decode ({e})") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(section.device)


def _check_inputs(lengths: torch.Tensor, values: torch.Tensor, bags: list[int], weights: torch.Tensor | None) -> None:
    if lengths.dtype not in _INT_DTYPES or values.dtype not in _INT_DTYPES:
        raise ValueError(f"lengths and values must be int32 or int64, got {lengths.dtype} and {values.dtype}")
    if lengths.dim() != 1 or values.dim() != 1:
        raise ValueError("lengths and values must be 1-D")
    if sum(bags) != lengths.numel() or min(bags, default=0) < 0:
        raise ValueError(f"bags_per_key {bags} sums to {sum(bags)}, lengths has {lengths.numel()} bags")
    if weights is not None and weights.shape != values.shape:
        raise ValueError(f"weights of shape {tuple(weights.shape)} for {values.numel()} ids")
