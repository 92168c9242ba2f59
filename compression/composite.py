"""One payload, a codec per column block: each table of a chunk travels with the codec chosen for it.

:class:`PerBlockCodec` groups the blocks by their codec, encodes each group (its columns gathered
into one tensor) with that codec, and packs the group payloads as the sections of one payload; a
first section records which group every block is in. Decoding needs no parameters: every group
payload names its own codec. A chunk whose blocks all use one codec travels as that codec's own
payload (no second header, copy or checksum: the common case once a strategy is chosen).

Bounds: a block's ``eb`` is honoured by every choice. A bounded codec (``lossy``) holds it by
construction; a cast or fixed-rate codec is used for a block only if its worst-case error on that
block (:func:`worst_case_error`: half a unit in the last place of the block's largest magnitude
for fp16/bf16, half a quantisation step of its range for int8) is within ``eb``; otherwise the
block goes to the ``fallback`` (bounded) option instead. So a choice can never loosen the bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from . import format as fmt
from .base import (
    Bound,
    Codec,
    check_ids,
    check_input,
    check_out,
    codec_for,
    get_codec,
    register,
    resolve_blocks,
    resolve_bounds,
)
from .format import PayloadError

# The options by name: a codec of this package and its parameters.
OPTIONS: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "int8": ("int8", {"row_dim": 32}),
    "lossy/fixed": ("lossy", {"entropy": False}),
    "lossy/zstd": ("lossy", {"entropy": True}),
}

# Worst-case absolute error of the unbounded options, as (relative to the largest |x|, absolute
# floor from subnormals) for the casts, and per range for int8 (fbgemm's row-wise uint8 over
# chunks: half of a step of (max - min) / 255 of a chunk, at most of the block).
_CAST = {"none": (0.0, 0.0), "fp16": (2.0**-11, 2.0**-25), "bf16": (2.0**-8, 2.0**-134)}
_FP16_MAX = 65504.0


def worst_case_error(option: str, block: torch.Tensor) -> float:
    """The largest error ``option`` can make on ``block`` (inf where it could lose a non-finite
    value or overflow, so that such a block goes to the bounded fallback, which keeps them)."""
    if option == "none" or block.numel() == 0:
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(block.detach()))  # NaN and inf propagate
    top = max(abs(lo), abs(hi))
    if not math.isfinite(top):
        return math.inf
    if option in _CAST:
        rel, floor = _CAST[option]
        return math.inf if option == "fp16" and top >= _FP16_MAX else top * rel + floor
    if option == "int8":
        return (hi - lo) / 255.0 / 2.0 * (1 + 2.0**-10)  # half a step of the range; fp16 scale rounding
    raise ValueError(f"no worst-case error for option {option!r}; bounded codecs hold their own bound")


@register
class PerBlockCodec(Codec):
    """Each column block with its own codec (``options``: name -> codec), chosen per call."""

    name = "per_block"
    codec_id = 9
    bounded = True

    def __init__(self, options: Sequence[str] | Mapping[str, Codec] = tuple(OPTIONS), fallback: str = "lossy/zstd"):
        if isinstance(options, Mapping):
            self.options = dict(options)
        else:
            unknown = sorted(set(options) - set(OPTIONS))
            if unknown:
                raise ValueError(f"per_block options {unknown} unknown; known: {sorted(OPTIONS)}")
            self.options = {n: get_codec(OPTIONS[n][0], **OPTIONS[n][1]) for n in options}
        self.fallback = fallback
        if fallback not in self.options:
            raise ValueError(f"fallback {fallback!r} is not among the options {sorted(self.options)}")
        if not getattr(self.options[fallback], "bounded", False):
            raise ValueError(f"fallback {fallback!r} must be a bounded codec")

    def effective(
        self, x: torch.Tensor, widths: Sequence[int], bounds: Sequence[float], choice: Sequence[str]
    ) -> list[str]:
        """The option each block really gets: its choice, or the fallback where that could exceed
        the block's bound."""
        out, c = [], 0
        for w, eb, name in zip(widths, bounds, choice, strict=True):
            codec = self.options[name]
            ok = getattr(codec, "bounded", False) or worst_case_error(name, x[:, c : c + w]) <= eb
            out.append(name if ok else self.fallback)
            c += w
        return out

    def encode(
        self,
        x: torch.Tensor,
        eb: Bound | None = None,
        ids: torch.Tensor | None = None,
        *,
        blocks: Sequence[int] | None = None,
        choice: Sequence[str] | None = None,
    ) -> torch.Tensor:
        """Encode each block with ``choice[k]`` (default: the fallback for every block)."""
        check_input(x)
        rows, cols = x.shape
        widths = resolve_blocks(cols, eb, ids, blocks)
        bounds = resolve_bounds(eb, widths, required=True)
        keys = check_ids(ids, rows, len(widths), "per_block encode")
        choice = list(choice) if choice is not None else [self.fallback] * len(widths)
        unknown = sorted({c for c in choice} - set(self.options))
        if len(choice) != len(widths) or unknown:
            raise ValueError(f"per_block: choice {choice} for {len(widths)} blocks; unknown options {unknown}")
        used = self.effective(x, widths, bounds, choice)
        names = sorted(set(used), key=used.index)  # groups in first-use order
        if len(names) == 1:
            return self.options[names[0]].encode(x, bounds, keys, blocks=widths)
        starts = [sum(widths[:k]) for k in range(len(widths))]
        sections = [torch.tensor([names.index(u) for u in used], dtype=torch.uint8)]
        for name in names:
            members = [k for k, u in enumerate(used) if u == name]
            if len(members) == len(widths):  # one codec for the whole chunk: no gather
                sub, sub_ids = x, keys
            else:
                cols_of = torch.cat([torch.arange(starts[k], starts[k] + widths[k]) for k in members]).to(x.device)
                sub, sub_ids = x.index_select(1, cols_of), None if keys is None else keys[:, members]
            sections.append(
                self.options[name].encode(
                    sub, [bounds[k] for k in members], sub_ids, blocks=[widths[k] for k in members]
                )
            )
        header = fmt.Header(self.codec_id, x.dtype, rows, cols, widths, bounds)
        return fmt.pack(header, sections, device=x.device)

    def groups(self, payload: torch.Tensor) -> list[str]:
        """The codec each block of a payload travelled with."""
        codec = codec_for(payload)
        if not isinstance(codec, PerBlockCodec):  # one codec for every block
            return [codec.name] * len(fmt.unpack(payload)[0].widths)
        _, sections = self._header(payload)
        return [codec_for(sections[1 + int(g)]).name for g in sections[0].tolist()]

    def decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None = None, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        codec = codec_for(payload)
        if not isinstance(codec, PerBlockCodec):  # one codec for every block (see encode)
            return codec.decode(payload, ids, out=out)
        header, sections = self._header(payload)
        check_out(out, header, payload.device)
        widths = header.widths
        if not sections or sections[0].numel() != len(widths) or len(sections) < 2:
            raise PayloadError(f"per_block payload: {len(sections)} sections for {len(widths)} blocks")
        group = sections[0].tolist()
        if any(g >= len(sections) - 1 for g in group):
            raise PayloadError(f"per_block payload: block groups {group} beyond its {len(sections) - 1} groups")
        keys = check_ids(ids, header.rows, len(widths), "per_block decode")
        if out is None:
            out = torch.empty(header.rows, header.cols, dtype=header.dtype, device=payload.device)
        starts = [sum(widths[:k]) for k in range(len(widths))]
        for g, sub in enumerate(sections[1:]):
            members = [k for k, gk in enumerate(group) if gk == g]
            if len(members) == len(widths):  # one codec for the whole chunk: straight into out
                return codec_for(sub).decode(sub, keys, out=out)
            part = codec_for(sub).decode(sub, None if keys is None else keys[:, members])
            c = 0
            for k in members:
                out[:, starts[k] : starts[k] + widths[k]] = part[:, c : c + widths[k]]
                c += widths[k]
        return out
