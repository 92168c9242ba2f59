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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from . import coders
from . import format as fmt
from .base import Bound, Codec, check_input, check_out, codec_for, get_codec, register, resolve_blocks
from .format import PayloadError

DELTAS, BITMAP = 0, 1
VALUE_CODECS = ("none", "fp16", "bf16", "lossy")


def kth_largest_abs(x: torch.Tensor, keep: float) -> float:
    """The threshold that keeps the ``ceil(keep * numel)`` largest ``|x|`` (ties keep more).

    ``keep >= 1`` gives 0.0 (everything passes ``|x| >= 0``); NaN counts as the largest value.
    """
    if not keep > 0.0:  # NaN fails too
        raise ValueError(f"keep must be > 0, got {keep}")
    n = x.numel()
    if keep >= 1.0 or n == 0:
        return 0.0
    k = max(1, math.ceil(keep * n))
    mags = x.detach().reshape(-1).abs().float().nan_to_num(nan=math.inf, posinf=math.inf)
    return float(torch.kthvalue(mags, n - k + 1).values)


def _checked(threshold: float | Sequence[float]) -> list[float]:
    ts = [float(threshold)] if isinstance(threshold, (int, float)) else [float(t) for t in threshold]
    if any(not t >= 0.0 for t in ts):  # NaN fails too
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

    def __init__(self, threshold: float | Sequence[float] = 0.0, values: str = "none", level: int = 1):
        if values not in VALUE_CODECS:
            raise ValueError(f"values must be one of {VALUE_CODECS}, got {values!r}")
        self.thresholds = _checked(threshold)
        self.values, self.level = values, level
        self._values = get_codec(values, dedup=False, level=level) if values == "lossy" else get_codec(values)
        self._zstd = coders.ZstdCoder(level)

    def __repr__(self) -> str:
        return f"ThresholdCodec(threshold={self.thresholds}, values={self.values!r})"

    def mask(self, x: torch.Tensor, widths: Sequence[int], thresholds: Sequence[float] | None = None) -> torch.Tensor:
        """Which entries of ``x`` [rows, cols] travel (``|x| >= threshold`` of their block, or NaN)."""
        ts = self.thresholds if thresholds is None else _checked(thresholds)
        ts = ts * len(widths) if len(ts) == 1 else ts
        if len(ts) != len(widths):
            raise ValueError(f"{len(ts)} thresholds for {len(widths)} blocks {list(widths)}")
        out = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        c = 0
        for t, w in zip(ts, widths, strict=True):
            torch.ge(x[:, c : c + w].abs(), t, out=out[:, c : c + w])  # +-inf pass, NaN does not
            c += w
        return out.logical_or_(torch.isnan(x))

    def count(self, payload: torch.Tensor) -> int:
        """How many entries a payload carries."""
        header, _ = self._header(payload)
        return int(header.info[1])

    def encode(
        self,
        x: torch.Tensor,
        eb: Bound | None = None,
        ids: torch.Tensor | None = None,
        *,
        blocks: Sequence[int] | None = None,
        thresholds: Sequence[float] | None = None,
    ) -> torch.Tensor:
        """Positions and values of the kept entries; ``ids`` are not used (no dedup);
        ``thresholds`` (one per block) replace the codec's own for this call."""
        check_input(x)
        rows, cols = x.shape
        widths = resolve_blocks(cols, None, None, blocks)
        keep = self.mask(x, widths, thresholds).reshape(-1)
        flat = x.reshape(-1)
        idx = keep.nonzero().view(-1)
        kept = flat[idx].float().view(-1, 1)
        bound = None
        if self.values == "lossy":
            if eb is None or isinstance(eb, (Sequence, torch.Tensor)):
                raise ValueError("threshold codec with lossy values needs one absolute bound eb (a float)")
            bound = float(eb)
        positions, mode = self._positions(idx, keep)
        values = self._values.encode(kept, bound)
        header = fmt.Header(
            self.codec_id, x.dtype, rows, cols, widths, [math.inf] * len(widths), info=[mode, int(idx.numel()), 0, 0]
        )
        return fmt.pack(header, [positions, values], device=x.device)

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

    def positions(self, payload: torch.Tensor) -> torch.Tensor:
        """The flat indices a payload carries values for (what a receiver may send back)."""
        header, (pos_s, _) = self._header(payload)
        return self._decode_positions(header, pos_s)

    def _decode_positions(self, header: fmt.Header, section: torch.Tensor) -> torch.Tensor:
        n, count, mode = header.rows * header.cols, header.info[1], header.info[0]
        if mode == BITMAP:
            if section.numel() != (n + 7) // 8:
                raise PayloadError(f"threshold bitmap: {section.numel()} bytes for {n} entries")
            bits = np.unpackbits(section.cpu().numpy(), count=n).astype(bool)
            idx = torch.from_numpy(np.flatnonzero(bits)).to(section.device)
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

    def decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The dense tensor: kept values at their positions, zeros elsewhere."""
        header, sections = self._header(payload)
        check_out(out, header, payload.device)
        if len(sections) != 2:
            raise PayloadError(f"threshold payload has {len(sections)} sections, expected 2")
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
