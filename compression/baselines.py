"""TorchRec's quantised-comms baselines through fbgemm: ``int8``, ``fp8``, ``mx4`` (unbounded).

They reproduce what ``torchrec.distributed.fbgemm_qcomm_codec`` sends (fbgemm_gpu
``quantize_comm``): INT8 row-wise over chunks of ``row_dim`` values (scale and bias per chunk),
FP8 as HFP8 1-4-3 (bias 15, clamped at 0.9375: TorchRec's default, non-row-wise) or row-wise
FP8 (CUDA only in fbgemm), MX4 with a shared exponent per group of 32. The flattened tensor is
zero-padded to a whole number of chunks. fbgemm is imported on first use only.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from . import format as fmt
from .base import Bound, Codec, CodecContext, Unpacked, into, register

# fbgemm_gpu.quantize_comm constants (TorchRec's defaults).
HFP8_EBITS, HFP8_MBITS, HFP8_BIAS = 4, 3, 15
HFP8_MAX = 2.0 ** ((1 << HFP8_EBITS) - 2 - HFP8_BIAS) * (2 - 2.0**-HFP8_MBITS)


def _fbgemm() -> None:
    """Load fbgemm's operators (slow import, and absent on some installs)."""
    try:
        import fbgemm_gpu  # registers torch.ops.fbgemm
        import fbgemm_gpu.quantize.quantize_ops  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise NotImplementedError(f"fbgemm_gpu is not importable ({e}); the fbgemm baselines need it") from e


class FbgemmCodec(Codec):
    """Shared wrapper: flatten, pad to ``chunk`` values, quantise, one section."""

    chunk_param: ClassVar[str]

    def __init__(self, chunk: int):
        if chunk < 1:
            raise ValueError(f"{self.name}: {self.chunk_param} must be >= 1, got {chunk}")
        self.chunk = chunk

    def _quantize(self, flat: torch.Tensor, chunk: int) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize(self, wire: torch.Tensor, n_padded: int, chunk: int) -> torch.Tensor:
        raise NotImplementedError

    def _wire_bytes(self, n_padded: int, chunk: int) -> int:
        raise NotImplementedError

    def _encode(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Quantise ``x`` as TorchRec's qcomms would; ``eb`` and ``ids`` are ignored."""
        _fbgemm()
        flat = x.float().reshape(-1)
        pad = -flat.numel() % self.chunk
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        wire = self._quantize(flat, self.chunk) if flat.numel() else flat.new_zeros(0, dtype=torch.uint8)
        header = fmt.Header(
            self.codec_id,
            x.dtype,
            x.shape[0],
            x.shape[1],
            widths,
            [float("inf")] * len(widths),
            info=[self.chunk, 0, 0, 0],
        )
        return fmt.pack(header, [wire], device=x.device, backend=self.backend_for(x.device))

    def head_size(self, n_blocks: int) -> int:
        """Bytes a decoder needs on the host: the header."""
        return fmt.head_bytes(n_blocks, 1)

    def _decode(
        self, payload: Unpacked, ids: torch.Tensor | None, out: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Dequantise back to the input's shape and dtype."""
        header, (section,) = payload.header, payload.sections
        chunk = header.info[0]
        if chunk < 1:
            raise fmt.PayloadError(f"{self.name}: chunk size {chunk} in header")
        n = header.rows * header.cols
        n_padded = n + (-n % chunk)
        if n_padded == 0:
            return into(torch.zeros(header.rows, header.cols, dtype=header.dtype, device=payload.device), out)
        _fbgemm()
        if section.numel() != self._wire_bytes(n_padded, chunk):
            raise fmt.PayloadError(f"{self.name}: {section.numel()} quantised bytes for {n_padded} values")
        values = self._dequantize(section, n_padded, chunk).reshape(-1)[:n]
        return into(values.reshape(header.rows, header.cols).to(header.dtype), out)


@register
class Int8Codec(FbgemmCodec):
    """INT8 row-wise: fbgemm ``FloatToFused8BitRowwiseQuantized`` over chunks of ``row_dim``."""

    name = "int8"
    codec_id = 5
    chunk_param = "row_dim"

    def __init__(self, row_dim: int = 32):
        super().__init__(row_dim)

    def _quantize(self, flat: torch.Tensor, chunk: int) -> torch.Tensor:
        return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(flat.view(-1, chunk))

    def _dequantize(self, wire: torch.Tensor, n_padded: int, chunk: int) -> torch.Tensor:
        return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(wire.view(n_padded // chunk, -1))

    def _wire_bytes(self, n_padded: int, chunk: int) -> int:
        return n_padded // chunk * ((chunk + 3) // 4 * 4 + 8)


@register
class Fp8Codec(FbgemmCodec):
    """FP8: HFP8 1-4-3 (TorchRec's default, clamps |x| to 0.9375) or fbgemm row-wise FP8 (CUDA)."""

    name = "fp8"
    codec_id = 6
    chunk_param = "row_dim"

    def __init__(self, rowwise: bool = False, row_dim: int = 32):
        super().__init__(row_dim if rowwise else 1)
        self.rowwise = rowwise

    def _encode(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """As TorchRec; row-wise FP8 raises NotImplementedError off CUDA (fbgemm has no CPU kernel)."""
        if self.rowwise and x.device.type != "cuda":
            raise NotImplementedError(
                "fp8 rowwise=True needs CUDA: fbgemm 1.8 raises 'fp8 is not supported by CPU'; use rowwise=False (HFP8)"
            )
        return super()._encode(x, widths, eb, ids, context)

    def _quantize(self, flat: torch.Tensor, chunk: int) -> torch.Tensor:
        if chunk > 1:
            return torch.ops.fbgemm.FloatToFP8RowwiseQuantized(flat.view(-1, chunk), True).view(-1)
        return torch.ops.fbgemm.FloatToHFP8Quantized(flat.view(1, -1), HFP8_EBITS, HFP8_BIAS, HFP8_MAX).view(-1)

    def _dequantize(self, wire: torch.Tensor, n_padded: int, chunk: int) -> torch.Tensor:
        if chunk > 1:
            if wire.device.type != "cuda":
                raise NotImplementedError("row-wise fp8 payload: fbgemm decodes it on CUDA only")
            return torch.ops.fbgemm.FP8RowwiseQuantizedToFloat(wire.view(n_padded // chunk, -1), True, 0)
        return torch.ops.fbgemm.HFP8QuantizedToFloat(wire.view(1, -1), HFP8_EBITS, HFP8_BIAS)

    def _wire_bytes(self, n_padded: int, chunk: int) -> int:
        return n_padded if chunk == 1 else n_padded // chunk * ((chunk + 3) // 4 * 4 + 8)


@register
class Mx4Codec(FbgemmCodec):
    """MX4 (e2m1 values, one shared 8-bit exponent per ``group_size`` values), fbgemm's packer."""

    name = "mx4"
    codec_id = 7
    chunk_param = "group_size"

    def __init__(self, group_size: int = 32):
        if group_size % 2:
            raise ValueError(f"mx4: group_size must be even, got {group_size}")
        super().__init__(group_size)

    def _quantize(self, flat: torch.Tensor, chunk: int) -> torch.Tensor:
        from fbgemm_gpu.quantize_utils import fp32_to_mx4

        return fp32_to_mx4(flat, chunk).view(torch.uint8).view(-1)

    def _dequantize(self, wire: torch.Tensor, n_padded: int, chunk: int) -> torch.Tensor:
        from fbgemm_gpu.quantize_utils import mx4_to_fp32

        return mx4_to_fp32(wire, chunk)

    def _wire_bytes(self, n_padded: int, chunk: int) -> int:
        return n_padded // 2 + n_padded // chunk
