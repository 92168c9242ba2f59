"""Unbounded baselines that only change the wire dtype: ``none`` (exact), ``fp16``, ``bf16``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from . import format as fmt
from .base import (
    NO_CONTEXT,
    Bound,
    Codec,
    CodecContext,
    check_ids,
    check_input,
    check_out,
    register,
    resolve_blocks,
    resolve_bounds,
)


class CastCodec(Codec):
    """Send ``x.to(wire_dtype)``; ``eb`` and ``ids`` are ignored (recorded as unbounded)."""

    wire_dtype: ClassVar[torch.dtype | None]  # None: keep the input dtype (lossless)

    def encode(
        self,
        x: torch.Tensor,
        eb: Bound | None = None,
        ids: torch.Tensor | None = None,
        *,
        blocks: Sequence[int] | None = None,
        context: CodecContext = NO_CONTEXT,
    ) -> torch.Tensor:
        """Cast and wrap ``x``; one section holding the cast values."""
        check_input(x)
        widths = resolve_blocks(x.shape[1], eb, ids, blocks)
        resolve_bounds(eb, widths, required=False)  # reject malformed bounds even though unused
        check_ids(ids, x.shape[0], len(widths), f"codec {self.name!r} encode")
        wire = x if self.wire_dtype is None else x.to(self.wire_dtype)
        header = fmt.Header(self.codec_id, x.dtype, x.shape[0], x.shape[1], widths, [float("inf")] * len(widths))
        return fmt.pack(header, [wire], device=x.device, backend=self.backend_for(x.device))

    def head_size(self, n_blocks: int) -> int:
        """Bytes a decoder needs on the host: the header."""
        return fmt.head_bytes(n_blocks, 1)

    def prepare_decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None, context: CodecContext = NO_CONTEXT
    ) -> tuple[torch.Tensor | None, object] | None:
        """On the device backend the header alone, read with the collective's (nothing else)."""
        return None if self.backend_for(payload.device).reads_sizes else (None, None)

    def decode(
        self,
        payload: torch.Tensor,
        ids: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        head: fmt.HostHead | None = None,
        context: CodecContext = NO_CONTEXT,
    ) -> torch.Tensor:
        """Undo the cast; the result never aliases ``payload``. ``head``: the payload's head,
        read already (nothing then waits for the device)."""
        header, (section,) = self._header(payload, head)
        check_out(out, header, payload.device)
        wire_dtype = header.dtype if self.wire_dtype is None else self.wire_dtype
        values = fmt.view_as(section, wire_dtype, "cast values")
        if values.numel() != header.rows * header.cols:
            raise fmt.PayloadError(f"cast values: {values.numel()} values for shape [{header.rows}, {header.cols}]")
        values = values.reshape(header.rows, header.cols)
        if out is not None:
            return out.copy_(values)  # one pass: copy and cast together
        return values.clone() if values.dtype == header.dtype else values.to(header.dtype)


@register
class NoneCodec(CastCodec):
    """Exact: the input bytes as they are."""

    name = "none"
    codec_id = 1
    wire_dtype = None


@register
class Fp16Codec(CastCodec):
    """IEEE half precision (round to nearest even, overflow to inf)."""

    name = "fp16"
    codec_id = 2
    wire_dtype = torch.float16


@register
class Bf16Codec(CastCodec):
    """bfloat16 (round to nearest even)."""

    name = "bf16"
    codec_id = 3
    wire_dtype = torch.bfloat16
