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


# -- the payload check --------------------------------------------------------------------------


def _adler(name: str, mode: int, mutates: tuple[str, ...] = ()):
    """One Adler-32 op (:func:`reference.adler32`'s ``mode``) with its CUDA kernels."""

    @custom_op(f"dlrm_compression::{name}", mutates_args=mutates)
    @_cpu
    def op(
        data: torch.Tensor, end: torch.Tensor | None, size: int, skip_at: int, skip_len: int, check_at: int
    ) -> torch.Tensor:
        return reference.adler32(data, end, size, skip_at, skip_len, check_at, mode)

    @op.register_kernel("cuda")
    def _(data, end, size, skip_at, skip_len, check_at):
        return _kernels().adler32(data, end, size, skip_at, skip_len, check_at, mode)

    @op.register_fake
    def _(data, end, size, skip_at, skip_len, check_at):
        return data.new_empty((), dtype=torch.int64)

    LAUNCHES[name] = 2
    return op


# Over ``data``'s first ``end`` bytes (an int64 0-d tensor on its device; None: ``size``) but the
# ``skip_len`` at ``skip_at``: the check's value, whether the u32 stored at ``check_at`` equals it
# (1/0), or the check written there (in place); an int64 0-d tensor on the device, no host wait.
adler32 = _adler("adler32", reference.ADLER_VALUE)
adler32_holds = _adler("adler32_holds", reference.ADLER_HOLDS)
adler32_seal_ = _adler("adler32_seal_", reference.ADLER_SEAL, ("data",))


# -- framing: a payload from pieces whose lengths are on the device -------------------------------


@custom_op("dlrm_compression::frame", mutates_args=())
@_cpu
def frame(
    head: torch.Tensor,
    patches: list[torch.Tensor],
    patch_at: list[int],
    pieces: list[torch.Tensor],
    lengths: list[torch.Tensor],
    host_lengths: list[int],
    section_of: list[int],
    n_sections: int,
    align: int,
    lengths_at: int,
    total_at: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.frame`: (the payload at the front of a buffer on the pieces' device, its
    length), no host wait; ``head`` (the host's header bytes) may be a CPU tensor."""
    args = (head, patches, patch_at, pieces, lengths, host_lengths, section_of, n_sections, align, lengths_at, total_at)
    return reference.frame(*args)


@frame.register_kernel("cuda")
def _(head, patches, patch_at, pieces, lengths, host_lengths, section_of, n_sections, align, lengths_at, total_at):
    args = (head, patches, patch_at, pieces, lengths, host_lengths, section_of, n_sections, align, lengths_at, total_at)
    return _kernels().frame(*args)


@frame.register_fake
def _(head, patches, patch_at, pieces, lengths, host_lengths, section_of, n_sections, align, lengths_at, total_at):
    capacity = head.numel() + sum(p.numel() for p in pieces) + align * n_sections
    device = pieces[0].device if pieces else head.device
    return torch.empty(capacity, dtype=torch.uint8, device=device), torch.empty((), dtype=torch.int64, device=device)


LAUNCHES["frame"] = 5  # device lengths stacked, the sources joined, the host's table up, layout, copy


# -- the lossy codec's device path --------------------------------------------------------------


@custom_op("dlrm_compression::lossy_pack", mutates_args=())
@_cpu
def lossy_pack(
    x: torch.Tensor, src: torch.Tensor, counts: torch.Tensor, bounds: torch.Tensor, widths: list[int], summed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`reference.lossy_pack`: a chunk's codes and exceptions at capacity, their lengths on
    the device."""
    return reference.lossy_pack(x, src, counts, bounds, widths, summed)


@lossy_pack.register_kernel("cuda")
def _(x, src, counts, bounds, widths, summed):
    return _kernels().lossy_pack(x, src, counts, bounds, widths, summed)


@lossy_pack.register_fake
def _(x, src, counts, bounds, widths, summed):
    n = x.numel()
    groups = -(-n // 32)
    return (
        x.new_empty(groups + 4, dtype=torch.uint8),
        x.new_empty(32 * groups, dtype=torch.int32),
        x.new_empty(n, dtype=torch.int32),
        x.new_empty(n),
        x.new_empty(4, dtype=torch.int64),
    )


# the block table up, block offsets and steps, group widths and misses, their scan, pack and
# exceptions; summed: also a table up, zeros, the index per column and the scatter that sums
LAUNCHES["lossy_pack"] = lambda x, src, counts, bounds, widths, summed: 5 + 4 * summed


@custom_op("dlrm_compression::lossy_unpack", mutates_args=("out",))
@_cpu
def lossy_unpack(
    group_widths: torch.Tensor,
    words: torch.Tensor,
    positions: torch.Tensor,
    raw: torch.Tensor,
    counts: list[int],
    bounds: list[float],
    widths: list[int],
    inverse: torch.Tensor | None,
    first: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """:func:`reference.lossy_unpack`: a payload's codes and exceptions into ``out``."""
    reference.lossy_unpack(group_widths, words, positions, raw, counts, bounds, widths, inverse, first, out)


@lossy_unpack.register_kernel("cuda")
def _(group_widths, words, positions, raw, counts, bounds, widths, inverse, first, out):
    _kernels().lossy_unpack(group_widths, words, positions, raw, counts, bounds, widths, inverse, first, out)


LAUNCHES["lossy_unpack"] = 5  # the host's tables up, word offsets, unpack and dequantise, exceptions, rows


@custom_op("dlrm_compression::lossy_roundtrip", mutates_args=())
@_cpu
def lossy_roundtrip(x: torch.Tensor, bounds: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """:func:`reference.lossy_roundtrip`: what the lossy codec's decode returns for float32 ``x``
    coded under per-block ``bounds`` (float64, on its device), no payload made."""
    return reference.lossy_roundtrip(x, bounds, widths)


@lossy_roundtrip.register_kernel("cuda")
def _(x, bounds, widths):
    return _kernels().lossy_roundtrip(x, bounds, widths)


@lossy_roundtrip.register_fake
def _(x, bounds, widths):
    return torch.empty_like(x)


LAUNCHES["lossy_roundtrip"] = 3  # the block table up, the blocks' steps, every value


# -- relative error bounds ----------------------------------------------------------------------


@custom_op("dlrm_compression::relative_bounds", mutates_args=())
@_cpu
def relative_bounds(x: torch.Tensor, rel: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """:func:`reference.relative_bounds`: float64 bounds per block, on ``x``'s device."""
    return reference.relative_bounds(x, rel, widths)


@relative_bounds.register_kernel("cuda")
def _(x, rel, widths):
    return _kernels().relative_bounds(x, rel, widths)


@relative_bounds.register_fake
def _(x, rel, widths):
    return x.new_empty(len(widths), dtype=torch.float64)


LAUNCHES["relative_bounds"] = 3  # the block table up, partial ranges, one program per block


# -- dedup by id ----------------------------------------------------------------------------------


@custom_op("dlrm_compression::id_runs", mutates_args=())
@_cpu
def id_runs(
    sorted_ids: torch.Tensor, perm: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`reference.id_runs`: the plan of a block's sorted ids and the ids' fingerprint."""
    return reference.id_runs(sorted_ids, perm, keys)


@id_runs.register_kernel("cuda")
def _(sorted_ids, perm, keys):
    return _kernels().id_runs(sorted_ids, perm, keys)


@id_runs.register_fake
def _(sorted_ids, perm, keys):
    n, rows = sorted_ids.shape
    return (
        keys.new_empty(n, dtype=torch.int64),
        keys.new_empty(n, rows, dtype=torch.int64),
        keys.new_empty(n, rows, dtype=torch.int64),
        keys.new_empty((), dtype=torch.int64),
    )


LAUNCHES["id_runs"] = 2  # the accumulator zeroed, one program per row of sorted ids


# -- the casts (none, fp16, bf16): values, header and check in one pass -----------------------------


@custom_op("dlrm_compression::cast_pack", mutates_args=())
@_cpu
def cast_pack(x: torch.Tensor, head: torch.Tensor, wire: int) -> torch.Tensor:
    """:func:`reference.cast_pack`: a cast codec's payload, its check written, no host wait."""
    return reference.cast_pack(x, head, wire)


@cast_pack.register_kernel("cuda")
def _(x, head, wire):
    return _kernels().cast_pack(x, head, wire)


@cast_pack.register_fake
def _(x, head, wire):
    item = (reference.WIRE_DTYPES[wire] or x.dtype).itemsize
    total = head.numel() + x.numel() * item
    return x.new_empty(total + (-total % 8), dtype=torch.uint8)


LAUNCHES["cast_pack"] = 2  # values, header and sums; the check finished and written


@custom_op("dlrm_compression::cast_unpack", mutates_args=("out",))
@_cpu
def cast_unpack(payload: torch.Tensor, head: torch.Tensor, wire: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`reference.cast_unpack`: the values into ``out`` and the payload's verdict (int64
    [2], on the device: its check holds, its header is the expected one)."""
    return reference.cast_unpack(payload, head, wire, out)


@cast_unpack.register_kernel("cuda")
def _(payload, head, wire, out):
    return _kernels().cast_unpack(payload, head, wire, out)


@cast_unpack.register_fake
def _(payload, head, wire, out):
    return payload.new_empty(2, dtype=torch.int64)


LAUNCHES["cast_unpack"] = 2  # values, sums and the header's verdict; the check's verdict


# the casts with duplicate ids (a gradient's, backward dedup): each id's rows summed as they are cast,
# each id's value kept on its first row as it is decoded; ``sorted_ids``/``perm``: the ids sorted
# stably along the rows (compression.dedup.id_sort, one op before)


@custom_op("dlrm_compression::cast_pack_summed", mutates_args=())
@_cpu
def cast_pack_summed(
    x: torch.Tensor, head: torch.Tensor, wire: int, sorted_ids: torch.Tensor, perm: torch.Tensor, widths: list[int]
) -> torch.Tensor:
    """:func:`reference.cast_pack_summed`: :func:`cast_pack`'s payload of x with each row the sum
    of its block's rows of the same id (summed in row order), no host wait."""
    return reference.cast_pack_summed(x, head, wire, sorted_ids, perm, widths)


@cast_pack_summed.register_kernel("cuda")
def _(x, head, wire, sorted_ids, perm, widths):
    return _kernels().cast_pack_summed(x, head, wire, sorted_ids, perm, widths)


@cast_pack_summed.register_fake
def _(x, head, wire, sorted_ids, perm, widths):
    item = (reference.WIRE_DTYPES[wire] or x.dtype).itemsize
    total = head.numel() + x.numel() * item
    return x.new_empty(total + (-total % 8), dtype=torch.uint8)


# one kernel: every id's sum, cast and written to its rows, the header and the sums, the check
# finished and written by its last program (the block table and launch counter go up once per
# widths, device and stream, like the headers)
LAUNCHES["cast_pack_summed"] = 1


@custom_op("dlrm_compression::cast_unpack_first", mutates_args=("out",))
@_cpu
def cast_unpack_first(
    payload: torch.Tensor,
    head: torch.Tensor,
    wire: int,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    perm: torch.Tensor,
    widths: list[int],
) -> torch.Tensor:
    """:func:`reference.cast_unpack_first`: :func:`cast_unpack` with each id's value on its
    block's first row of the id alone (zeros on the others), and the verdict."""
    return reference.cast_unpack_first(payload, head, wire, out, sorted_ids, perm, widths)


@cast_unpack_first.register_kernel("cuda")
def _(payload, head, wire, out, sorted_ids, perm, widths):
    return _kernels().cast_unpack_first(payload, head, wire, out, sorted_ids, perm, widths)


@cast_unpack_first.register_fake
def _(payload, head, wire, out, sorted_ids, perm, widths):
    return payload.new_empty(2, dtype=torch.int64)


LAUNCHES["cast_unpack_first"] = 1  # values (first rows), sums, the header's and (its last program) the check's verdicts


# -- the ids codec: bit streams, and every payload of a collective checked at once ------------------


@custom_op("dlrm_compression::bits_pack", mutates_args=())
@_cpu
def bits_pack(values: torch.Tensor, starts: torch.Tensor, n_words: int) -> torch.Tensor:
    """:func:`reference.bits_pack`: int64 values (each within its field) at their bit starts, in
    ``n_words`` int64 words."""
    return reference.bits_pack(values, starts, n_words)


@bits_pack.register_kernel("cuda")
def _(values, starts, n_words):
    return _kernels().bits_pack(values, starts, n_words)


@bits_pack.register_fake
def _(values, starts, n_words):
    return values.new_empty(n_words, dtype=torch.int64)


LAUNCHES["bits_pack"] = 2  # the words zeroed; one program per 1,024 values, two atomic ORs each


@custom_op("dlrm_compression::bits_unpack", mutates_args=())
@_cpu
def bits_unpack(words: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """:func:`reference.bits_unpack`: the field of each bit start and width, int64."""
    return reference.bits_unpack(words, starts, widths)


@bits_unpack.register_kernel("cuda")
def _(words, starts, widths):
    return _kernels().bits_unpack(words, starts, widths)


@bits_unpack.register_fake
def _(words, starts, widths):
    return starts.new_empty(starts.numel(), dtype=torch.int64)


LAUNCHES["bits_unpack"] = 1  # one program per 1,024 values


def _adler_segments(name: str, mode: int, mutates: tuple[str, ...] = ()):
    """:func:`_adler`'s op over several segments of one buffer (each its own payload), every one
    in the same launches."""

    @custom_op(f"dlrm_compression::{name}", mutates_args=mutates)
    @_cpu
    def op(
        data: torch.Tensor, starts: list[int], sizes: list[int], skip_at: int, skip_len: int, check_at: int
    ) -> torch.Tensor:
        return reference.adler32_segments(data, starts, sizes, skip_at, skip_len, check_at, mode)

    @op.register_kernel("cuda")
    def _(data, starts, sizes, skip_at, skip_len, check_at):
        return _kernels().adler32_segments(data, starts, sizes, skip_at, skip_len, check_at, mode)

    @op.register_fake
    def _(data, starts, sizes, skip_at, skip_len, check_at):
        return data.new_empty(len(starts), dtype=torch.int64)

    # the segments' table up, per-block sums of every segment, one program per segment to finish
    LAUNCHES[name] = lambda data, starts, *rest: 3 if starts else 0
    return op


# Each segment ``data[starts[s] : starts[s] + sizes[s]]``'s check but the ``skip_len`` bytes at its
# ``skip_at``: whether the u32 at its ``check_at`` equals it (1/0), or written there (in place),
# int64 [segments] on the device, no host wait.
adler32_segments_holds = _adler_segments("adler32_segments_holds", reference.ADLER_HOLDS)
adler32_segments_seal_ = _adler_segments("adler32_segments_seal_", reference.ADLER_SEAL, ("data",))
