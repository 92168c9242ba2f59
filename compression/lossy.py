"""The error-bounded codec: dedup -> quantise (bin 2 eb, verified) -> fixed-length or entropy coder.

Sections, one per stage: counts (dedup, int64 per block) | index (dedup, value mode only) |
codes (coder) | exceptions (quantiser). The header's codec info records the stage choices:
word 0 = dedup mode | coder << 2, word 1 = fingerprint of the ids in id mode.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import torch

from . import coders, dedup, quantize, reference
from . import format as fmt
from .base import (
    Bound,
    Codec,
    block_bounds,
    check_ids,
    check_input,
    check_out,
    device_bounds,
    held_ids,
    register,
    resolve_blocks,
)
from .format import PayloadError

Entropy = bool | str


_WEIGHTS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def ids_fingerprint(ids: torch.Tensor) -> int:
    """32-bit weighted sum of the ids [rows, n_blocks]: catches a receiver passing other ids.

    Weights are odd, so changing any single id changes the sum; one id column shared by every
    block (a [rows] id tensor) is summed once.
    """
    return int(fingerprint_of(ids))


def fingerprint_of(ids: torch.Tensor) -> torch.Tensor:
    """:func:`ids_fingerprint` as an int64 0-d tensor on the ids' device (no host wait)."""
    rows, nb = ids.shape
    key = (rows, nb, ids.device)
    if key not in _WEIGHTS:
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        w_row = torch.arange(rows, device=ids.device) * -7046029254386353131 + 0x2545F491 | 1
        w_blk = torch.arange(nb, device=ids.device) * 0x5851F42D4C957F2D + 0x14057B7EF767814F | 1
        _WEIGHTS[key] = (w_row, w_blk)
    w_row, w_blk = _WEIGHTS[key]
    if nb == 1 or ids.stride(1) == 0:
        total = (ids[:, 0] * w_row).sum() * w_blk.sum()  # not torch.dot: CUDA has no int64 dot
    else:
        total = ((ids * w_row[:, None]).sum(0) * w_blk).sum()
    return total & 0xFFFFFFFF


def _backend(name: str, device: torch.device):
    """The module with quantize/dequantize/block_pack/block_unpack for this device."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return reference
    if name in ("triton", "auto"):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' on CPU tensors runs only in Triton's interpreter: "
                "set TRITON_INTERPRET=1 before triton is imported"
            )
        from . import kernels  # imports triton; only needed on this path

        return kernels
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {name!r}")


@register
class LossyCodec(Codec):
    """Error-bounded: ``|decode(encode(x, eb)) - x| <= eb`` for every element, always.

    Parameters: ``entropy`` True (byte planes + zstd, near entropy), False (cuSZp-style
    fixed-length blocks, the GPU fast path) or "auto" (zstd for CPU tensors, blocks on a device);
    ``level``: zstd level; ``dedup``: deduplicate bit-identical rows when no ids are given;
    ``backend``: "auto" (Triton kernels on CUDA, torch reference on CPU), "torch" or "triton"
    (on CPU only under TRITON_INTERPRET=1); ``verify_ids``: check on encode that rows sharing an
    id in a block are bit-identical (the contract the id path relies on; costs one full compare).
    """

    name = "lossy"
    codec_id = 4
    bounded = True

    def __init__(
        self,
        entropy: Entropy = "auto",
        level: int = 1,
        dedup: bool = True,
        backend: str = "auto",
        verify_ids: bool = False,
    ):
        if entropy not in (True, False, "auto"):
            raise ValueError(f"entropy must be True, False or 'auto', got {entropy!r}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.entropy, self.level, self.dedup, self.backend = entropy, level, dedup, backend
        self.verify_ids = verify_ids
        self._zstd = coders.ZstdCoder(level)

    def _coder(self, kind: int, backend) -> coders.Coder:
        return self._zstd if kind == coders.ZSTD else coders.BlockCoder(backend)

    def encode(
        self,
        x: torch.Tensor,
        eb: Bound | None = None,
        ids: torch.Tensor | None = None,
        *,
        blocks: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Compress ``x`` under absolute bound(s) ``eb``; see the package docstring."""
        payload = self._encode(x, eb, ids, blocks, deferred=False)
        assert isinstance(payload, torch.Tensor)
        return payload

    def encode_deferred(
        self,
        x: torch.Tensor,
        eb: Bound | None = None,
        ids: torch.Tensor | None = None,
        *,
        blocks: Sequence[int] | None = None,
        single: torch.Tensor | None = None,
    ) -> torch.Tensor | fmt.Deferred:
        """:meth:`encode`, but where the payload is built on the device (:meth:`defers`), with its
        length left on the device (:class:`~compression.format.Deferred`): made without a host
        wait. ``single``: a 0-d bool on the device saying whether ``ids`` hold (else the payload
        is ``encode(x, eb)``'s), for a caller that has not read it yet."""
        return self._encode(x, eb, ids, blocks, deferred=True, single=single)

    def defers(self, device: torch.device) -> bool:
        """Whether :meth:`encode_deferred` builds payloads on ``device`` without a host wait: the
        fixed-length coder there, the device's check (Adler-32), ids taken on trust."""
        return self._kind(device) == coders.FIXED and fmt._check_for(device) == "adler32" and not self.verify_ids

    def _kind(self, device: torch.device) -> int:
        """The coder payloads built on ``device`` take: entropy=auto is zstd where the payload is
        checked on the host (the CPU), the fixed-length coder where it stays on the device (zstd
        would copy it to the host)."""
        on_host = fmt._check_for(device) != "adler32"
        return coders.ZSTD if self.entropy is True or (self.entropy == "auto" and on_host) else coders.FIXED

    def _encode(
        self,
        x: torch.Tensor,
        eb: Bound | None,
        ids: torch.Tensor | None,
        blocks: Sequence[int] | None,
        deferred: bool,
        single: torch.Tensor | None = None,
    ) -> torch.Tensor | fmt.Deferred:
        check_input(x)
        rows, cols = x.shape
        widths = resolve_blocks(cols, eb, ids, blocks)
        bounds = block_bounds(eb, widths, x.device)
        keys = check_ids(ids, rows, len(widths), "lossy encode")
        if keys is not None and keys.device != x.device:
            raise ValueError(f"lossy encode: ids on {keys.device}, x on {x.device}")
        backend = _backend(self.backend, x.device)
        kind = self._kind(x.device)
        coder = self._coder(kind, backend)
        if deferred and self.defers(x.device) and x.numel() < 2**31:
            return self._encode_deferred(x, widths, bounds, keys, backend, single if keys is not None else None)
        keys = held_ids(keys, single)  # off the device path: read whether the ids hold

        if keys is not None:
            plan = dedup.plan_by_ids(keys)
            assert plan.inverse is not None  # an id plan always has its inverse
            if self.verify_ids:
                bad = dedup.mismatched_blocks(x, widths, plan.counts, plan.first, plan.inverse)
                if bad.any():
                    raise ValueError(
                        f"lossy encode: rows sharing an id differ in block(s) "
                        f"{bad.nonzero().view(-1).tolist()}: ids must identify rows"
                    )
        elif self.dedup and rows > 1:
            plan = dedup.plan_by_value(x, widths)
            if not dedup.index_pays_off(plan, widths, rows):
                plan = dedup.identity_plan(rows, len(widths), x.device)
        else:
            plan = dedup.identity_plan(rows, len(widths), x.device)
        values = dedup.gather(x, widths, plan)
        step, ed = quantize.steps_and_margins(bounds, plan.counts, widths, values.numel(), x.device)
        codes, exceptions = quantize.encode(values, step, ed, backend)

        if plan.mode == dedup.VALUE:
            assert plan.inverse is not None  # a value plan always has its inverse
            index = coder.encode(plan.inverse.reshape(-1).to(torch.int32))
        else:
            index = torch.zeros(0, dtype=torch.uint8, device=x.device)
        info = [plan.mode | kind << 2, 0, 0, 0]  # word 1: the ids' fingerprint, computed on the device
        header = fmt.Header(self.codec_id, x.dtype, rows, cols, widths, bounds, info=info)
        sections = [plan.counts, index, coder.encode(codes), exceptions]
        fingerprint = None if keys is None else {1: fingerprint_of(keys)}
        return fmt.pack(header, sections, device=x.device, device_info=fingerprint)

    def _encode_deferred(
        self,
        x: torch.Tensor,
        widths: list[int],
        bounds: list[float] | torch.Tensor,
        keys: torch.Tensor | None,
        backend,
        single: torch.Tensor | None,
    ) -> fmt.Deferred:
        """:meth:`encode`'s payload, the same bytes, built with every size on the device: each
        block's unique rows stay at its capacity (all rows), are quantised there and moved to
        the front; the sections' lengths are written by the device. ``single``: see
        :meth:`encode_deferred` (both plans made, the device picks one)."""
        rows, nb = x.shape[0], len(widths)
        none = torch.zeros(0, dtype=torch.uint8, device=x.device)
        index: list[tuple[torch.Tensor, fmt.Length]] = [(none, 0)]
        info: dict[int, torch.Tensor] = {}  # header words written by the device
        mode: int | torch.Tensor = dedup.NONE
        every = torch.arange(rows, device=x.device).expand(nb, rows)
        full = torch.full((nb,), rows, dtype=torch.int64, device=x.device)
        counts, first = full, every
        if keys is not None:
            mode = dedup.IDS
            counts, first = dedup.first_capacity(keys)
            info[1] = fingerprint_of(keys)
        if (keys is None and self.dedup and rows > 1) or single is not None:
            if self.dedup and rows > 1:
                kept, by_value, from_value, inverse = dedup.value_capacity(x, widths)
            else:  # encode(x, eb) would send every row
                kept, by_value, from_value, inverse = (
                    torch.zeros((), dtype=torch.bool, device=x.device),
                    full,
                    every,
                    every,
                )
            value_mode = torch.where(kept, dedup.VALUE, dedup.NONE)  # the index travels where it pays off
            if single is None:
                mode, counts, first = value_mode, by_value, from_value
            else:  # the ids hold where single; elsewhere the rows go as encode(x, eb) sends them
                kept = kept & ~single
                mode = torch.where(single, dedup.IDS, value_mode)
                counts, first = torch.where(single, counts, by_value), torch.where(single, first, from_value)
                info[1] = torch.where(single, info[1], 0)
            # encode(): the index coded where it is kept, else no section (no codes, no group widths)
            index = coders.BlockCoder(backend).encode_capacity(
                torch.where(kept, inverse, 0).reshape(-1).to(torch.int32), kept * (nb * rows)
            )
        coded, exceptions = _coded_capacity(x, widths, bounds, counts, first, backend)
        if isinstance(mode, torch.Tensor):
            info[0] = mode | coders.FIXED << 2
        host_mode = mode if isinstance(mode, int) else dedup.NONE  # a device mode is written over it
        header = fmt.Header(
            self.codec_id, x.dtype, rows, x.shape[1], widths, bounds, info=[host_mode | coders.FIXED << 2, 0, 0, 0]
        )
        sections: list[list[tuple[torch.Tensor, fmt.Length]]] = [[(counts, 8 * nb)], index, coded, exceptions]
        return fmt.pack_deferred(header, sections, x.device, info)

    def decoded(self, x: torch.Tensor, eb: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
        """What :meth:`decode` returns for :meth:`encode`'s payload of ``x`` under the per-block
        bounds ``eb`` (rows sharing an id bit-identical), from the quantiser alone: the payload
        is neither built nor read, so a sender knows what its peer decodes with no host wait."""
        check_input(x)
        rows, cols = x.shape
        widths = list(blocks)
        bounds = device_bounds(eb, widths, x.device)
        ones = torch.ones(len(widths), dtype=torch.int64, device=x.device)
        step, ed = quantize.steps_and_margins(bounds, ones, widths, cols, x.device)  # per column
        if step.dim():
            step, ed = step.expand(rows, cols).reshape(-1), ed.expand(rows, cols).reshape(-1)
        backend = _backend(self.backend, x.device)
        return quantize.roundtrip(x.reshape(-1), step, ed, backend).view(rows, cols)

    @staticmethod
    def head_size(n_blocks: int) -> int:
        """Bytes a decoder needs on the host: the header and the dedup counts after it."""
        return fmt.head_bytes(n_blocks, 4, 8 * n_blocks)

    def prepare_decode(self, payload: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor | None, object]:
        """The device values :meth:`decode` reads on the host besides the payload's head (what
        the receiver's ``ids`` give: unique counts per block and fingerprint), computed ahead so
        that a collective reads them with every payload's head at once
        (:func:`~compression.format.read_heads`); and the device tensors that go with them."""
        if ids is None or ids.dim() != 2 or ids.shape[0] == 0:
            return None, None
        keys = ids.to(payload.device)
        mine, inverse = dedup.inverse_from_ids(keys)
        return torch.cat([mine, fingerprint_of(keys).reshape(1)]), (mine, inverse)

    def decode(
        self,
        payload: torch.Tensor,
        ids: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        head: fmt.HostHead | None = None,
    ) -> torch.Tensor:
        """Rebuild the tensor (into ``out`` if given); payloads encoded with ids need the same ids.
        ``head``: the payload's head and :meth:`prepare_decode`'s values, read already: with the
        fixed-length coder, nothing then waits for the device."""
        header, sections = self._header(payload, head)
        check_out(out, header, payload.device)
        if len(sections) != 4:
            raise PayloadError(f"lossy payload has {len(sections)} sections, expected 4")
        counts_s, index_s, codes_s, exc_s = sections
        mode, kind = header.info[0] & 3, header.info[0] >> 2
        if mode not in (dedup.NONE, dedup.IDS, dedup.VALUE) or kind not in (coders.FIXED, coders.ZSTD):
            raise PayloadError(f"unknown stage choice word {header.info[0]:#x}")
        rows, widths, nb = header.rows, header.widths, len(header.widths)
        device = payload.device
        backend = _backend(self.backend, device)
        coder = self._coder(kind, backend)
        counts = fmt.view_as(counts_s, torch.int64, "dedup counts").clone()
        if counts.numel() != nb:
            raise PayloadError(f"{counts.numel()} dedup counts for {nb} blocks")
        read = None if head is None else head.section(header, 0, 8 * nb)  # the counts, read with the head
        inverse: torch.Tensor | None = None
        if mode == dedup.IDS:
            if ids is None:
                raise PayloadError("payload was encoded with ids and carries no row index: pass the same ids to decode")
            keys = check_ids(ids, rows, nb, "lossy decode").to(device)
            if read is not None and head is not None and head.state is not None and len(head.extra) == nb + 1:
                host = [*struct.unpack(f"<{nb}q", read), *head.extra]
                inverse = head.state[1]
            else:
                mine, inverse = dedup.inverse_from_ids(keys)
                # one host read: the payload's counts (the sizes), and the counts and fingerprint of these ids
                host = torch.cat([counts, mine, fingerprint_of(keys).reshape(1)]).tolist()
            host_counts = host[:nb]
        else:
            host_counts = list(struct.unpack(f"<{nb}q", read)) if read is not None else counts.tolist()
        if nb and (min(host_counts) < min(rows, 1) or max(host_counts) > rows):
            raise PayloadError(f"dedup counts {host_counts[:8]} invalid for {nb} blocks of {rows} rows")
        if mode == dedup.IDS:
            if host[2 * nb] != header.info[1]:
                raise PayloadError("ids differ from the ids the payload was encoded with")
            if host[nb : 2 * nb] != host_counts:
                raise PayloadError("ids give other unique counts than the payload's")
        checked = head is not None and kind == coders.FIXED  # the check passed on the device: read nothing back
        if mode == dedup.VALUE:
            inverse = coder.decode(index_s, nb * rows, "dedup index", checked).long().view(nb, rows)
            if checked:  # only an encoder bug (or a forged check) could point past: keep reads inside
                inverse = torch.minimum(inverse, counts[:, None] - 1)
            elif nb and rows and bool((inverse >= counts[:, None]).any()):
                raise PayloadError("dedup index points past its block's unique rows")
        elif mode == dedup.NONE and any(u != rows for u in host_counts):
            raise PayloadError(f"undeduplicated payload with counts {host_counts[:8]} != {rows}")
        n = sum(u * w for u, w in zip(host_counts, widths, strict=True))
        codes = coder.decode(codes_s, n, "codes", checked)
        step, _ = quantize.steps_and_margins(header.bounds, counts, widths, n, device)
        values = quantize.decode(codes, step, exc_s, header.dtype, "exceptions", backend, checked)
        return dedup.scatter(values, widths, counts.to(device), inverse, rows, out, host_counts)


def _coded_capacity(
    x: torch.Tensor,
    widths: list[int],
    bounds: list[float] | torch.Tensor,
    counts: torch.Tensor,
    first: torch.Tensor,
    backend,
) -> tuple[list[tuple[torch.Tensor, fmt.Length]], list[tuple[torch.Tensor, fmt.Length]]]:
    """The coded codes and the exceptions of each block's first ``counts`` rows ``first``, at
    capacity (:meth:`LossyCodec._encode_deferred`'s); a function of its own so that the
    per-value temporaries (gathered values, steps, codes) are freed before the payload is framed."""
    rows = x.shape[0]
    values = dedup.gather_capacity(x, widths, first)
    valid = dedup.valid_capacity(counts, widths, rows)
    full = torch.full((len(widths),), rows, dtype=torch.int64, device=x.device)
    step, ed = quantize.steps_and_margins(bounds, full, widths, values.numel(), x.device)
    codes, exceptions = quantize.encode_capacity(values, valid, step, ed, backend)
    return coders.BlockCoder(backend).encode_capacity(codes, valid.sum()), exceptions
