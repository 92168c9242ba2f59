"""Streaming, vectorised parser of raw Criteo TSV (Kaggle train.txt and Terabyte day_N alike).

One row per line, 40 TAB-separated fields: label (0/1), 13 decimal integers, 26 hexadecimal
hashes; an empty field is a missing value. Files are read in blocks cut at line ends and each
block is parsed with numpy over its bytes (no per-value Python), so memory depends on the block
size, not the file size. Integers are parsed exactly into int64/uint64 (never through floats).
Plain and gzip-compressed (``.gz``) files are read through iopath's PathManager.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
from iopath.common.file_io import PathManager

from data.layout import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES

NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
FIELD_NAMES = ["label", *DENSE_NAMES, *SPARSE_NAMES]
MAX_DEC_DIGITS = 18  # any 18-digit decimal fits int64
MAX_HEX_DIGITS = 16  # any 16-digit hash fits uint64 (Criteo's are 8)
DEFAULT_BLOCK_BYTES = 4 << 20  # ~16k Kaggle rows; bounds the parser's memory

_TAB, _NL, _MINUS = 9, 10, 45
_HEX = np.full(256, 255, dtype=np.uint8)  # byte -> nibble value, 255 = not a hex digit
for _c in b"0123456789":
    _HEX[_c] = _c - 48
for _c in b"abcdef":
    _HEX[_c] = _HEX[_c - 32] = _c - 87
_POW10 = 10 ** np.arange(MAX_DEC_DIGITS + 1, dtype=np.int64)
_PAD = 32  # > MAX_DEC_DIGITS and MAX_HEX_DIGITS
_path_manager = PathManager()


class CriteoFormatError(ValueError):
    """A row of a Criteo TSV file is malformed; the message names file, line and field."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason} (use --skip-bad-rows to skip such rows)")
        self.path, self.line, self.reason = path, line, reason

    def __reduce__(self) -> tuple[type, tuple[str, int, str]]:  # crosses process boundaries intact
        return type(self), (self.path, self.line, self.reason)


@dataclass
class Chunk:
    """Parsed rows of one block; missing values are 0 with their mask set."""

    labels: np.ndarray  # uint8 [n]
    dense: np.ndarray  # int64 [n, 13]
    dense_missing: np.ndarray  # bool [n, 13]
    sparse: np.ndarray  # uint64 [n, 26] raw hash values
    sparse_missing: np.ndarray  # bool [n, 26]
    lines: int = 0  # lines of the block, malformed ones included
    n_bad: int = 0  # rows skipped in this block (skip_bad_rows only)
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line, reason) of the first skipped rows


def open_binary(path: str | os.PathLike) -> BinaryIO:
    """Open ``path`` for reading bytes through iopath, decompressing ``.gz`` files on the fly."""
    f = _path_manager.open(os.fspath(path), "rb")
    if os.fspath(path).endswith(".gz"):
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return f


def _blocks(f: BinaryIO, block_bytes: int, size: int | None = None) -> Iterator[bytes]:
    """Yield pieces of ``f`` (its next ``size`` bytes, or all) that each end with a newline (one
    is added at the end if missing)."""
    rest = b""
    left = size
    while (left is None or left > 0) and (data := f.read(block_bytes if left is None else min(block_bytes, left))):
        if left is not None:
            left -= len(data)
        if rest:
            data = rest + data
        cut = data.rfind(b"\n") + 1
        if cut:
            yield data[:cut]
        rest = data[cut:]
    if rest:
        yield rest + b"\n"


def read_chunks(
    path: str | os.PathLike,
    skip_bad_rows: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_reported: int = 10,
    span: tuple[int, int | None] = (0, None),
    first_line: int = 1,
) -> Iterator[Chunk]:
    """Parse a Criteo TSV file, or its bytes ``span`` = [start, end) (end None: to the end; a
    span must begin at a line start), block by block.

    A malformed row raises CriteoFormatError naming ``path:line`` and the field, the span's first
    line counting as ``first_line``, unless ``skip_bad_rows``: then it is dropped, counted in
    ``Chunk.n_bad`` and, for the first ``max_reported`` of the span, described in ``Chunk.bad``.
    """
    start, end = span
    reported = 0
    with open_binary(path) as f:
        if start:
            f.seek(start)
        for block in _blocks(f, block_bytes, None if end is None else end - start):
            chunk = _parse_block(block, os.fspath(path), first_line, skip_bad_rows, max_reported - reported)
            reported += len(chunk.bad)
            first_line += chunk.lines
            yield chunk


def line_spans(path: str | os.PathLike, parts: int) -> list[tuple[int, int | None]]:
    """Cut a file into at most ``parts`` byte spans of whole lines, of about equal size.

    Each cut moves forward to the next line start, so no line is split and the spans, in order,
    cover the file exactly. A gzip file cannot be entered in the middle: it is one span.
    """
    size = os.path.getsize(path)
    if parts <= 1 or os.fspath(path).endswith(".gz") or size == 0:
        return [(0, None)]
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, parts):
            nominal = size * k // parts
            if nominal <= cuts[-1]:  # a long line already reaches past this cut
                continue
            f.seek(nominal - 1)
            f.readline()  # to the start of the first line beginning at or after the nominal cut
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
    return [(a, b) for a, b in zip(cuts, [*cuts[1:], None], strict=True)]


def _field_text(buf: np.ndarray, start: int, end: int) -> str:
    text = buf[start:end].tobytes().decode("utf-8", errors="replace")
    return text if len(text) <= 40 else text[:37] + "..."


def _parse_block(block: bytes, path: str, first_line: int, skip: bool, report: int) -> Chunk:
    if b"\r" in block:  # tolerate CRLF files
        block = block.replace(b"\r\n", b"\n")
    # Padding on both sides keeps every fixed-width window (left- or right-aligned) inside.
    buf = np.frombuffer(bytes(_PAD) + block + bytes(_PAD), dtype=np.uint8)
    sep = np.flatnonzero((buf == _TAB) | (buf == _NL))
    line_end = np.flatnonzero(buf[sep] == _NL)  # index in sep of each line's last separator
    fields_per_line = np.diff(line_end, prepend=-1)
    starts = np.empty_like(sep)
    starts[0] = _PAD
    starts[1:] = sep[:-1] + 1
    good_line = fields_per_line == NUM_FIELDS
    keep = np.repeat(good_line, fields_per_line)
    start = starts[keep].reshape(-1, NUM_FIELDS)
    length = (sep[keep] - starts[keep]).reshape(-1, NUM_FIELDS)
    lines = first_line + np.flatnonzero(good_line)  # 1-based line number of each parsed row

    labels, bad_label = _parse_label(buf, start[:, 0], length[:, 0])
    dense, dense_missing, bad_dense = _parse_decimal(buf, start[:, 1 : 1 + NUM_DENSE], length[:, 1 : 1 + NUM_DENSE])
    sparse, sparse_missing, bad_sparse = _parse_hex(buf, start[:, 1 + NUM_DENSE :], length[:, 1 + NUM_DENSE :])
    bad_field = np.concatenate([bad_label[:, None], bad_dense, bad_sparse], axis=1)
    bad_row = bad_field.any(axis=1)

    # Every problem of the block, in line order: wrong field counts and bad fields.
    problems: list[tuple[int, str]] = []
    for i in np.flatnonzero(~good_line)[: report if skip else 1]:
        reason = f"line has {int(fields_per_line[i])} TAB-separated fields, expected {NUM_FIELDS}"
        problems.append((first_line + int(i), reason))
    for r in np.flatnonzero(bad_row)[: report if skip else 1]:
        c = int(np.flatnonzero(bad_field[r])[0])
        kind = "0 or 1" if c == 0 else "a decimal integer" if c <= NUM_DENSE else "a hexadecimal hash"
        text = _field_text(buf, int(start[r, c]), int(start[r, c] + length[r, c]))
        problems.append((int(lines[r]), f"field {c + 1} ({FIELD_NAMES[c]}) is not {kind}: {text!r}"))
    problems.sort()
    n_bad = int((~good_line).sum() + bad_row.sum())
    if n_bad and not skip:
        line, reason = problems[0]
        raise CriteoFormatError(path, line, reason)
    ok = ~bad_row
    return Chunk(
        labels[ok],
        dense[ok],
        dense_missing[ok],
        sparse[ok],
        sparse_missing[ok],
        len(line_end),
        n_bad,
        problems[: max(report, 0)],
    )


def _windows(buf: np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
    """[len(start), width] bytes beginning at each start (one row gather over a strided view)."""
    view = np.lib.stride_tricks.as_strided(buf, shape=(len(buf) - width + 1, width), strides=(1, 1), writeable=False)
    return view[start]


def _parse_label(buf: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = buf[start]
    ok = (length == 1) & ((c == 48) | (c == 49))
    return np.where(ok, c - 48, 0).astype(np.uint8), ~ok


def _parse_decimal(buf: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact int64 values of decimal fields (optional leading '-'): right-aligned digit windows
    times fixed powers of ten."""
    shape, s, L = start.shape, start.ravel(), length.ravel()
    bad = L > MAX_DEC_DIGITS
    L = np.where(bad, 0, L)
    width = -(-max(int(L.max(initial=0)), 1) // 8) * 8  # a multiple of 8: rows of flags view as uint64
    digits = _windows(buf, s + L - width, width) - np.uint8(48)  # non-digits wrap to > 9
    in_field = np.arange(width) >= (width - L)[:, None]
    digit_ok = digits <= 9
    neg = (L > 0) & (buf[s] == _MINUS)
    not_digit = in_field & ~digit_ok
    neg_rows = np.flatnonzero(neg)
    not_digit[neg_rows, (width - L)[neg_rows]] = False  # a leading '-' is allowed
    bad |= not_digit.view(np.uint64).any(axis=1) | (neg & (L == 1))
    value = np.where(in_field & digit_ok, digits, 0).astype(np.int64) @ _POW10[width - 1 :: -1]
    value = np.where(bad, 0, np.where(neg, -value, value))
    return value.reshape(shape), ((L == 0) & ~bad).reshape(shape), bad.reshape(shape)


def _parse_hex(buf: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact uint64 values of hexadecimal fields; the usual 8-digit ones are packed 2 nibbles a byte."""
    shape, s, L = start.shape, start.ravel(), length.ravel()
    bad = L > MAX_HEX_DIGITS
    L = np.where(bad, 0, L)
    value = np.zeros(len(s), dtype=np.uint64)
    eight = np.flatnonzero(L == 8)
    nib = _HEX[_windows(buf, s[eight], 8)]
    bad[eight] = (nib == 255).view(np.uint64)[:, 0] != 0  # any of the 8 digits invalid
    packed = np.ascontiguousarray((nib[:, 0::2] << 4) | nib[:, 1::2])  # 8 hex digits -> 4 bytes
    value[eight] = packed.view(">u4").ravel()
    other = np.flatnonzero((L != 8) & (L > 0))  # rare: hashes of other widths, by Horner's rule
    if len(other):
        nib = _HEX[_windows(buf, s[other], MAX_HEX_DIGITS)].astype(np.uint64)
        v = np.zeros(len(other), dtype=np.uint64)
        for j in range(MAX_HEX_DIGITS):
            active = j < L[other]
            bad[other] |= active & (nib[:, j] == 255)
            v = np.where(active, (v << np.uint64(4)) | (nib[:, j] & np.uint64(15)), v)
        value[other] = v
    value[bad] = 0
    return value.reshape(shape), ((L == 0) & ~bad).reshape(shape), bad.reshape(shape)
