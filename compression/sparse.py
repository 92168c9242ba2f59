"""Hard thresholding: only the entries with ``|x| >= threshold`` travel, as positions plus values.

The building block of DCT (Gupta et al., KDD'21): its data-parallel form thresholds each dense
gradient bucket (with error feedback kept by the caller), its model-parallel form the pooled
embeddings. ``decode`` rebuilds the dense tensor with zeros where nothing was kept, so a caller
keeps ``x - decode(encode(x))`` as its residual. Not error-bounded: dropped entries can be any
size below the threshold.

Sections: positions | values. Positions are the kept entries' flat indices in row-major order,
either delta-coded through the zstd byte-plane coder or as a bitmap, whichever is smaller
(``info[0]``: 0 = deltas, 1 = bitmap); ``info[1]`` = the number kept. Values are a payload of
another codec of this package (``values``: ``none`` = exact fp32, ``fp16``, ``bf16``, or
``lossy`` under the bound ``eb``, absolute), as a ``[kept, 1]`` column.

On an accelerator the positions are coded with torch ops on the device instead (zstd and numpy
would copy them to the host): the bitmap (the same bytes as numpy's), or the deltas bit-packed at
one width, that of the largest (``info[0]`` = 2, ``info[2]`` = the width), whichever is smaller.
With the count and the width known on the host (:func:`delta_width`, read once with a collective's
sizes), :meth:`ThresholdCodec.encode_known`, :meth:`~ThresholdCodec.payload_size` and
:meth:`~ThresholdCodec.decode_known` make no host synchronisation at all (DCT's all-gather).
Where the host does not know them (DCT-MP's all-to-alls), :meth:`~ThresholdCodec.encode_deferred`
leaves them and the payload's length on the device, for the transport's one read of every length,
and :meth:`~ThresholdCodec.decode` given the payload's head (read with its collective's) reads
nothing more.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from . import coders
from . import format as fmt
from .backend import upload
from .base import (
    NO_CONTEXT,
    Bound,
    Codec,
    CodecContext,
    Unpacked,
    by_width,
    codec_for,
    get_codec,
    register,
)
from .format import PayloadError
from .positions import (  # the device coding of positions (re-exported: callers name them here)
    BITMAP,
    DELTAS,
    PACKED,
    _bits_of,
    _bytes_of,
    _compact,
    _pack_bits_capacity,
    bitmap_bytes,
    delta_width,
    known_positions,
    pack_bits,
    positions_mode,
    unpack_bits,
)

VALUE_CODECS = ("none", "fp16", "bf16", "lossy")
Threshold = float | torch.Tensor  # a 0-d float32 tensor stays on its device (no host wait)


def kth_largest_abs_tensor(x: torch.Tensor, keep: float) -> torch.Tensor:
    """:func:`kth_largest_abs` as a 0-d float32 tensor on ``x``'s device (no host wait)."""
    ranked = 0.0 < keep < 1.0 and x.numel() > 0  # (else nothing is ranked: zero, or keep's error)
    return kth_largest_magnitude(magnitudes(x) if ranked else x.new_empty(0), keep)


def magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` (flat, float32) with NaN as infinity: what :func:`kth_largest_abs_tensor` ranks
    and :meth:`ThresholdCodec.mask_of` compares, made once for both."""
    return x.detach().reshape(-1).abs().float().nan_to_num(nan=math.inf, posinf=math.inf)


def kth_largest_magnitude(mags: torch.Tensor, keep: float) -> torch.Tensor:
    """:func:`kth_largest_abs_tensor` of the tensor whose :func:`magnitudes` are ``mags``."""
    if not keep > 0.0:  # NaN fails too
        raise ValueError(f"keep must be > 0, got {keep}")
    n = mags.numel()
    if keep >= 1.0 or n == 0:
        return torch.zeros((), dtype=torch.float32, device=mags.device)
    k = max(1, math.ceil(keep * n))
    return torch.kthvalue(mags, n - k + 1).values


def kth_largest_abs(x: torch.Tensor, keep: float) -> float:
    """The threshold that keeps the ``ceil(keep * numel)`` largest ``|x|`` (ties keep more).

    ``keep >= 1`` gives 0.0 (everything passes ``|x| >= 0``); NaN counts as the largest value.
    """
    return float(kth_largest_abs_tensor(x, keep))


def _per_block(ts: list[Threshold], widths: Sequence[int]) -> list[Threshold]:
    """One threshold per block of ``widths``: a single one for every block, else one each."""
    ts = ts * len(widths) if len(ts) == 1 else ts
    if len(ts) != len(widths):
        raise ValueError(f"{len(ts)} thresholds for {len(widths)} blocks {list(widths)}")
    return ts


def _checked(threshold: Threshold | Sequence[Threshold]) -> list[Threshold]:
    """Thresholds as floats or 0-d tensors; the floats checked (a tensor's check would wait for it)."""
    given = [threshold] if isinstance(threshold, (int, float, torch.Tensor)) else list(threshold)
    ts = [t if isinstance(t, torch.Tensor) else float(t) for t in given]
    if any(not t >= 0.0 for t in ts if isinstance(t, float)):  # NaN fails too
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    return ts


def refresh_due(iteration: int, every: int, warmup: bool = True) -> bool:
    """DCT's threshold schedule: every ``every`` iterations, and with ``warmup`` also at 1, 2, 4,
    8, ... before that. A threshold taken on the first iterations alone lets many more entries
    through later (error feedback builds residuals; embeddings grow while they train), so the
    published "every few thousand iterations" starts with refreshes that double their spacing."""
    warming = warmup and 0 < iteration < every and iteration & (iteration - 1) == 0
    return iteration % every == 0 or warming


@register
class ThresholdCodec(Codec):
    """Keep the entries with ``|x| >= threshold`` (one threshold, or one per column block).

    Parameters: ``threshold`` (a float or one per block), ``values`` (codec of the kept values:
    ``none`` | ``fp16`` | ``bf16`` | ``lossy``), ``level`` (zstd level of the positions and of
    lossy values). ``eb``: the absolute bound of ``lossy`` values (ignored by the casts).
    Non-finite values are always kept (a NaN gradient must reach the optimizer, not vanish); a
    threshold may be +inf (then only they travel).
    """

    name = "threshold"
    codec_id = 8
    per_block_args = False  # eb bounds the kept values (lossy), one for all; no ids

    def __init__(self, threshold: float | Sequence[float] = 0.0, values: str = "none", level: int = 1):
        if values not in VALUE_CODECS:
            raise ValueError(f"values must be one of {VALUE_CODECS}, got {values!r}")
        self.thresholds = _checked(threshold)
        self.values, self.level = values, level
        self._values = get_codec(values, dedup=False, level=level) if values == "lossy" else get_codec(values)
        self._zstd = coders.ZstdCoder(level)

    def __repr__(self) -> str:
        return f"ThresholdCodec(threshold={self.thresholds}, values={self.values!r})"

    def mask(
        self, x: torch.Tensor, widths: Sequence[int], thresholds: Sequence[Threshold] | None = None
    ) -> torch.Tensor:
        """Which entries of ``x`` [rows, cols] travel (``|x| >= threshold`` of their block, or NaN)."""
        ts = _per_block(self.thresholds if thresholds is None else _checked(thresholds), widths)
        out = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        c = 0
        for t, w in zip(ts, widths, strict=True):
            torch.lt(x[:, c : c + w].abs(), t, out=out[:, c : c + w])  # the entries that stay: NaN does not
            c += w
        return out.logical_not_()  # +-inf pass (a threshold is never NaN: a float's is checked, a tensor's a k-th |x|)

    def mask_of(self, mags: torch.Tensor, widths: Sequence[int], thresholds: Sequence[Threshold]) -> torch.Tensor:
        """:meth:`mask` of a float32 ``x`` (flat) from its :func:`magnitudes`: ``mags >=`` the
        block's threshold (NaN's magnitude is infinite: it passes, as in :meth:`mask`)."""
        ts = _per_block(_checked(thresholds), widths)
        out = torch.empty(mags.shape, dtype=torch.bool, device=mags.device)
        c = 0
        for t, w in zip(ts, widths, strict=True):
            torch.ge(mags[c : c + w], t, out=out[c : c + w])
            c += w
        return out

    def count(self, payload: torch.Tensor) -> int:
        """How many entries a payload carries."""
        header, _ = self._header(payload)
        return int(header.info[1])

    def with_backend(self, choice: str) -> ThresholdCodec:
        super().with_backend(choice)
        self._values.with_backend(choice)
        return self

    def coded_on_host(self, device: torch.device) -> bool:
        """Whether positions on ``device`` take the host coding (zstd deltas, numpy's bitmap):
        the host backend's, smaller and faster on a CPU."""
        return self.backend_for(device).host_positions

    def encode(
        self, x: torch.Tensor, *args: Any, thresholds: Sequence[Threshold] | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """:meth:`Codec.encode`; ``thresholds`` (one per block) replace ``context.thresholds``
        for this call (DCT's keyword)."""
        if thresholds is not None:
            kwargs["context"] = replace(kwargs.get("context", NO_CONTEXT), thresholds=thresholds)
        return super().encode(x, *args, **kwargs)

    def _encode(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Positions and values of the kept entries (``context.thresholds``, one per block, in
        place of the codec's own); ``ids`` are not used (no dedup)."""
        rows, cols = x.shape
        keep = self.mask(x, widths, context.thresholds).reshape(-1)
        bound = self._bound(eb)
        if not self.coded_on_host(x.device):  # the device coding: one host read, the count and the delta width
            count, width = torch.stack([keep.sum(), delta_width(keep)]).tolist()
            return self.encode_known(x, keep, count, width, widths, bound)
        flat = x.reshape(-1)
        idx = keep.nonzero().view(-1)
        kept = flat[idx].float().view(-1, 1)
        positions, mode = self._positions(idx, keep)
        values = self._values.encode(kept, bound)
        header = fmt.Header(
            self.codec_id, x.dtype, rows, cols, widths, [math.inf] * len(widths), info=[mode, int(idx.numel()), 0, 0]
        )
        return fmt.pack(header, [positions, values], device=x.device, backend=self.backend_for(x.device))

    def _bound(self, eb: Bound | None) -> float | None:
        if self.values != "lossy":
            return None
        if eb is None or isinstance(eb, (Sequence, torch.Tensor)):
            raise ValueError("threshold codec with lossy values needs one absolute bound eb (a float)")
        return float(eb)

    def encode_known(
        self,
        x: torch.Tensor,
        keep: torch.Tensor,
        count: int,
        width: int,
        blocks: Sequence[int],
        eb: float | None = None,
        ramp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The device coding of ``x`` [rows, cols] where ``keep`` (its flat :meth:`mask`) is set,
        with the mask's count and :func:`delta_width` known on the host: no host synchronisation
        (for cast values; lossy values are their own codec's). ``ramp``: :func:`pack_bits`'."""
        rows, cols = x.shape
        idx = _compact(keep, count)
        mode = positions_mode(keep.numel(), count, width)
        if mode == PACKED:
            positions = pack_bits(idx - torch.nn.functional.pad(idx[:-1], (1, 0)), width, ramp)  # the deltas
        else:
            positions = bitmap_bytes(idx, keep.numel())
        values = self._values.encode(x.reshape(-1).index_select(0, idx).float().view(-1, 1), eb)
        info = [mode, count, width if mode == PACKED else 0, 0]
        header = fmt.Header(self.codec_id, x.dtype, rows, cols, list(blocks), [math.inf] * len(blocks), info=info)
        return fmt.pack(header, [positions, values], device=x.device, backend=self.backend_for(x.device))

    def _encode_deferred(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor | fmt.Deferred | None:
        """Where the positions are coded on the device (cast values, Adler-32 check), with the
        count, the delta width and the payload's length left on the device: :meth:`encode_known`'s
        bytes, made without a host wait. Elsewhere (the host coding, lossy values) None:
        :meth:`encode`'s payload."""
        b = self.backend_for(x.device)
        if b.host_positions or self.values == "lossy" or b.reads_sizes or not x.numel():
            return None
        rows, cols = x.shape
        keep = self.mask(x, widths, context.thresholds).reshape(-1)
        n, bitmap = keep.numel(), (keep.numel() + 7) // 8
        count, width = keep.sum(), delta_width(keep)
        idx = _compact(keep, n)  # the first ``count`` are the kept entries, the rest capacity
        packed = (count * width + 7) // 8
        is_packed = packed < bitmap  # positions_mode's choice; then the stream fits in the bitmap's bytes
        deltas = torch.diff(idx, prepend=idx.new_zeros(1))
        positions = torch.where(is_packed, _pack_bits_capacity(deltas, count, width, 8 * bitmap), _bytes_of(keep, True))
        wire = x.reshape(-1).index_select(0, idx).float()
        if self.values != "none":
            wire = wire.to(_WIRE_DTYPE[self.values])
        values_header = fmt.Header(self._values.codec_id, torch.float32, 0, 1, [1], [math.inf])
        values = fmt.pack_deferred(values_header, [[(wire, count * wire.itemsize)]], x.device, device_rows=count)
        header = fmt.Header(self.codec_id, x.dtype, rows, cols, widths, [math.inf] * len(widths))
        info = {0: torch.where(is_packed, PACKED, BITMAP), 1: count, 2: torch.where(is_packed, width, 0)}
        sections: list[list[tuple[torch.Tensor, fmt.Length]]] = [
            [(positions, torch.where(is_packed, packed, bitmap))],
            [(values.buffer, values.length)],
        ]
        return fmt.pack_deferred(header, sections, x.device, info)

    def chooses_ids_on_device(self, device: torch.device) -> bool:
        return True  # (it takes no ids)

    def head_size(self, n_blocks: int) -> int:
        """Bytes a decoder needs on the host: the header (the count and the positions' coding)."""
        return fmt.head_bytes(n_blocks, 2)

    def prepare_decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None, context: CodecContext = NO_CONTEXT
    ) -> tuple[torch.Tensor | None, object] | None:
        """Its head alone says where the values go (cast values on the device backend); lossy
        values and the host backend read for themselves (None)."""
        return None if self.values == "lossy" or self.backend_for(payload.device).reads_sizes else (None, None)

    def payload_size(self, n: int, blocks: Sequence[int], count: int, width: int) -> int:
        """Bytes of :meth:`encode_known`'s payload of ``n`` entries in ``blocks`` (cast values)."""
        if self.values == "lossy":
            raise ValueError("threshold codec: lossy values have a data-dependent size")
        p = (count * width + 7) // 8 if positions_mode(n, count, width) == PACKED else (n + 7) // 8
        v = _payload_len(self.values, 1, 1) + count * _WIRE_ITEM[self.values]
        return _payload_len("threshold", len(blocks), 2) + p + (-p % 8) + v + (-v % 8)

    def decode_known(
        self,
        payload: torch.Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype,
        blocks: Sequence[int],
        count: int,
        width: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode` of an :meth:`encode_known` payload whose shape, count and width the
        host knows, without a host synchronisation: the dense tensor, and whether the payload's
        check holds as a 0-d int64 tensor (1: it holds) (to be read later; until then a damaged payload decodes
        into wrong values, its positions kept in range). A wrong length raises at once."""
        rows, cols = shape
        idx, values, ok = self.known_entries(payload, rows * cols, blocks, count, width)
        dense = torch.zeros(rows, cols, dtype=dtype, device=payload.device)
        dense.view(-1).index_copy_(0, idx, values.to(dtype))  # as decode: the cast codec's fp32, then dtype
        return dense, ok

    def known_entries(
        self,
        payload: torch.Tensor,
        n: int,
        blocks: Sequence[int],
        count: int,
        width: int,
        ramp: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`decode_known` of a payload of ``n`` entries, as the flat positions and the (fp32)
        values it carries and its check, for a caller that places them itself (``ramp``:
        :func:`unpack_bits`')."""
        size = self.payload_size(n, blocks, count, width)
        if payload.numel() != size:
            raise PayloadError(
                f"threshold payload of {payload.numel()} bytes, expected {size} for {count} of {n} entries "
                f"({'truncated' if payload.numel() < size else 'trailing bytes'})"
            )
        at = _payload_len("threshold", len(blocks), 2)
        mode = positions_mode(n, count, width)
        p = (count * width + 7) // 8 if mode == PACKED else (n + 7) // 8
        idx = known_positions(payload[at : at + p + (-p % 8)], n, count, mode, width, ramp)  # (padded: whole words)
        values = self._known_values(payload[at + p + (-p % 8) :], count)
        return idx, values, fmt.verdict(payload, self.backend_for(payload.device))

    def _known_values(self, section: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` cast values (fp32) of a values section, past its (fixed) header: no read."""
        at, wire = _payload_len(self.values, 1, 1), _WIRE_DTYPE[self.values]
        return fmt.view_as(section[at : at + count * wire.itemsize], wire, "threshold values").to(torch.float32)

    def _device_coded(self, header: fmt.Header, sections: list[torch.Tensor]) -> bool:
        """Whether a payload whose check passed is device-coded with this codec's cast values:
        then its positions and values decode from its header's numbers alone, without a host
        read (:func:`known_positions`, :meth:`_known_values`). Sections of other lengths than
        the header's numbers raise."""
        n, (mode, count, width) = header.rows * header.cols, header.info[:3]
        if self.values == "lossy" or not (mode == BITMAP or (mode == PACKED and 1 <= width <= 63)):
            return False
        p = (count * width + 7) // 8 if mode == PACKED else (n + 7) // 8
        v = _payload_len(self.values, 1, 1) + count * _WIRE_ITEM[self.values]
        if [t.numel() for t in sections] != [p, v + (-v % 8)]:
            raise PayloadError(
                f"threshold payload: sections of {[t.numel() for t in sections]} bytes, expected "
                f"{[p, v + (-v % 8)]} for {count} of {n} entries with {self.values} values"
            )
        return True

    def sent(self, x: torch.Tensor, keep: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
        """What :meth:`decode` of ``x``'s payload gives, computed from ``x`` (cast values): the
        kept entries through the values' cast, zeros elsewhere (``zero``: a zero of ``x``'s dtype
        and device to take them from, made once by the caller; of one element (not 0-d), for a
        float32 ``x`` it also casts the values back: ``where``'s promotion, one op less)."""
        if self.values == "lossy":
            raise ValueError("threshold codec: lossy values are known only from their payload")
        if zero is not None and zero.dim() == 1 and x.dtype == zero.dtype == torch.float32:
            wire = x if self.values == "none" else x.to(_WIRE_DTYPE[self.values])
            return torch.where(keep.view_as(x), wire, zero)  # wire's values to float32, exactly
        kept = x.float()
        if self.values != "none":
            kept = kept.to(_WIRE_DTYPE[self.values]).to(torch.float32)
        return torch.where(keep.view_as(x), kept.to(x.dtype), 0.0 if zero is None else zero)

    def _positions(self, idx: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The smaller of delta-coded indices (zstd byte planes) and a bitmap."""
        n = keep.numel()
        if idx.numel() == 0:
            return torch.zeros(0, dtype=torch.uint8, device=keep.device), DELTAS
        if n <= np.iinfo(np.int32).max:
            deltas = torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32)
            coded = self._zstd.encode(deltas)
            if coded.numel() < (n + 7) // 8:
                return coded, DELTAS
        return torch.from_numpy(np.packbits(keep.cpu().numpy())).to(keep.device), BITMAP

    def positions(self, payload: torch.Tensor, head: fmt.HostHead | None = None) -> torch.Tensor:
        """The flat indices a payload carries values for (what a receiver may send back);
        ``head``: its head and check, read already (:func:`~compression.format.read_heads`):
        a device-coded payload's then read nothing."""
        header, sections = self._header(payload, head)
        if head is not None and self._device_coded(header, sections):
            mode, count, width = header.info[:3]
            return known_positions(sections[0], header.rows * header.cols, count, mode, width)
        return self._decode_positions(header, sections[0])

    def block_bytes(
        self, payload: torch.Tensor, blocks: Sequence[int], head: fmt.HostHead | None = None
    ) -> torch.Tensor:
        """Each block's share of ``payload`` (:meth:`Codec.block_bytes`): the positions and
        values sections split by the entries each block keeps, the rest (header, padding) in
        proportion to the widths. ``head``: as :meth:`positions`' (a device-coded payload's
        positions then read nothing)."""
        header, sections = self._header(payload, head)
        idx = self.positions(payload, head)
        device = payload.device
        ends = upload(torch.tensor(list(itertools.accumulate(header.widths)), dtype=torch.int64), device)
        block = torch.bucketize(idx % max(header.cols, 1), ends, right=True).clamp_(max=max(len(header.widths) - 1, 0))
        kept = torch.zeros(len(header.widths), dtype=torch.float64, device=device)
        kept.index_add_(0, block, torch.ones(idx.numel(), dtype=torch.float64, device=device))
        own = kept * (sum(t.numel() for t in sections) / max(idx.numel(), 1))
        return own + by_width(payload.numel() - own.sum(), header.widths, device)

    def _decode_positions(self, header: fmt.Header, section: torch.Tensor) -> torch.Tensor:
        n, count, mode = header.rows * header.cols, header.info[1], header.info[0]
        if mode == BITMAP:
            if section.numel() != (n + 7) // 8:
                raise PayloadError(f"threshold bitmap: {section.numel()} bytes for {n} entries")
            if self.coded_on_host(section.device):
                bits = np.unpackbits(section.cpu().numpy(), count=n).astype(bool)
                idx = torch.from_numpy(np.flatnonzero(bits)).to(section.device)
            else:
                idx = _bits_of(section, n, msb_first=True).nonzero().view(-1)
        elif mode == PACKED:
            width = header.info[2]
            if not 1 <= width <= 63 or section.numel() != (count * width + 7) // 8:
                raise PayloadError(f"threshold positions: {section.numel()} bytes for {count} deltas of {width} bits")
            idx = unpack_bits(section, count, width).cumsum(0)
        elif mode == DELTAS and count == 0:
            if section.numel():
                raise PayloadError(f"threshold positions: {section.numel()} bytes for no position")
            idx = torch.zeros(0, dtype=torch.int64, device=section.device)
        elif mode == DELTAS:
            deltas = self._zstd.decode(section, count, "threshold positions").to(torch.int64)
            idx = deltas.cumsum(0)
        else:
            raise PayloadError(f"threshold positions: unknown mode {mode}")
        if idx.numel() != count or (count and (int(idx[0]) < 0 or int(idx[-1]) >= n)):
            raise PayloadError(f"threshold positions: {idx.numel()} positions (expected {count}) within {n}")
        return idx

    def _decode(
        self, payload: Unpacked, ids: torch.Tensor | None, out: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """The dense tensor: kept values at their positions, zeros elsewhere. With the payload's
        head and check read already (:func:`~compression.format.read_heads`), a device-coded
        payload with cast values decodes without waiting for the device."""
        header, sections, head = payload.header, payload.sections, payload.head
        if len(sections) != 2:
            raise PayloadError(f"threshold payload has {len(sections)} sections, expected 2")
        if head is not None and self._device_coded(header, sections):
            mode, count, width = header.info[:3]
            idx = known_positions(sections[0], header.rows * header.cols, count, mode, width)
            values = self._known_values(sections[1], count)
        else:
            idx = self._decode_positions(header, sections[0])
            values_codec = codec_for(sections[1])
            if values_codec.name not in VALUE_CODECS:
                raise PayloadError(f"threshold payload: values written by codec {values_codec.name!r}")
            values = values_codec.decode(sections[1]).view(-1)
            if values.numel() != idx.numel():
                raise PayloadError(f"threshold payload: {values.numel()} values for {idx.numel()} positions")
        if out is None:
            out = torch.zeros(header.rows, header.cols, dtype=header.dtype, device=payload.device)
        else:
            out.zero_()
        dense = out if out.is_contiguous() else torch.zeros_like(out)  # a strided window: scatter, then copy
        dense.view(-1).index_copy_(0, idx, values.to(header.dtype))
        return out if dense is out else out.copy_(dense)


_WIRE_DTYPE = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_WIRE_ITEM = {name: dtype.itemsize for name, dtype in _WIRE_DTYPE.items()}


@functools.cache
def _payload_len(codec: str, blocks: int, sections: int) -> int:
    """Bytes of a payload of ``codec`` with ``blocks`` blocks and empty sections: its header."""
    header = fmt.Header(get_codec(codec).codec_id, torch.float32, 1, blocks, [1] * blocks, [math.inf] * blocks)
    return fmt.pack(header, [torch.zeros(0, dtype=torch.uint8)] * sections).numel()
