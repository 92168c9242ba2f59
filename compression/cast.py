"""Unbounded baselines that only change the wire dtype: ``none`` (exact), ``fp16``, ``bf16``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from . import format as fmt
from . import ops, reference
from .base import NO_CONTEXT, Bound, Codec, CodecContext, Unpacked, check_ids, register
from .dedup import id_sort


class CastCodec(Codec):
    """Send ``x.to(wire_dtype)``; ``eb`` is ignored (recorded as unbounded), and so are ``ids``
    but where the context sums a gradient's rows by id (``summed``) or keeps each id's value on its
    first row (``keep_first``)."""

    wire_dtype: ClassVar[torch.dtype | None]  # None: keep the input dtype (lossless)

    def _encode(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Cast and wrap ``x``; one section holding the cast values. ``context.summed`` (with ids):
        every row of each block sent as the sum of the block's rows of its id (a gradient's, summed
        in row order: the floats ``dlrm.embedding_comm.ids.sum_duplicates`` gives), on the device
        backend in the same op as the cast (:func:`compression.ops.cast_pack_summed`)."""
        if context.summed and ids is None:
            raise ValueError(f"codec {self.name!r} encode: summed needs the rows' ids")
        backend = self.backend_for(x.device)
        if not backend.reads_sizes and self._fused(x.dtype):  # one op: (sums,) values, header and check
            head = self._head(x.shape, x.dtype, widths, x.device)
            if context.summed and ids is not None:
                return ops.cast_pack_summed(x, head, _WIRE[self.wire_dtype], *id_sort(ids), widths)
            return ops.cast_pack(x, head, _WIRE[self.wire_dtype])
        if context.summed and ids is not None:
            x = reference.sum_runs(x, *id_sort(ids), widths)
        wire = x if self.wire_dtype is None else x.to(self.wire_dtype)
        header = fmt.Header(self.codec_id, x.dtype, x.shape[0], x.shape[1], widths, [float("inf")] * len(widths))
        return fmt.pack(header, [wire], device=x.device, backend=backend)

    def _fused(self, dtype: torch.dtype) -> bool:
        """Whether the fused ops cast this dtype (as they are, or float32 to a 16-bit wire)."""
        return self.wire_dtype is None or dtype == torch.float32

    def _head(
        self, shape: Sequence[int], dtype: torch.dtype, widths: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """The device backend's header of a payload of this shape, on ``device`` (uploaded once)."""
        n = shape[0] * shape[1] * (self.wire_dtype or dtype).itemsize
        header = fmt.Header(self.codec_id, dtype, shape[0], shape[1], list(widths), [float("inf")] * len(widths))
        return fmt.header_on(fmt.header_bytes(header, [n], "adler32"), device)

    def known_size(self, shape: tuple[int, int], dtype: torch.dtype, blocks: Sequence[int]) -> int:
        """The header of ``blocks`` and the values at the wire dtype, padded to 8 bytes."""
        n = shape[0] * shape[1] * (self.wire_dtype or dtype).itemsize
        return fmt.head_bytes(len(blocks), 1) + n + (-n % 8)

    def checks_in_decode(self, device: torch.device) -> bool:
        return not self.backend_for(device).reads_sizes

    def sums_duplicates(self, device: torch.device) -> bool:
        """On the device backend: the sums in the encode's op, the first rows kept in the decode's
        (:meth:`decode_checked`), after one sort of the ids each."""
        return not self.backend_for(device).reads_sizes

    def decode_checked(
        self,
        payload: torch.Tensor,
        out: torch.Tensor,
        blocks: Sequence[int],
        context: CodecContext = NO_CONTEXT,
        *,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One op: the values into ``out`` and the verdict (the check holds, the header is this
        shape's), no host wait; a payload of another size raises at once (its size is the host's).
        ``context.keep_first`` (with ``ids``): each id's value on its block's first row of the id
        alone, zeros on the others, in the same op (:func:`compression.ops.cast_unpack_first`)."""
        keys = None
        if context.keep_first:
            keys = check_ids(ids, out.shape[0], len(blocks), f"codec {self.name!r} decode")
            if keys is None:
                raise ValueError(f"codec {self.name!r} decode: keep_first needs the rows' ids")
        if not self._fused(out.dtype):
            raise ValueError(f"codec {self.name!r}: no fused decode to {out.dtype}")
        head = self._head(out.shape, out.dtype, blocks, out.device)
        n = out.numel() * (self.wire_dtype or out.dtype).itemsize
        total = head.numel() + n + (-(head.numel() + n) % 8)
        if payload.numel() != total:
            what = "truncated" if payload.numel() < total else "trailing bytes"
            raise fmt.PayloadError(f"payload is {payload.numel()} bytes where {total} were expected ({what})")
        if keys is not None:
            return ops.cast_unpack_first(payload, head, _WIRE[self.wire_dtype], out, *id_sort(keys), list(blocks))
        return ops.cast_unpack(payload, head, _WIRE[self.wire_dtype], out)

    def head_size(self, n_blocks: int) -> int:
        """Bytes a decoder needs on the host: the header."""
        return fmt.head_bytes(n_blocks, 1)

    def prepare_decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None, context: CodecContext = NO_CONTEXT
    ) -> tuple[torch.Tensor | None, object] | None:
        """On the device backend the header alone, read with the collective's (nothing else)."""
        return None if self.backend_for(payload.device).reads_sizes else (None, None)

    def _decode(
        self, payload: Unpacked, ids: torch.Tensor | None, out: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Undo the cast; the result never aliases the payload. ``context.keep_first`` (with
        ``ids``): each id's value on its block's first row of the id alone, zeros on the others."""
        header, (section,) = payload.header, payload.sections
        if context.keep_first:
            keys = check_ids(ids, header.rows, len(header.widths), f"codec {self.name!r} decode")
            if keys is None:
                raise ValueError(f"codec {self.name!r} decode: keep_first needs the rows' ids")
            result = self._decode(payload, None, out, NO_CONTEXT)
            return reference.keep_first_runs(result, *id_sort(keys), header.widths)
        wire_dtype = header.dtype if self.wire_dtype is None else self.wire_dtype
        values = fmt.view_as(section, wire_dtype, "cast values")
        if values.numel() != header.rows * header.cols:
            raise fmt.PayloadError(f"cast values: {values.numel()} values for shape [{header.rows}, {header.cols}]")
        values = values.reshape(header.rows, header.cols)
        if out is not None:
            return out.copy_(values)  # one pass: copy and cast together
        return values.clone() if values.dtype == header.dtype else values.to(header.dtype)


_WIRE = {None: 0, torch.float16: 1, torch.bfloat16: 2}  # compression.reference.WIRE_DTYPES' codes


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
