"""The error-bounded codec: dedup -> quantise (bin 2 eb, verified) -> fixed-length or entropy coder.

Sections, one per stage: counts (dedup, int64 per block) | index (dedup, value mode only) |
codes (coder) | exceptions (quantiser). The header's codec info records the stage choices:
word 0 = dedup mode | coder << 2, word 1 = fingerprint of the ids in id mode.
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Sequence

import torch

from . import coders, dedup, ops, quantize, reference
from . import format as fmt
from .backend import upload
from .base import (
    NO_CONTEXT,
    Bound,
    Codec,
    CodecContext,
    Unpacked,
    block_bounds,
    by_width,
    check_ids,
    check_input,
    device_bounds,
    register,
)
from .format import PayloadError

Entropy = bool | str


def ids_fingerprint(ids: torch.Tensor) -> int:
    """32-bit weighted sum of the ids [rows, n_blocks]: catches a receiver passing other ids.

    Weights are odd, so changing any single id changes the sum; one id column shared by every
    block (a [rows] id tensor) is summed once.
    """
    return int(fingerprint_of(ids))


def fingerprint_of(ids: torch.Tensor) -> torch.Tensor:
    """:func:`ids_fingerprint` as an int64 0-d tensor on the ids' device (no host wait): the one
    their plan made, where :func:`compression.dedup.id_plan` made one."""
    plan = getattr(ids, dedup._ID_PLAN, None)
    return plan.fingerprint if plan is not None else reference.fingerprint(ids)


def _kernels(name: str, device: torch.device):
    """The module with quantize/dequantize/block_pack/block_unpack for this device."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return reference
    if name in ("triton", "auto"):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "kernels='triton' on CPU tensors runs only in Triton's interpreter: "
                "set TRITON_INTERPRET=1 before triton is imported"
            )
        from . import kernels  # imports triton; only needed on this path

        return kernels
    raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {name!r}")


@register
class LossyCodec(Codec):
    """Error-bounded: ``|decode(encode(x, eb)) - x| <= eb`` for every element, always.

    Parameters: ``entropy`` True (byte planes + zstd, near entropy), False (cuSZp-style
    fixed-length blocks, the GPU fast path) or "auto" (zstd for CPU tensors, blocks on a device);
    ``level``: zstd level; ``dedup``: deduplicate bit-identical rows when no ids are given;
    ``kernels``: "auto" (Triton kernels on CUDA, torch reference on CPU), "torch" or "triton"
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
        kernels: str = "auto",
        verify_ids: bool = False,
    ):
        if entropy not in (True, False, "auto"):
            raise ValueError(f"entropy must be True, False or 'auto', got {entropy!r}")
        if kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {kernels!r}")
        self.entropy, self.level, self.dedup, self.kernels = entropy, level, dedup, kernels
        self.verify_ids = verify_ids
        self._zstd = coders.ZstdCoder(level)

    def _coder(self, kind: int, backend) -> coders.Coder:
        return self._zstd if kind == coders.ZSTD else coders.BlockCoder(backend)

    def _encode_deferred(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor | fmt.Deferred | None:
        """Where the payload is built on the device (:meth:`defers`), :meth:`encode`'s bytes made
        without a host wait. ``context.single``: a 0-d bool on the device saying whether ``ids``
        hold (else the payload is ``encode(x, eb)``'s), for a caller that has not read it yet.
        ``context.summed`` (with ids that hold, where it defers): each id's rows sent as their
        sum, summed in row order (a gradient's: the payload of ``encode`` of x with each row
        replaced by its id's sum)."""
        single, summed = context.single, context.summed
        if summed and not (ids is not None and single is None and self.defers(x.device)):
            raise ValueError("lossy encode_deferred: summed needs ids that hold, on a backend that defers")
        if not (self.defers(x.device) and x.numel() < 2**31):
            return None
        bounds = self._bounds(x, eb, ids, widths)
        backend = _kernels(self.kernels, x.device)
        return self._build_deferred(x, widths, bounds, ids, backend, single if ids is not None else None, summed)

    def chooses_ids_on_device(self, device: torch.device) -> bool:
        return self.defers(device)

    def sums_duplicates(self, device: torch.device) -> bool:
        return self.defers(device)

    def defers(self, device: torch.device) -> bool:
        """Whether :meth:`encode_deferred` builds payloads on ``device`` without a host wait: the
        fixed-length coder there, the device backend (lengths left there), ids taken on trust."""
        return self._kind(device) == coders.FIXED and not self.backend_for(device).reads_sizes and not self.verify_ids

    def _kind(self, device: torch.device) -> int:
        """The coder payloads built on ``device`` take: entropy=auto is zstd on the host backend
        (the CPU's), the fixed-length coder on the device's (zstd would copy it to the host)."""
        on_host = self.backend_for(device).on_host
        return coders.ZSTD if self.entropy is True or (self.entropy == "auto" and on_host) else coders.FIXED

    def _bounds(
        self, x: torch.Tensor, eb: Bound | None, ids: torch.Tensor | None, widths: list[int]
    ) -> list[float] | torch.Tensor:
        """Each block's bound (:func:`~compression.base.block_bounds`), the ids on ``x``'s device."""
        bounds = block_bounds(eb, widths, x.device, self.backend_for(x.device))
        if ids is not None and ids.device != x.device:
            raise ValueError(f"lossy encode: ids on {ids.device}, x on {x.device}")
        return bounds

    def _encode(
        self, x: torch.Tensor, widths: list[int], eb: Bound | None, ids: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Compress ``x`` under absolute bound(s) ``eb``; see the package docstring."""
        rows, cols = x.shape
        b = self.backend_for(x.device)
        bounds = self._bounds(x, eb, ids, widths)
        backend = _kernels(self.kernels, x.device)
        kind = self._kind(x.device)
        coder = self._coder(kind, backend)

        if ids is not None:
            plan = dedup.plan_by_ids(ids, numpy=b.numpy_sorts)
            assert plan.inverse is not None  # an id plan always has its inverse
            if self.verify_ids:
                bad = dedup.mismatched_blocks(x, widths, plan.counts, plan.first, plan.inverse, b.numpy_sorts)
                if bad.any():
                    raise ValueError(
                        f"lossy encode: rows sharing an id differ in block(s) "
                        f"{bad.nonzero().view(-1).tolist()}: ids must identify rows"
                    )
        elif self.dedup and rows > 1:
            plan = dedup.plan_by_value(x, widths, numpy=b.numpy_sorts)
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
        fingerprint = None if ids is None else {1: fingerprint_of(ids)}
        return fmt.pack(header, sections, device=x.device, device_info=fingerprint, backend=b)

    def _build_deferred(
        self,
        x: torch.Tensor,
        widths: list[int],
        bounds: list[float] | torch.Tensor,
        keys: torch.Tensor | None,
        backend,
        single: torch.Tensor | None,
        summed: bool = False,
    ) -> fmt.Deferred:
        """:meth:`encode`'s payload, the same bytes, built with every size on the device: the plan
        (each block's unique rows, at capacity), then one op for the codes and exceptions
        (:func:`compression.ops.lossy_pack`), framed by the device. ``single``: see
        :meth:`encode_deferred` (both plans made, the device picks one); ``summed``: each id's
        rows summed (a gradient's), with ``keys``."""
        rows, nb = x.shape[0], len(widths)
        index: list[tuple[torch.Tensor, fmt.Length]] = [(x.new_empty(0, dtype=torch.uint8), 0)]
        info: dict[int, torch.Tensor] = {}  # header words written by the device
        mode: int | torch.Tensor = dedup.NONE
        if keys is not None:
            mode = dedup.IDS
            counts, first, inverse, info[1] = dedup.id_plan(keys)
            if summed:
                first = inverse  # lossy_pack sums each id's rows into its unique row
        else:  # every row of every block (value dedup replaces them below)
            full = torch.full((nb,), rows, dtype=torch.int64, device=x.device)
            every = torch.arange(rows, device=x.device).expand(nb, rows)
            counts, first = full, every
        if (keys is None and self.dedup and rows > 1) or single is not None:
            if keys is not None:  # (else made above)
                full = torch.full((nb,), rows, dtype=torch.int64, device=x.device)
                every = torch.arange(rows, device=x.device).expand(nb, rows)
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
        if isinstance(bounds, torch.Tensor):
            on = bounds.to(x.device, torch.float64, non_blocking=True)
        else:  # host floats (abs mode): up with one copy
            on = upload(torch.tensor(bounds, dtype=torch.float64), x.device)
        group_widths, words, positions, raw, lengths = ops.lossy_pack(x, first, counts, on, widths, summed)
        coded = [(group_widths, lengths[0]), (words.view(torch.uint8), lengths[1])]
        exceptions = [(positions.view(torch.uint8), lengths[2]), (raw.view(torch.uint8), lengths[3])]
        if isinstance(mode, torch.Tensor):
            info[0] = mode | coders.FIXED << 2
        host_mode = mode if isinstance(mode, int) else dedup.NONE  # a device mode is written over it
        header = fmt.Header(
            self.codec_id, x.dtype, rows, x.shape[1], widths, bounds, info=[host_mode | coders.FIXED << 2, 0, 0, 0]
        )
        sections: list[list[tuple[torch.Tensor, fmt.Length]]] = [[(counts, 8 * nb)], index, coded, exceptions]
        return fmt.pack_deferred(header, sections, x.device, info)

    def block_bytes(
        self, payload: torch.Tensor, blocks: Sequence[int], head: fmt.HostHead | None = None
    ) -> torch.Tensor:
        """Each block's share of ``payload`` (:meth:`Codec.block_bytes`): the coded groups that
        start among its values (codes, and in value mode its rows' index), its exceptions, and
        of the rest (header, dedup counts, padding) a part in proportion to its width; a zstd
        frame split as the fixed-length coder would size each block's codes
        (:meth:`~compression.coders.ZstdCoder.shares`). Read from the section lengths and the
        dedup counts (in ``head`` where read already), then on the device, one op per step."""
        header, sections = self._header(payload, head)
        if len(sections) != 4:
            raise PayloadError(f"lossy payload has {len(sections)} sections, expected 4")
        counts_s, index_s, codes_s, exc_s = sections
        rows, widths, nb, device = header.rows, header.widths, len(header.widths), payload.device
        read = None if head is None else head.section(header, 0, 8 * nb)
        if read is not None:
            counts = list(struct.unpack(f"<{nb}q", read))
        else:  # (a host read, where no head was read with the collective's)
            counts = fmt.view_as(counts_s, torch.int64, "dedup counts").tolist()
        values = [u * w for u, w in zip(counts, widths, strict=True)]
        n = sum(values)
        coder = self._coder(header.info[0] >> 2, _kernels(self.kernels, device))
        ends = upload(torch.tensor(list(itertools.accumulate(values)), dtype=torch.int64), device)
        own = coder.shares(codes_s, n, ends) + quantize.exception_shares(exc_s, header.dtype, n, ends)
        if header.info[0] & 3 == dedup.VALUE:  # the index: each block's rows, one after another
            rows_end = upload(torch.arange(1, nb + 1, dtype=torch.int64) * rows, device)
            own = own + coder.shares(index_s, nb * rows, rows_end)
        return own + by_width(payload.numel() - own.sum(), widths, device)

    def decoded(self, x: torch.Tensor, eb: torch.Tensor, blocks: Sequence[int], checked: bool = False) -> torch.Tensor:
        """What :meth:`decode` returns for :meth:`encode`'s payload of ``x`` under the per-block
        bounds ``eb`` (rows sharing an id bit-identical), from the quantiser alone: the payload
        is neither built nor read, so a sender knows what its peer decodes with no host wait
        (float32: one op, :func:`compression.ops.lossy_roundtrip`). ``checked``: ``eb`` is one
        float64 bound per block on ``x``'s device that an encode of ``x`` checks already."""
        check_input(x)
        rows, cols = x.shape
        widths = list(blocks)
        trusted = checked and eb.dtype == torch.float64 and eb.device == x.device and eb.shape == (len(widths),)
        bounds = eb if trusted else device_bounds(eb, widths, x.device)
        if x.dtype == torch.float32:
            return ops.lossy_roundtrip(x, bounds, widths)
        ones = torch.ones(len(widths), dtype=torch.int64, device=x.device)
        step, ed = quantize.steps_and_margins(bounds, ones, widths, cols, x.device)  # per column
        if step.dim():
            step, ed = step.expand(rows, cols).reshape(-1), ed.expand(rows, cols).reshape(-1)
        backend = _kernels(self.kernels, x.device)
        return quantize.roundtrip(x.reshape(-1), step, ed, backend).view(rows, cols)

    def head_size(self, n_blocks: int) -> int:
        """Bytes a decoder needs on the host: the header and the dedup counts after it."""
        return fmt.head_bytes(n_blocks, 4, 8 * n_blocks)

    def prepare_decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None, context: CodecContext = NO_CONTEXT
    ) -> tuple[torch.Tensor | None, object] | None:
        """The device values :meth:`decode` reads on the host besides the payload's head (what
        the receiver's ``ids`` give: unique counts per block and fingerprint), computed ahead so
        that a collective reads them with every payload's head at once
        (:func:`~compression.format.read_heads`); and the device tensors that go with them. The
        host backend reads for itself (None)."""
        if self.backend_for(payload.device).reads_sizes:
            return None
        if ids is None or ids.dim() != 2 or ids.shape[0] == 0:
            return None, None
        keys = ids.to(payload.device)
        mine, first, inverse, fingerprint = dedup.id_plan(keys)  # (the sender's plan of these ids, if it made one)
        return torch.cat([mine, fingerprint.reshape(1)]), (mine, inverse, first)

    def _decode(
        self, payload: Unpacked, ids: torch.Tensor | None, out: torch.Tensor | None, context: CodecContext
    ) -> torch.Tensor:
        """Rebuild the tensor (into ``out`` if given); payloads encoded with ids need the same ids.
        With the payload's head and :meth:`prepare_decode`'s values read already and the
        fixed-length coder, nothing waits for the device (one op decodes every block,
        :func:`compression.ops.lossy_unpack`); so too with ids whose plan the host knows
        (:func:`compression.dedup.host_position_ids`) and the payload's head alone.
        ``context.keep_first`` (with ids): each id's value on its first row only, zeros on the
        others (a gradient summed by id: what the owner adds)."""
        keep_first = context.keep_first
        header, sections, head = payload.header, payload.sections, payload.head
        if len(sections) != 4:
            raise PayloadError(f"lossy payload has {len(sections)} sections, expected 4")
        counts_s, index_s, codes_s, exc_s = sections
        mode, kind = header.info[0] & 3, header.info[0] >> 2
        if mode not in (dedup.NONE, dedup.IDS, dedup.VALUE) or kind not in (coders.FIXED, coders.ZSTD):
            raise PayloadError(f"unknown stage choice word {header.info[0]:#x}")
        rows, widths, nb, device = header.rows, header.widths, len(header.widths), payload.device
        backend = _kernels(self.kernels, device)
        coder = self._coder(kind, backend)
        counts = fmt.view_as(counts_s, torch.int64, "dedup counts")
        if counts.numel() != nb:
            raise PayloadError(f"{counts.numel()} dedup counts for {nb} blocks")
        read = None if head is None else head.section(header, 0, 8 * nb)  # the counts, read with the head
        inverse: torch.Tensor | None = None
        first: torch.Tensor | None = None
        if keep_first and mode != dedup.IDS:
            raise ValueError("lossy decode: keep_first needs a payload encoded with ids")
        if mode == dedup.IDS:
            if ids is None:
                raise PayloadError("payload was encoded with ids and carries no row index: pass the same ids to decode")
            keys = check_ids(ids, rows, nb, "lossy decode").to(device)
            known = dedup.host_plan(keys)  # (ids whose plan the host knows: dedup.host_position_ids)
            if read is not None and known is not None:
                host = [*struct.unpack(f"<{nb}q", read), *known]
                _, first, inverse, _ = dedup.id_plan(keys)
            elif read is not None and head is not None and head.state is not None and len(head.extra) == nb + 1:
                host = [*struct.unpack(f"<{nb}q", read), *head.extra]
                inverse, first = head.state[1], head.state[2]
            else:  # (the host's numpy sorts where its backend takes them; each id's first row if asked)
                mine, inverse = dedup.inverse_from_ids(keys, numpy=self.backend_for(device).numpy_sorts)
                first = dedup.first_at_capacity(inverse) if keep_first else None
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
        if checked:  # one op: the codes unpacked, dequantised, patched and scattered to their rows
            return self._unpack(header, codes_s, exc_s, n, host_counts, inverse, first if keep_first else None, out)
        codes = coder.decode(codes_s, n, "codes", checked)
        step, _ = quantize.steps_and_margins(header.bounds, counts, widths, n, device)
        values = quantize.decode(codes, step, exc_s, header.dtype, "exceptions", backend, checked)
        result = dedup.scatter(values, widths, counts.clone(), inverse, rows, out, host_counts)
        if keep_first:
            assert first is not None and inverse is not None
            keep = first.gather(1, inverse) == torch.arange(rows, device=device)  # [n_blocks, rows]
            c = 0
            for k, w in enumerate(widths):  # (the host path: a CPU's loop of a few ops per table)
                result[:, c : c + w] = torch.where(keep[k, :, None], result[:, c : c + w], 0.0)
                c += w
        return result

    @staticmethod
    def _unpack(
        header: fmt.Header,
        codes_s: torch.Tensor,
        exc_s: torch.Tensor,
        n: int,
        counts: list[int],
        inverse: torch.Tensor | None,
        first: torch.Tensor | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """:meth:`decode` of a checked fixed-length payload by :func:`compression.ops.lossy_unpack`:
        its sections cut on the host (their lengths came with the head), nothing read back."""
        groups = -(-n // reference.GROUP)
        lead = groups + (-groups % 4)
        if codes_s.numel() < lead:
            raise PayloadError(f"codes: {codes_s.numel()} bytes cannot hold {groups} group widths")
        words = fmt.view_as(codes_s[lead:], torch.int32, "codes")
        item = 4 + header.dtype.itemsize
        if exc_s.numel() % item:
            raise PayloadError(f"exceptions: {exc_s.numel()} bytes is not a whole number of exceptions")
        k = exc_s.numel() // item
        positions = fmt.view_as(exc_s[: 4 * k], torch.int32, "exceptions")
        raw = fmt.view_as(exc_s[4 * k :], header.dtype, "exceptions")
        if out is None:
            out = torch.empty(header.rows, header.cols, dtype=header.dtype, device=codes_s.device)
        assert isinstance(header.bounds, list)  # (read from the payload)
        ops.lossy_unpack(
            codes_s[:groups], words, positions, raw, counts, header.bounds, header.widths, inverse, first, out
        )
        return out
