"""The two passes of ``dlrm-preprocess`` over one span of one input file: what a worker runs.

A span is a run of whole lines of a file (``data.tsv.line_spans``). The counting pass returns the
span's statistics and per-feature value counts, its lines numbered from 1 (the span does not know
where it starts; the caller shifts them). The writing pass fills the span's rows of the shared
arrays in place. Everything here is a module-level function of picklable arguments, so it runs the
same in the calling process or in a spawned worker.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.layout import (
    DENSE_DTYPE,
    LABEL_DTYPE,
    NUM_DENSE,
    NUM_SPARSE,
    NpyWriter,
    array_path,
    sparse_dtype,
    transform_dense,
)
from data.tsv import Chunk, read_chunks
from data.vocab import IdMap, ValueCounter


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of input file number ``file`` (end None: to its end)."""

    file: int
    path: str
    start: int
    end: int | None


@dataclass(frozen=True)
class ParseOptions:
    skip_bad_rows: bool
    block_bytes: int
    max_ind_range: int
    max_reported: int


@dataclass
class SpanCounts:
    """What the counting pass learns of one span; ``bad`` lines are numbered from the span's start."""

    rows: int
    positives: int
    lines: int
    n_bad: int
    bad: list[tuple[int, str]]
    values: list[tuple[np.ndarray, np.ndarray]]  # per feature: sorted distinct raw values, counts


def _raw_sparse(chunk: Chunk, f: int, max_ind_range: int) -> np.ndarray:
    v = chunk.sparse[:, f]
    return v % np.uint64(max_ind_range) if max_ind_range else v


def count_span(span: Span, opts: ParseOptions) -> SpanCounts:
    """Pass 1 of a span: validate every row, count rows, positives, lines and raw values."""
    counters = [ValueCounter() for _ in range(NUM_SPARSE)]
    out = SpanCounts(0, 0, 0, 0, [], [])
    chunks = read_chunks(
        span.path, opts.skip_bad_rows, opts.block_bytes, opts.max_reported, (span.start, span.end), first_line=1
    )
    for chunk in chunks:
        out.rows += len(chunk.labels)
        out.positives += int(chunk.labels.sum())
        out.lines += chunk.lines
        out.n_bad += chunk.n_bad
        out.bad += chunk.bad
        for f in range(NUM_SPARSE):
            counters[f].add(_raw_sparse(chunk, f, opts.max_ind_range)[~chunk.sparse_missing[:, f]])
    out.values = [c.result() for c in counters]
    return out


@dataclass(frozen=True)
class SpanRows:
    """Where the writing pass puts a span: its first line number, and rows [first_row, + rows) of ``stem``."""

    span: Span
    first_line: int
    stem: str
    first_row: int
    rows: int


def write_span(part: SpanRows, out_dir: Path, id_maps: list[IdMap], opts: ParseOptions) -> None:
    """Pass 2 of a span: parse it again, map raw values to ids, write its rows in place."""
    ids_dtype = sparse_dtype([m.num_embeddings for m in id_maps])
    writers = [
        NpyWriter(array_path(out_dir, part.stem, "dense"), part.rows, (NUM_DENSE,), DENSE_DTYPE, part.first_row),
        NpyWriter(array_path(out_dir, part.stem, "sparse"), part.rows, (NUM_SPARSE,), ids_dtype, part.first_row),
        NpyWriter(array_path(out_dir, part.stem, "labels"), part.rows, (), LABEL_DTYPE, part.first_row),
    ]
    span = part.span
    for chunk in read_chunks(
        span.path, opts.skip_bad_rows, opts.block_bytes, 0, (span.start, span.end), part.first_line
    ):
        ids = np.empty((len(chunk.labels), NUM_SPARSE), dtype=ids_dtype)
        for f in range(NUM_SPARSE):
            ids[:, f] = id_maps[f](_raw_sparse(chunk, f, opts.max_ind_range), chunk.sparse_missing[:, f])
        writers[0].write(transform_dense(chunk.dense))
        writers[1].write(ids)
        writers[2].write(chunk.labels)
    for w in writers:
        w.close()  # raises if the span's rows changed between the passes


def save_id_maps(id_maps: list[IdMap], vocab_dir: Path) -> None:
    """The kept values of every feature as .npy files, for workers to map read-only (shared pages)."""
    for f, m in enumerate(id_maps):
        np.save(vocab_dir / f"kept_{f}.npy", m.kept)


@functools.lru_cache(maxsize=1)
def _load_id_maps(vocab_dir: str, frequency_threshold: int) -> list[IdMap]:
    return [
        IdMap(np.load(Path(vocab_dir) / f"kept_{f}.npy", mmap_mode="r"), frequency_threshold) for f in range(NUM_SPARSE)
    ]


def write_span_from_saved(part: SpanRows, out_dir: Path, vocab_dir: str, threshold: int, opts: ParseOptions) -> None:
    """``write_span`` in a worker: the id maps come from ``save_id_maps`` (loaded once per worker)."""
    write_span(part, out_dir, _load_id_maps(vocab_dir, threshold), opts)
