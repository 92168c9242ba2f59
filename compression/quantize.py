"""Quantisation stage: float32 values -> zig-zag codes + a raw-exception section, and back.

The exception section is the positions of the values whose verified reconstruction missed the
bound (NaN, Inf, huge values, float rounding), then their exact bits in the input dtype:
int32 positions (int64 when there are 2**31 values or more) | raw values, same count.
"""

from __future__ import annotations

import torch

from . import reference
from .format import PayloadError, view_as


def steps_and_margins(
    bounds: list[float] | torch.Tensor, counts: torch.Tensor, widths: list[int], n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-value (or one shared) float32 bin width ``2 eb`` and strict margin ``ed`` (<= eb).

    ``bounds`` per block, Python floats or a float64 tensor on ``device`` (kept there); the
    values are ``counts`` (rows per block, int64 on ``device``) x ``widths``, ``n`` in all, known
    on the host from the values' shape, so that nothing here waits for the device.
    """
    if isinstance(bounds, torch.Tensor):
        step = (2.0 * bounds).float()  # the same roundings as reference.step_of / float32_at_most
        e = bounds.float()
        ed = torch.where(e.double() > bounds, torch.nextafter(e, torch.full_like(e, -torch.inf)), e)
        if bounds.numel() == 1:
            return step.reshape(()), ed.reshape(())
    else:
        steps = [reference.step_of(e) for e in bounds]
        eds = [reference.float32_at_most(e) for e in bounds]
        if len(set(zip(steps, eds, strict=True))) <= 1:  # one bound for the whole payload: broadcast a scalar
            steps, eds = [steps[0] if steps else 1.0], [eds[0] if eds else 0.0]
        # built on the host and sent up without waiting (torch.tensor(..., device=) would wait)
        step = torch.tensor(steps).to(device, non_blocking=True)
        ed = torch.tensor(eds).to(device, non_blocking=True)
        if len(steps) == 1:
            return step.reshape(()), ed.reshape(())
    sizes = counts * torch.tensor(widths, dtype=torch.int64).to(device, non_blocking=True)
    return torch.repeat_interleave(step, sizes, output_size=n), torch.repeat_interleave(ed, sizes, output_size=n)


def encode(
    values: torch.Tensor, step: torch.Tensor, ed: torch.Tensor, backend=reference
) -> tuple[torch.Tensor, torch.Tensor]:
    """(zig-zag codes, exception section) of ``values`` (float32, float16 or bfloat16).

    The bound is verified on what the decoder returns: float32 ``q * step`` cast to the input
    dtype; misses keep their input bits (torch's half -> float casts do not keep NaN payloads).
    """
    codes, miss = backend.quantize(values.float(), step, ed, values.dtype)
    pos = miss.nonzero().view(-1)
    pos = pos.to(torch.int32) if values.numel() < 2**31 else pos
    section = torch.cat([pos.view(torch.uint8), values[pos].view(torch.uint8)])
    return codes, section


def encode_capacity(
    values: torch.Tensor, valid: torch.Tensor, step: torch.Tensor, ed: torch.Tensor, backend=reference
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | int]]]:
    """:func:`encode` of the ``valid`` values, kept where they are (the rest is capacity), with no
    host wait: the codes of the valid values moved to the front (zeros after), and the exception
    section as pieces with their lengths on the device. Same codes and section bytes as
    :func:`encode` of ``values[valid]``."""
    n = values.numel()
    codes, miss = backend.quantize(values.float(), step, ed, values.dtype)
    miss &= valid
    dest = torch.where(valid, valid.cumsum(0) - 1, n)  # each valid value's place among them; the rest: a spare slot
    packed = torch.zeros(n + 1, dtype=torch.int32, device=values.device).scatter_(0, dest, codes)[:n]
    slot = torch.where(miss, miss.cumsum(0) - 1, n)
    pos = torch.zeros(n + 1, dtype=torch.int32, device=values.device).scatter_(0, slot, dest.to(torch.int32))[:n]
    bits = values.view(torch.int32 if values.element_size() == 4 else torch.int16)  # NaN payloads kept
    raw = bits.new_zeros(n + 1).scatter_(0, slot, bits)[:n]
    k = miss.sum()
    return packed, [(pos.view(torch.uint8), 4 * k), (raw.view(torch.uint8), values.element_size() * k)]


def roundtrip(values: torch.Tensor, step: torch.Tensor, ed: torch.Tensor, backend=reference) -> torch.Tensor:
    """What :func:`decode` returns for :func:`encode`'s codes and exceptions of the flat
    ``values`` (``step``/``ed`` one or one per value), computed without them: no host wait."""
    codes, miss = backend.quantize(values.float(), step, ed, values.dtype)
    out = backend.dequantize(codes, step)
    return torch.where(miss, values, out.to(values.dtype))  # misses keep their bits, as decode restores them


def decode(
    codes: torch.Tensor,
    step: torch.Tensor,
    section: torch.Tensor,
    dtype: torch.dtype,
    what: str,
    backend=reference,
    checked: bool = False,
) -> torch.Tensor:
    """Values in ``dtype`` from codes, with the exceptions restored bit for bit; ``checked``: the
    payload's check passed already, so positions are clamped instead of read back (no host wait)."""
    n = codes.numel()
    pos_dtype, pos_size = (torch.int32, 4) if n < 2**31 else (torch.int64, 8)
    item = pos_size + dtype.itemsize
    if section.numel() % item:
        raise PayloadError(f"{what}: {section.numel()} bytes is not a whole number of exceptions")
    k = section.numel() // item
    pos = view_as(section[: k * pos_size], pos_dtype, what).long()
    raw = view_as(section[k * pos_size :], dtype, what)
    if checked:  # only an encoder bug (or a forged check) could put one outside: keep writes inside
        if n == 0:
            pos, raw = pos[:0], raw[:0]
        pos = pos.clamp(0, max(n - 1, 0))
    elif k and (int(pos.min()) < 0 or int(pos.max()) >= n):
        raise PayloadError(f"{what}: exception position outside [0, {n})")
    out = backend.dequantize(codes, step)
    if dtype != torch.float32:
        out = out.to(dtype)
    out[pos] = raw
    return out


def exception_shares(section: torch.Tensor, dtype: torch.dtype, n: int, ends: torch.Tensor) -> torch.Tensor:
    """The bytes of an exception section (of ``n`` values in ``dtype``) that belong to each
    segment of the values (segment ``b`` ends before value ``ends[b]``, int64 on the device):
    each exception's position and raw value, in the segment of its position (float64, no loop)."""
    pos_dtype, pos_size = (torch.int32, 4) if n < 2**31 else (torch.int64, 8)
    item = pos_size + dtype.itemsize
    k = section.numel() // item
    pos = view_as(section[: k * pos_size], pos_dtype, "exceptions").long()
    segment = torch.bucketize(pos, ends, right=True).clamp_(max=max(ends.numel() - 1, 0))
    out = torch.zeros(ends.numel(), dtype=torch.float64, device=section.device)
    return out.index_add_(0, segment, torch.full((k,), float(item), dtype=torch.float64, device=section.device))
