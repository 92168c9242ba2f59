"""The self-describing payload: a fixed header, a section table and 8-byte-aligned sections.

Layout (little-endian)::

    magic "DLCZ" | version u8 | codec id u8 | dtype u8 | flags u8 | header_len u32 | total_len u64
    | check u32 (over every other byte of the payload) | rows u64 | cols u32
    | n_blocks u32 | n_sections u32 | block widths u32 * n_blocks | bounds f64 * n_blocks
    | codec info u32 * 4 | section lengths u64 * n_sections | zero padding to 8 bytes
    | section 0 | pad to 8 | section 1 | pad ...

Every check that fails raises :class:`PayloadError` naming the field, so a truncated, corrupted
or foreign buffer is never decoded into wrong values.

The check is the backend's (:mod:`compression.backend`): zlib's crc32 on the host (the fastest
there), Adler-32 on the device (:func:`compression.ops.adler32`: two kernels over the payload's
own bytes), so that a device payload is never copied to the host; bit 0 of ``flags`` says which
(:data:`ADLER32`), and the decoder verifies whichever the payload carries, on any device. Either
one catches every single-bit flip.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops
from .backend import Backend, backend_for, upload

MAGIC = b"DLCZ"
VERSION = 1
_PREFIX = struct.Struct("<4sBBBBIQI")  # magic, version, codec, dtype, flags, header_len, total_len, check
_CRC_AT = _PREFIX.size - 4  # the check is the prefix's last field and covers every other byte
_TOTAL_AT = _CRC_AT - 8  # total_len, the field before it
ADLER32 = 1  # flags bit: the check is Adler-32 computed on the payload's device (else zlib crc32)
_FIXED = struct.Struct("<QIII")  # rows, cols, n_blocks, n_sections
N_INFO = 4  # codec-private u32 words (e.g. the lossy codec's stage choices)
_ALIGN = 8
_MAX_BLOCKS = 1 << 20
_MAX_SECTIONS = 64

DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPE_OF = {v: k for k, v in DTYPES.items()}


class PayloadError(ValueError):
    """A payload is truncated, corrupted, foreign or inconsistent with the decoder's inputs."""


@dataclass
class Header:
    """Everything the payload says about itself, besides the section bytes."""

    codec_id: int
    dtype: torch.dtype
    rows: int
    cols: int
    widths: list[int]
    bounds: list[float] | torch.Tensor  # float64 per block; a tensor (pack) is copied in on its device
    flags: int = 0
    info: list[int] = field(default_factory=lambda: [0] * N_INFO)
    offsets: list[int] = field(default_factory=list)  # where each section starts (unpack fills it)


@dataclass
class HostHead:
    """What the host needs of one payload to decode it, read with every other payload of its
    collective in one host synchronisation (:func:`read_heads`)."""

    data: bytes  # the payload's first bytes: its header, and what follows it as far as read
    good: bool  # the verdict of its Adler-32 check, computed on the device
    extra: list[int]  # int64 values the decoder asked for (e.g. what the receiver's ids give)
    state: Any = None  # the decoder's device tensors that go with ``extra``

    def section(self, header: Header, i: int, n: int) -> bytes | None:
        """Section ``i``'s first ``n`` bytes, if they were read."""
        at = header.offsets[i]
        return self.data[at : at + n] if at + n <= len(self.data) else None


def head_bytes(n_blocks: int, n_sections: int, then: int = 0) -> int:
    """The bytes of a payload's header with these counts, and ``then`` bytes after it."""
    size = _PREFIX.size + _FIXED.size + 12 * n_blocks + 4 * N_INFO + 8 * n_sections
    return size + _pad(size) + then


def read_heads(
    payloads: list[torch.Tensor], extras: list[torch.Tensor | None], sizes: list[int] | None = None
) -> list[HostHead]:
    """Every payload's first bytes (``sizes``, else :data:`_HEAD`), the verdict of its device
    check and the ``extras`` (int64 tensors on the device), in one host synchronisation for all."""
    parts: list[torch.Tensor] = []
    spans = []
    for i, (p, e) in enumerate(zip(payloads, extras, strict=True)):
        n = min(p.numel(), _HEAD if sizes is None else sizes[i])
        ok = _holds(p) if p.numel() >= _PREFIX.size else torch.zeros((), dtype=torch.int64, device=p.device)
        parts += [p[:n], ok.reshape(1).view(torch.uint8)[:1]]
        if e is not None:
            parts.append(e.to(torch.int64).reshape(-1).view(torch.uint8))
        spans.append((n, 0 if e is None else e.numel()))
    host = torch.cat(parts).cpu().numpy().tobytes() if parts else b""
    heads, at = [], 0
    for n, k in spans:
        data, good = host[at : at + n], host[at + n] == 1
        extra = list(struct.unpack_from(f"<{k}q", host, at + n + 1))
        heads.append(HostHead(data, good, extra))
        at += n + 1 + 8 * k
    return heads


def _pad(n: int) -> int:
    return -n % _ALIGN


def _as_bytes_tensor(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a tensor's bytes (copies only if it is not contiguous)."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def pack(
    header: Header,
    sections: list[torch.Tensor],
    device: torch.device | None = None,
    device_info: dict[int, torch.Tensor] | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Serialise a header and its sections into one uint8 payload tensor on ``device``, with the
    check of ``backend`` (default: the device's).

    ``device_info``: codec info words (index -> int64 0-d tensor in [0, 2**32)) computed on the
    device, written in place of ``header.info``'s, so that the host never reads them.
    """
    if len(header.widths) != len(header.bounds):
        raise ValueError(f"{len(header.widths)} block widths but {len(header.bounds)} bounds")
    if len(header.info) != N_INFO:
        raise ValueError(f"codec info must have {N_INFO} words, got {len(header.info)}")
    body_parts = [_as_bytes_tensor(s) for s in sections]
    lengths = [int(p.numel()) for p in body_parts]
    nb = len(header.widths)
    if device is None:
        device = body_parts[0].device if body_parts else torch.device("cpu")
    check = (backend or backend_for(device)).check
    head = header_bytes(header, lengths, check)
    prefix = head[: _PREFIX.size]
    pieces = [upload(torch.frombuffer(bytearray(head), dtype=torch.uint8), device)]
    zeros = header_on(bytes(_ALIGN), device) if any(_pad(n) for n in lengths) else None  # (up once)
    for p, n in zip(body_parts, lengths, strict=True):
        pieces.append(_on(p, device))
        if zeros is not None and _pad(n):
            pieces.append(zeros[: _pad(n)])
    out = torch.cat(pieces)  # one copy of every section into the payload
    at = _PREFIX.size + _FIXED.size + 4 * nb  # device values written where they are (no host copy)
    if isinstance(header.bounds, torch.Tensor):
        out[at : at + 8 * nb] = _as_bytes_tensor(_on(header.bounds.to(torch.float64), device))
    for i, v in (device_info or {}).items():  # a u32 word: the low 4 bytes of an int64 (little-endian)
        word = at + 8 * nb + 4 * i
        out[word : word + 4] = _on(v.to(torch.int64).reshape(1), device).view(torch.uint8)[:4]
    if check == "adler32":  # computed and written on the device: the payload never leaves it
        ops.adler32_seal_(out, None, out.numel(), _CRC_AT, 4, _CRC_AT)
    else:
        crc = _crc32(out[_PREFIX.size :], zlib.crc32(prefix[:_CRC_AT]))
        out[_CRC_AT : _PREFIX.size] = torch.frombuffer(bytearray(struct.pack("<I", crc)), dtype=torch.uint8)
    return out


def header_bytes(header: Header, lengths: Sequence[int], check: str) -> bytes:
    """The bytes of a payload's header (its check field zero) for sections of ``lengths`` bytes,
    checked by ``check`` ("crc32" or "adler32"); a tensor of bounds leaves zeros where they go."""
    if len(header.widths) != len(header.bounds):
        raise ValueError(f"{len(header.widths)} block widths but {len(header.bounds)} bounds")
    if len(header.info) != N_INFO:
        raise ValueError(f"codec info must have {N_INFO} words, got {len(header.info)}")
    if header.flags & ADLER32:
        raise ValueError(f"header flags {header.flags:#x}: bit {ADLER32} is the format's (which check)")
    nb, ns = len(header.widths), len(lengths)
    rest = b"".join(
        [
            _FIXED.pack(header.rows, header.cols, nb, ns),
            struct.pack(f"<{nb}I", *header.widths),
            bytes(8 * nb) if isinstance(header.bounds, torch.Tensor) else struct.pack(f"<{nb}d", *header.bounds),
            struct.pack(f"<{N_INFO}I", *header.info),
            struct.pack(f"<{ns}Q", *lengths),
        ]
    )
    header_len = _PREFIX.size + len(rest)
    rest += bytes(_pad(header_len))
    header_len += _pad(header_len)
    total = header_len + sum(n + _pad(n) for n in lengths)
    flags = header.flags | (ADLER32 if check == "adler32" else 0)
    return _PREFIX.pack(MAGIC, VERSION, header.codec_id, DTYPES[header.dtype], flags, header_len, total, 0) + rest


_HEADS: dict[tuple[bytes, torch.device], torch.Tensor] = {}  # headers already on a device (few shapes recur)


def header_on(head: bytes, device: torch.device) -> torch.Tensor:
    """A header's bytes on ``device``, uploaded once per distinct header and device: a run sends
    the same few headers every iteration (the casts' depend on the chunk's shape alone)."""
    key = (head, torch.device(device))
    if key not in _HEADS:
        if len(_HEADS) >= 256:
            _HEADS.clear()
        _HEADS[key] = upload(torch.frombuffer(bytearray(head), dtype=torch.uint8), device)
    return _HEADS[key]


Length = int | torch.Tensor  # a byte count known on the host, or an int64 0-d tensor on the device


@dataclass
class Deferred:
    """A payload whose length is still on the device: its bytes are ``buffer[:length]``, the rest
    of ``buffer`` is capacity. The transport reads every length of a collective in one host
    synchronisation (its size exchange) and then slices (:func:`settle`)."""

    buffer: torch.Tensor  # uint8
    length: torch.Tensor  # int64 0-d, on the buffer's device

    def take(self, n: int) -> torch.Tensor:
        return self.buffer[:n]


def settle(payloads: Sequence[torch.Tensor | Deferred | None]) -> list[torch.Tensor | None]:
    """Every payload as bytes: the deferred lengths read in one host synchronisation."""
    late = [p for p in payloads if isinstance(p, Deferred)]
    sizes = iter(torch.stack([p.length for p in late]).tolist() if late else [])
    return [p.take(next(sizes)) if isinstance(p, Deferred) else p for p in payloads]


def pick(flag: torch.Tensor, if_true: torch.Tensor | Deferred, if_false: torch.Tensor | Deferred) -> Deferred:
    """One of two payloads as a 0-d bool on the device says, chosen there (no host wait): for a
    sender that has not read yet which of two encodings of a chunk applies."""
    a, b = (p if isinstance(p, Deferred) else Deferred(p, _length(p.numel(), p.device)) for p in (if_true, if_false))
    n = max(a.buffer.numel(), b.buffer.numel())
    x, y = (torch.nn.functional.pad(p.buffer, (0, n - p.buffer.numel())) for p in (a, b))
    return Deferred(torch.where(flag, x, y), torch.where(flag, a.length, b.length))


def pack_deferred(
    header: Header,
    sections: list[list[tuple[torch.Tensor, Length]]],
    device: torch.device,
    device_info: dict[int, torch.Tensor] | None = None,
    device_rows: torch.Tensor | None = None,
) -> Deferred:
    """:func:`pack` for sections whose lengths are known on the device only, with the Adler-32
    check: the same bytes, built without a host synchronisation.

    Each section is a list of pieces (bytes tensor of at least ``length`` bytes, ``length``),
    joined without padding (:func:`compression.ops.frame`: one gather, whose programs past the
    payload's end exit at once). ``device_rows`` (an int64 0-d tensor): the row count where only
    the device knows it, written in place of ``header.rows``; device values in the header (the
    rows, a tensor of bounds, ``device_info``'s words) join the host's bytes in one gather.
    """
    nb, ns = len(header.widths), len(sections)
    if header.flags & ADLER32:
        raise ValueError(f"header flags {header.flags:#x}: bit {ADLER32} is the format's (which check)")
    if nb != len(header.bounds) or len(header.info) != N_INFO or not all(sections):
        raise ValueError(
            f"{nb} block widths, {len(header.bounds)} bounds, {len(header.info)} info words (want "
            f"{N_INFO}) and sections of {[len(sec) for sec in sections]} pieces (want at least one each)"
        )
    on_device = isinstance(header.bounds, torch.Tensor)
    rest = b"".join(
        [
            _FIXED.pack(header.rows, header.cols, nb, ns),
            struct.pack(f"<{nb}I", *header.widths),
            bytes(8 * nb) if on_device else struct.pack(f"<{nb}d", *header.bounds),
            struct.pack(f"<{N_INFO}I", *header.info),
            bytes(8 * ns),  # section lengths: written from the device
        ]
    )
    header_len = _PREFIX.size + len(rest)
    rest += bytes(_pad(header_len))
    header_len += _pad(header_len)
    flags = header.flags | ADLER32
    prefix = _PREFIX.pack(MAGIC, VERSION, header.codec_id, DTYPES[header.dtype], flags, header_len, 0, 0)
    at = _PREFIX.size + _FIXED.size + 4 * nb  # the bounds, then the info words
    patches: list[tuple[int, torch.Tensor]] = []  # (where, bytes on the device) in the header
    if device_rows is not None:  # the first field after the prefix, a u64
        patches.append((_PREFIX.size, _length(device_rows, device).reshape(1).view(torch.uint8)))
    if on_device:
        assert isinstance(header.bounds, torch.Tensor)
        patches.append((at, _as_bytes_tensor(_on(header.bounds.to(torch.float64), device))))
    for i, v in sorted((device_info or {}).items()):
        patches.append((at + 8 * nb + 4 * i, _on(v.to(torch.int64).reshape(1), device).view(torch.uint8)[:4]))
    pieces = [_as_bytes_tensor(_on(t, device)) for sec in sections for t, _ in sec]
    lengths = [n for sec in sections for _, n in sec]
    out, total = ops.frame(
        torch.frombuffer(bytearray(prefix + rest), dtype=torch.uint8),  # the host's bytes (up inside the op)
        [b for _, b in patches],
        [where for where, _ in patches],
        pieces,
        [_length(n, device) for n in lengths if isinstance(n, torch.Tensor)],
        [-1 if isinstance(n, torch.Tensor) else int(n) for n in lengths],
        [i for i, sec in enumerate(sections) for _ in sec],
        ns,
        _ALIGN,
        at + 8 * nb + 4 * N_INFO,
        _TOTAL_AT,
    )
    ops.adler32_seal_(out, total, 0, _CRC_AT, 4, _CRC_AT)
    return Deferred(out, total)


def section_one_at(n_blocks: int, n_sections: int) -> tuple[int, int]:
    """(where a payload's header keeps its first section's length, an int64; the header's bytes):
    the second section starts at the latter plus the former rounded up to the alignment, 8
    (:func:`compression.ops.row_moved` reads it so)."""
    assert _ALIGN == 8
    return _PREFIX.size + _FIXED.size + 12 * n_blocks + 4 * N_INFO, head_bytes(n_blocks, n_sections)


def _length(n: Length, device: torch.device) -> torch.Tensor:
    """A byte count as an int64 0-d tensor on ``device`` (a host number goes up without waiting)."""
    if isinstance(n, torch.Tensor):
        return n.to(device, torch.int64).reshape(())
    return upload(torch.tensor(n, dtype=torch.int64), device)


def _holds(payload: torch.Tensor) -> torch.Tensor:
    """Whether a payload's Adler-32 holds, as an int64 0-d 1/0 on its device (no host wait)."""
    return ops.adler32_holds(payload, None, payload.numel(), _CRC_AT, 4, _CRC_AT)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: host bytes go up with one copy (:func:`compression.backend.upload`)."""
    return t if t.device == device else upload(t, device)


def _crc32(t: torch.Tensor, start: int) -> int:
    """zlib crc32 of a uint8 tensor, continuing from ``start`` (device tensors are copied to host)."""
    # ndarray.data (a memoryview) is a buffer to every numpy's type stubs; the array itself is
    # one only to some (numpy >= 2.5, or Python >= 3.12)
    return zlib.crc32(t.cpu().numpy().data if t.device.type != "cpu" else t.numpy().data, start)


def _host_bytes(t: torch.Tensor, n: int) -> bytes:
    return t[:n].cpu().numpy().tobytes()


def peek_codec_id(payload: torch.Tensor, read: HostHead | None = None) -> int:
    """The id of the codec that wrote ``payload``, from its prefix alone (``read``: its first
    bytes, already read); :func:`unpack` (which every decode runs) does the full checks,
    checksum included."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError("payload must be a 1-D torch.uint8 tensor")
    if payload.numel() < _PREFIX.size:
        raise PayloadError(
            f"payload of {payload.numel()} bytes is shorter than the {_PREFIX.size}-byte prefix "
            "(truncated or not a dlrm-compress payload)"
        )
    if read is not None and len(read.data) >= _PREFIX.size:
        prefix = read.data[: _PREFIX.size]
    else:
        prefix = _host_bytes(payload.contiguous(), _PREFIX.size)
    magic, _, codec_id, *_ = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}, expected {MAGIC!r}: not a dlrm-compress payload")
    return int(codec_id)


def unpack(
    payload: torch.Tensor, read: HostHead | None = None, backend: Backend | None = None
) -> tuple[Header, list[torch.Tensor]]:
    """Validate a payload and return its header and section views (on the payload's device);
    ``read``: its first bytes and check, already read (:func:`read_heads`), so that nothing here
    waits for the device; else read here, with the device's check verdict where ``backend``
    (default: the device's) checks on the device."""
    if not isinstance(payload, torch.Tensor):
        raise PayloadError(f"payload must be a torch.uint8 tensor, got {type(payload).__name__}")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError(
            f"payload must be a 1-D torch.uint8 tensor, got {payload.dtype} with shape {tuple(payload.shape)}"
        )
    payload = payload.contiguous()
    size = payload.numel()
    if size < _PREFIX.size:
        raise PayloadError(
            f"payload of {size} bytes is shorter than the {_PREFIX.size}-byte prefix "
            "(truncated or not a dlrm-compress payload)"
        )
    head, verdict = (
        _read_head(payload, backend or backend_for(payload.device)) if read is None else (read.data, int(read.good))
    )
    prefix = head[: _PREFIX.size]
    magic, version, codec_id, dtype_code, flags, header_len, total, crc = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}, expected {MAGIC!r}: not a dlrm-compress payload")
    if version != VERSION:
        raise PayloadError(f"payload format version {version}, this decoder reads version {VERSION}")
    if total != size:
        raise PayloadError(
            f"payload is {size} bytes but its header says {total} ({'truncated' if size < total else 'trailing bytes'})"
        )
    if not _PREFIX.size + _FIXED.size <= header_len <= size:
        raise PayloadError(f"header length {header_len} out of range for a {size}-byte payload")
    if flags & ADLER32 and verdict is not None and header_len <= len(head):  # read with the prefix
        good, raw = verdict == 1, head
    elif flags & ADLER32:  # checked on the device; its verdict comes back with the header's bytes
        ok = _holds(payload).reshape(1).view(torch.uint8)[:1]
        raw = _host_bytes(torch.cat([payload[:header_len], ok]), header_len + 1)
        good, raw = raw[-1] == 1, raw[:-1]
    else:
        good = _crc32(payload[_PREFIX.size :], zlib.crc32(prefix[:_CRC_AT])) == crc
        raw = _host_bytes(payload, header_len)
    if not good:
        raise PayloadError(f"checksum mismatch ({'adler32' if flags & ADLER32 else 'crc32'}): the payload is corrupted")
    # The check covers everything below, so what follows only guards against encoder bugs.
    if dtype_code not in _DTYPE_OF:
        raise PayloadError(f"unknown dtype code {dtype_code} in header")
    rows, cols, nb, ns = _FIXED.unpack_from(raw, _PREFIX.size)
    if nb > _MAX_BLOCKS or ns > _MAX_SECTIONS:
        raise PayloadError(f"header claims {nb} blocks and {ns} sections: corrupted")
    pos = _PREFIX.size + _FIXED.size
    need = pos + 12 * nb + 4 * N_INFO + 8 * ns
    if need > header_len:
        raise PayloadError(f"header of {header_len} bytes cannot hold {nb} blocks and {ns} sections")
    widths = list(struct.unpack_from(f"<{nb}I", raw, pos))
    pos += 4 * nb
    bounds = list(struct.unpack_from(f"<{nb}d", raw, pos))
    pos += 8 * nb
    info = list(struct.unpack_from(f"<{N_INFO}I", raw, pos))
    pos += 4 * N_INFO
    lengths = struct.unpack_from(f"<{ns}Q", raw, pos)
    if sum(widths) != cols:
        raise PayloadError(f"block widths {widths} sum to {sum(widths)}, header says {cols} columns")
    sections, offsets, start = [], [], header_len
    for i, n in enumerate(lengths):
        if start + n > size:
            raise PayloadError(f"section {i} ({n} bytes at offset {start}) runs past the payload end")
        sections.append(payload[start : start + n])
        offsets.append(start)
        start += n + _pad(n)
    if start != size:
        raise PayloadError(f"sections end at byte {start}, payload has {size}")
    header = Header(
        codec_id=codec_id,
        dtype=_DTYPE_OF[dtype_code],
        rows=rows,
        cols=cols,
        widths=widths,
        bounds=bounds,
        flags=flags,
        info=info,
        offsets=offsets,
    )
    return header, sections


_HEAD = 1024  # bytes read with the prefix where the device checks: the header of up to ~75 blocks


def _read_head(payload: torch.Tensor, backend: Backend) -> tuple[bytes, int | None]:
    """The payload's first bytes for the host, and, where ``backend`` checks on the device, the
    verdict of that check computed there: one read for the prefix, the header and the check (the
    payload's own flags say later whether the verdict applies)."""
    if backend.check != "adler32":
        return _host_bytes(payload, _PREFIX.size), None
    [head] = read_heads([payload], [None])
    return head.data, int(head.good)


def verdict(payload: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """Whether a payload's check (the one ``backend``, by default the device's, writes) holds, as
    a 0-d int64 1/0 tensor where the payload is: on a device no host wait (read later with other
    numbers, as they are: no cast to launch)."""
    if (backend or backend_for(payload.device)).check == "adler32":
        return _holds(payload)
    crc = _crc32(payload[_PREFIX.size :], zlib.crc32(_host_bytes(payload, _CRC_AT)))  # the CPU: free
    return torch.tensor(int(crc == int.from_bytes(_host_bytes(payload, _PREFIX.size)[_CRC_AT:], "little")))


def view_as(section: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """Reinterpret a section's bytes as ``dtype`` (copying only when misaligned)."""
    item = dtype.itemsize
    if section.numel() % item:
        raise PayloadError(f"{what}: {section.numel()} bytes is not a whole number of {dtype}")
    if section.numel() == 0:  # an empty slice reports data_ptr 0 whatever its offset: view() would refuse it
        return torch.empty(0, dtype=dtype, device=section.device)
    if section.data_ptr() % item:
        section = section.clone()
    return section.view(dtype)
