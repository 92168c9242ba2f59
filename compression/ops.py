"""The codec's device operations, each one dispatcher op: a torch reference for CPU tensors and
Triton kernels for CUDA ones (:mod:`compression.kernels`, imported on first CUDA use).

Why one op each: on a GPU every launch costs the host ~7 us, so a collective's codec work is a
budget of launches, and the launches of the dispatcher's ops can be counted on a CPU (at the
dispatcher, :class:`dlrm.telemetry.sync_counter.HostSyncCounter`). A fused operation hides its kernels
behind one op; :data:`LAUNCHES` says how many its CUDA implementation makes, which the counter
adds in its place (checked against the profiler by ``make test-gpu``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.library import custom_op

from . import reference

# op name -> kernel launches of its CUDA implementation (a number, or one from the op's arguments)
LAUNCHES: dict[str, int | Callable[..., int]] = {}


_RUNNING = contextvars.ContextVar("dlrm_compression_op_running", default=False)


def running() -> bool:
    """Whether a codec op's own CPU implementation is running: what it reads on the host stands
    for what its CUDA kernels do on the device, so host-read counts leave it out."""
    return _RUNNING.get()


def _cpu(fn: Callable) -> Callable:
    """An op's CPU implementation, marked as running (:func:`running`) while it runs."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        token = _RUNNING.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _RUNNING.reset(token)

    return run


def _kernels():
    from . import kernels  # imports triton: only where a CUDA tensor needs it

    return kernels


def _fused(
    cpu: Callable,
    launches: int | Callable[..., int],
    fake: Callable | None = None,
    mutates: tuple[str, ...] = (),
    *,
    name: str | None = None,
    cuda: Callable | None = None,
    kernels: Callable[[], Any] = _kernels,
):
    """One fused op ``dlrm_compression::<name>`` (``cpu``'s name by default), its schema from
    ``cpu``'s signature: ``cpu`` (a reference, :func:`_cpu`-marked) for CPU tensors, ``cuda`` (by
    default the function of the op's name in ``kernels()``, the Triton module) for CUDA ones,
    ``fake`` for meta tensors; its ``launches`` (:data:`LAUNCHES`)."""
    name = name or cpu.__name__
    op = custom_op(f"dlrm_compression::{name}", mutates_args=mutates)(_cpu(cpu))
    op.register_kernel("cuda")(cuda or (lambda *args: getattr(kernels(), name)(*args)))
    if fake is not None:
        op.register_fake(fake)
    LAUNCHES[name] = launches
    return op


# -- the payload check --------------------------------------------------------------------------


def _adler(name: str, mode: int, mutates: tuple[str, ...] = ()):
    """One Adler-32 op (:func:`reference.adler32`'s ``mode``) with its CUDA kernels."""

    def op(
        data: torch.Tensor, end: torch.Tensor | None, size: int, skip_at: int, skip_len: int, check_at: int
    ) -> torch.Tensor:
        return reference.adler32(data, end, size, skip_at, skip_len, check_at, mode)

    def fake(data, *rest):
        return data.new_empty((), dtype=torch.int64)

    return _fused(op, 2, fake, mutates, name=name, cuda=lambda *args: _kernels().adler32(*args, mode))


# Over ``data``'s first ``end`` bytes (an int64 0-d tensor on its device; None: ``size``) but the
# ``skip_len`` at ``skip_at``: the check's value, whether the u32 stored at ``check_at`` equals it
# (1/0), or the check written there (in place); an int64 0-d tensor on the device, no host wait.
adler32 = _adler("adler32", reference.ADLER_VALUE)
adler32_holds = _adler("adler32_holds", reference.ADLER_HOLDS)
adler32_seal_ = _adler("adler32_seal_", reference.ADLER_SEAL, ("data",))


# -- framing: a payload from pieces whose lengths are on the device -------------------------------


def _frame_fake(head, patches, patch_at, pieces, lengths, host_lengths, section_of, n_sections, align, *rest):
    capacity = head.numel() + sum(p.numel() for p in pieces) + align * n_sections
    device = pieces[0].device if pieces else head.device
    return torch.empty(capacity, dtype=torch.uint8, device=device), torch.empty((), dtype=torch.int64, device=device)


# :func:`reference.frame`: (the payload at the front of a buffer on the pieces' device, its length),
# no host wait; ``head`` (the host's header bytes) may be a CPU tensor. Its launches: device lengths
# stacked, the sources joined, the host's table up, layout, copy.
frame = _fused(reference.frame, 5, _frame_fake)


# -- the lossy codec's device path --------------------------------------------------------------


def _lossy_pack_fake(x, *rest):
    n = x.numel()
    groups = -(-n // 32)
    return (
        x.new_empty(groups + 4, dtype=torch.uint8),
        x.new_empty(32 * groups, dtype=torch.int32),
        x.new_empty(n, dtype=torch.int32),
        x.new_empty(n),
        x.new_empty(4, dtype=torch.int64),
    )


# :func:`reference.lossy_pack`: a chunk's codes and exceptions at capacity, their lengths on the
# device. Its launches: the block table up, block offsets and steps, group widths and misses, their
# scan, pack and exceptions; summed: also a table up, zeros, the index per column and the scatter
# that sums.
lossy_pack = _fused(
    reference.lossy_pack, lambda x, src, counts, bounds, widths, summed: 5 + 4 * summed, _lossy_pack_fake
)

# :func:`reference.lossy_unpack`: a payload's codes and exceptions into ``out``. Its launches: the
# host's tables up, word offsets, unpack and dequantise, exceptions, rows.
lossy_unpack = _fused(reference.lossy_unpack, 5, mutates=("out",))

# :func:`reference.lossy_roundtrip`: what the lossy codec's decode returns for float32 ``x`` coded
# under per-block ``bounds`` (float64, on its device), no payload made. Its launches: the block
# table up, the blocks' steps, every value.
lossy_roundtrip = _fused(reference.lossy_roundtrip, 3, lambda x, *rest: torch.empty_like(x))


# -- relative error bounds ----------------------------------------------------------------------


def _relative_bounds_fake(x, rel, widths):
    return x.new_empty(len(widths), dtype=torch.float64)


# :func:`reference.relative_bounds`: float64 bounds per block, on ``x``'s device. Its launches: the
# block table up, partial ranges, one program per block.
relative_bounds = _fused(reference.relative_bounds, 3, _relative_bounds_fake)


# -- dedup by id ----------------------------------------------------------------------------------


def _id_runs_fake(sorted_ids, perm, keys):
    n, rows = sorted_ids.shape
    return (
        keys.new_empty(n, dtype=torch.int64),
        keys.new_empty(n, rows, dtype=torch.int64),
        keys.new_empty(n, rows, dtype=torch.int64),
        keys.new_empty((), dtype=torch.int64),
    )


# :func:`reference.id_runs`: the plan of a block's sorted ids and the ids' fingerprint. Its
# launches: the accumulator zeroed, one program per row of sorted ids.
id_runs = _fused(reference.id_runs, 2, _id_runs_fake)


# -- the casts (none, fp16, bf16): values, header and check in one pass -----------------------------


def _cast_pack_fake(x, head, wire, *rest):
    item = (reference.WIRE_DTYPES[wire] or x.dtype).itemsize
    total = head.numel() + x.numel() * item
    return x.new_empty(total + (-total % 8), dtype=torch.uint8)


def _verdict_fake(payload, *rest):
    return payload.new_empty(2, dtype=torch.int64)


# :func:`reference.cast_pack`: a cast codec's payload, its check written, no host wait. Its
# launches: values, header and sums; the check finished and written.
cast_pack = _fused(reference.cast_pack, 2, _cast_pack_fake)

# :func:`reference.cast_unpack`: the values into ``out`` and the payload's verdict (int64 [2], on
# the device: its check holds, its header is the expected one). Its launches: values, sums and the
# header's verdict; the check's verdict.
cast_unpack = _fused(reference.cast_unpack, 2, _verdict_fake, ("out",))


# the casts with duplicate ids (a gradient's, backward dedup): each id's rows summed as they are cast,
# each id's value kept on its first row as it is decoded; ``sorted_ids``/``perm``: the ids sorted
# stably along the rows (compression.dedup.id_sort, one op before)

# :func:`reference.cast_pack_summed`: :func:`cast_pack`'s payload of x with each row the sum of its
# block's rows of the same id (summed in row order), no host wait. One kernel: every id's sum, cast
# and written to its rows, the header and the sums, the check finished and written by its last
# program (the block table and launch counter go up once per widths, device and stream, like the
# headers).
cast_pack_summed = _fused(reference.cast_pack_summed, 1, _cast_pack_fake)

# :func:`reference.cast_unpack_first`: :func:`cast_unpack` with each id's value on its block's first
# row of the id alone (zeros on the others), and the verdict. Its launch: values (first rows), sums,
# the header's and (its last program) the check's verdicts.
cast_unpack_first = _fused(reference.cast_unpack_first, 1, _verdict_fake, ("out",))


# -- the ids codec: bit streams, and every payload of a collective checked at once ------------------


def _bits_pack_fake(values, starts, n_words):
    return values.new_empty(n_words, dtype=torch.int64)


def _bits_unpack_fake(words, starts, widths):
    return starts.new_empty(starts.numel(), dtype=torch.int64)


# :func:`reference.bits_pack`: int64 values (each within its field) at their bit starts, in
# ``n_words`` int64 words. Its launches: the words zeroed; one program per 1,024 values, two atomic
# ORs each.
bits_pack = _fused(reference.bits_pack, 2, _bits_pack_fake)

# :func:`reference.bits_unpack`: the field of each bit start and width, int64. Its launch: one
# program per 1,024 values.
bits_unpack = _fused(reference.bits_unpack, 1, _bits_unpack_fake)


def _adler_segments(name: str, mode: int, mutates: tuple[str, ...] = ()):
    """:func:`_adler`'s op over several segments of one buffer (each its own payload), every one
    in the same launches."""

    def op(
        data: torch.Tensor, starts: list[int], sizes: list[int], skip_at: int, skip_len: int, check_at: int
    ) -> torch.Tensor:
        return reference.adler32_segments(data, starts, sizes, skip_at, skip_len, check_at, mode)

    def fake(data, starts, *rest):
        return data.new_empty(len(starts), dtype=torch.int64)

    # the segments' table up, per-block sums of every segment, one program per segment to finish
    launches = lambda data, starts, *rest: 3 if starts else 0  # noqa: E731
    return _fused(op, launches, fake, mutates, name=name, cuda=lambda *a: _kernels().adler32_segments(*a, mode))


# Each segment ``data[starts[s] : starts[s] + sizes[s]]``'s check but the ``skip_len`` bytes at its
# ``skip_at``: whether the u32 at its ``check_at`` equals it (1/0), or written there (in place),
# int64 [segments] on the device, no host wait.
adler32_segments_holds = _adler_segments("adler32_segments_holds", reference.ADLER_HOLDS)
adler32_segments_seal_ = _adler_segments("adler32_segments_seal_", reference.ADLER_SEAL, ("data",))
