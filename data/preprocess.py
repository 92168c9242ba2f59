"""``dlrm-preprocess``: raw Criteo TSV files -> per-file numpy arrays with a shared vocabulary.

Two streaming passes over the input: the first parses and validates every row and counts the
raw values of each categorical feature over ALL files (so train/dev/test share ids), the second
parses again and writes ``<stem>_{dense,sparse,labels}.npy`` block by block. Memory depends on
the block size and the number of distinct values, never on the number of rows. With ``workers``
> 1, each pass runs over spans of whole lines (``data/passes.py``) in spawned processes: pass 1
merges the spans' value counts in file order, pass 2 writes each span's rows in place, so the
arrays are byte for byte those of one process and errors name the true line. TorchRec's
Criteo helpers are deliberately not used: its Kaggle parser silently treats any path containing
"test" as unlabeled, its dense transform shifts by each file's minimum, and it loads whole files.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from data.frequency import DEFAULT_TOP_N, FeatureFrequency, frequency_meta
from data.layout import (
    DENSE_DTYPE,
    FORMAT_VERSION,
    LABEL_DTYPE,
    META,
    MISSING_ID,
    NUM_DENSE,
    NUM_SPARSE,
    DatasetError,
    array_path,
    atomic_dataset_dir,
    base_meta,
    check_replaceable,
    create_npy,
    is_complete,
    read_meta,
    sparse_dtype,
    write_meta,
)
from data.passes import ParseOptions, Span, SpanRows, count_span, save_id_maps, write_span, write_span_from_saved
from data.tsv import DEFAULT_BLOCK_BYTES, CriteoFormatError, line_spans
from data.vocab import IdMap, ValueCounter

FORMATS = ("kaggle", "terabyte")
SAMPLE_DIR = Path(__file__).resolve().parent / "sample" / "kaggle_head8000"
SAMPLE_STEMS = ("train", "dev", "test")
MAX_REPORTED_BAD_ROWS = 10
DEFAULT_SPAN_BYTES = 64 << 20  # a worker's share of a file at a time: bounds its value counts
MIN_SHARED_BYTES = 1 << 20  # smaller files are not cut for the sake of balance


def file_stem(path: str | os.PathLike) -> str:
    """The stem naming a file's arrays: its name without directory, ``.gz`` and last suffix."""
    name = Path(os.fspath(path)).name
    if name.endswith(".gz"):
        name = name[:-3]
    return Path(name).stem


T = TypeVar("T")


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(msg, file=sys.stderr, flush=True)


def preprocess(
    files: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    fmt: str = "kaggle",
    frequency_threshold: int = 0,
    max_ind_range: int = 0,
    skip_bad_rows: bool = False,
    overwrite: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    verbose: bool = False,
    extra_meta: dict[str, Any] | None = None,
    workers: int = 1,
    span_bytes: int = DEFAULT_SPAN_BYTES,
    top_ids: int = DEFAULT_TOP_N,
) -> dict[str, Any]:
    """Convert Criteo TSV ``files`` into a dataset directory ``out_dir``; return its meta.json.

    ``frequency_threshold`` T > 0 maps values seen fewer than T times (over all files) to id 1;
    ``max_ind_range`` M > 0 replaces each raw hash by ``hash % M`` first. A malformed row raises
    CriteoFormatError naming file and line unless ``skip_bad_rows``. ``out_dir`` appears only
    when complete; an existing dataset there is kept unless ``overwrite``. ``workers`` processes
    share each pass, a file being cut into spans of whole lines of at most ``span_bytes`` (a
    worker's memory depends on the span and block sizes); the arrays do not depend on either.
    meta.json's ``frequency`` holds each feature's ``top_ids`` hottest ids and its tail summary
    (``data/frequency.py``), from the same counts.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if frequency_threshold < 0 or max_ind_range < 0:
        raise ValueError("frequency_threshold and max_ind_range must be >= 0")
    if top_ids < 0:
        raise ValueError(f"top_ids must be >= 0, got {top_ids}")
    if workers < 1 or span_bytes < 1:
        raise ValueError(f"workers and span_bytes must be >= 1, got {workers} and {span_bytes}")
    if not files:
        raise ValueError("no input files given")
    paths = [os.fspath(f) for f in files]
    stems = [file_stem(p) for p in paths]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: no such file")
    dupes = sorted({s for s in stems if stems.count(s) > 1})
    if dupes:
        raise ValueError(f"input files share the stem(s) {dupes}; their arrays would collide")
    out = Path(out_dir)
    check_replaceable(out, overwrite)  # fail before the (long) first pass
    t0 = time.perf_counter()
    opts = ParseOptions(skip_bad_rows, block_bytes, max_ind_range, MAX_REPORTED_BAD_ROWS)
    spans = [
        Span(i, p, start, end)
        for i, p in enumerate(paths)
        for start, end in line_spans(p, _span_count(p, workers, span_bytes))
    ]
    with _worker_pool(workers) as pool:
        counted = _count_pass(pool, spans, paths, stems, opts, frequency_threshold, verbose)
        t1 = time.perf_counter()
        with atomic_dataset_dir(out, overwrite=overwrite) as tmp:
            _write_pass(pool, counted, tmp, opts, frequency_threshold, verbose)
            meta = base_meta(
                fmt,
                counted.num_embeddings,
                counted.infos,
                {
                    "frequency_threshold": frequency_threshold,
                    "max_ind_range": max_ind_range,
                    "skip_bad_rows": skip_bad_rows,
                },
                reserved_rare=frequency_threshold > 0,
            )
            meta["distinct_values"] = counted.distinct
            total_rows = sum(int(f["rows"]) for f in counted.infos)
            freqs = [
                id_frequency(m, v, c, total_rows, top_ids)
                for m, (v, c) in zip(counted.id_maps, counted.value_counts, strict=True)
            ]
            meta["frequency"] = frequency_meta(freqs, "counted", top_ids)
            meta["bad_rows"] = {"count": counted.bad_count, "first": counted.bad_first}
            meta["seconds"] = {"count_pass": round(t1 - t0, 3), "write_pass": round(time.perf_counter() - t1, 3)}
            meta.update(extra_meta or {})
            write_meta(tmp, meta)
    return meta


@dataclass
class _Counted:
    """What pass 1 learns: per-file info (meta.json ``files``), where each span's rows go, the
    vocabulary, and the malformed rows."""

    infos: list[dict[str, Any]]
    parts: list[SpanRows]
    id_maps: list[IdMap]
    value_counts: list[tuple[np.ndarray, np.ndarray]]  # per feature: sorted raw values, their counts
    distinct: list[int]
    bad_count: int
    bad_first: list[str]

    @property
    def num_embeddings(self) -> list[int]:
        return [m.num_embeddings for m in self.id_maps]


def _count_pass(
    pool: ProcessPoolExecutor | None,
    spans: list[Span],
    paths: list[str],
    stems: list[str],
    opts: ParseOptions,
    threshold: int,
    verbose: bool,
) -> _Counted:
    """Pass 1: validate, count rows/positives/bad rows and the raw values of each feature; spans'
    results are taken in file order, which turns their own line numbers into the file's."""
    counters = [ValueCounter() for _ in range(NUM_SPARSE)]
    infos: list[dict[str, Any]] = [
        {"stem": stem, "source": os.path.abspath(p), "bytes": os.path.getsize(p), "rows": 0, "positives": 0}
        for p, stem in zip(paths, stems, strict=True)
    ]
    lines = [0] * len(paths)  # lines of each file counted so far
    bad: list[list[str]] = [[] for _ in paths]
    bad_count = 0
    parts: list[SpanRows] = []
    results = _ordered_map(pool, functools.partial(count_span, opts=opts), spans)
    for k, span in enumerate(spans):
        info, first_line = infos[span.file], lines[span.file] + 1
        try:
            counts = next(results)
        except CriteoFormatError as e:  # the span numbered its lines from 1
            raise CriteoFormatError(e.path, e.line + first_line - 1, e.reason) from None
        parts.append(SpanRows(span, first_line, info["stem"], info["rows"], counts.rows))
        info["rows"] += counts.rows
        info["positives"] += counts.positives
        lines[span.file] += counts.lines
        bad_count += counts.n_bad
        bad[span.file] += [f"{span.path}:{line + first_line - 1}: {why}" for line, why in counts.bad]
        for counter, (values, n) in zip(counters, counts.values, strict=True):
            counter.add_counts(values, n)
        if k + 1 == len(spans) or spans[k + 1].file != span.file:
            _log(verbose, f"pass 1: {span.path}: {info['rows']} rows, {info['positives']} positives")
    bad_first = [line for file_bad in bad for line in file_bad[:MAX_REPORTED_BAD_ROWS]][:MAX_REPORTED_BAD_ROWS]
    if bad_count:
        print(
            f"dlrm-preprocess: skipped {bad_count} malformed rows; first: " + "; ".join(bad_first[:3]), file=sys.stderr
        )
    results_by_feature = [c.result() for c in counters]
    return _Counted(
        infos,
        parts,
        [IdMap.from_counts(values, n, threshold) for values, n in results_by_feature],
        results_by_feature,
        [len(values) for values, _ in results_by_feature],
        bad_count,
        bad_first,
    )


def id_frequency(
    id_map: IdMap, values: np.ndarray, counts: np.ndarray, rows: int, top_n: int = DEFAULT_TOP_N
) -> FeatureFrequency:
    """A feature's id frequencies from its raw value counts: values map to ids as in the arrays
    (rare values pool on the rare id), and the ``rows`` minus the counted values are missing (id 0)."""
    ids = id_map(values, np.zeros(len(values), dtype=bool))
    uniq, inverse = np.unique(np.append(ids, MISSING_ID), return_inverse=True)
    summed = np.bincount(inverse, weights=np.append(counts, rows - int(counts.sum()))).astype(np.int64)
    return FeatureFrequency.from_counts(uniq, summed, top_n)


def _write_pass(
    pool: ProcessPoolExecutor | None, counted: _Counted, tmp: Path, opts: ParseOptions, threshold: int, verbose: bool
) -> None:
    """Pass 2: parse again; each span writes its rows of its file's arrays in place."""
    ids_dtype = sparse_dtype(counted.num_embeddings)
    for info in counted.infos:
        for kind, row_shape, dtype in (
            ("dense", (NUM_DENSE,), DENSE_DTYPE),
            ("sparse", (NUM_SPARSE,), ids_dtype),
            ("labels", (), LABEL_DTYPE),
        ):
            create_npy(array_path(tmp, info["stem"], kind), info["rows"], row_shape, dtype)
    parts = counted.parts
    with tempfile.TemporaryDirectory(prefix=f"{tmp.name}.vocab-", dir=tmp.parent) as vocab_dir:
        if pool is None:
            write = functools.partial(write_span, out_dir=tmp, id_maps=counted.id_maps, opts=opts)
        else:  # workers map the vocabulary from files instead of each receiving a copy
            save_id_maps(counted.id_maps, Path(vocab_dir))
            write = functools.partial(
                write_span_from_saved, out_dir=tmp, vocab_dir=vocab_dir, threshold=threshold, opts=opts
            )
        for k, _ in enumerate(_ordered_map(pool, write, parts)):
            if k + 1 == len(parts) or parts[k + 1].span.file != parts[k].span.file:
                _log(verbose, f"pass 2: {parts[k].span.path}: wrote {parts[k].stem}_*.npy")


def _span_count(path: str, workers: int, span_bytes: int) -> int:
    """Spans of at most ``span_bytes``; a file big enough to share is cut into a multiple of
    ``workers`` spans, so that the workers finish together."""
    size = os.path.getsize(path)
    n = max(1, -(-size // span_bytes))
    if workers > 1 and size >= workers * MIN_SHARED_BYTES:
        n = -(-n // workers) * workers
    return n


@contextlib.contextmanager
def _worker_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """``workers`` spawned processes (None: work in this process). A worker that dies (killed for
    memory, say) fails the run instead of hanging it; on any error, queued spans are dropped."""
    if workers == 1:
        yield None
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _ordered_map(pool: ProcessPoolExecutor | None, fn: Callable[[Any], T], items: Sequence[Any]) -> Iterator[T]:
    """``fn`` over ``items``, results in order (an item's exception is raised at its turn)."""
    return map(fn, items) if pool is None else pool.map(fn, items)


def _sample_matches(meta: dict[str, Any]) -> bool:
    files = {f["stem"]: f for f in meta.get("files", [])}
    return (
        meta.get("sample") == SAMPLE_DIR.name
        and meta.get("options") == {"frequency_threshold": 0, "max_ind_range": 0, "skip_bad_rows": False}
        and "frequency" in meta  # older copies lack the id frequencies
        and list(files) == list(SAMPLE_STEMS)
        and all(files[s]["bytes"] == (SAMPLE_DIR / f"{s}.tsv").stat().st_size for s in SAMPLE_STEMS)
    )


def prepare_sample(out_dir: str | os.PathLike) -> Path:
    """Preprocess the bundled 8,000-row Kaggle sample (stems train, dev, test) into ``out_dir``.

    Idempotent: returns at once when ``out_dir`` already holds this sample built with the same
    options and format version; rebuilds an outdated copy of the sample; refuses to replace any
    other dataset.
    """
    out = Path(out_dir)
    if is_complete(out):
        try:  # any version: an outdated copy of the sample is rebuilt, not refused
            meta = json.loads((out / META).read_text())
        except (OSError, json.JSONDecodeError):
            meta = {}
        if meta.get("version") == FORMAT_VERSION and _sample_matches(meta):
            return out
        if meta.get("sample") != SAMPLE_DIR.name:
            raise FileExistsError(f"{out} holds another dataset; choose another directory for the sample")
    try:
        preprocess(
            [SAMPLE_DIR / f"{s}.tsv" for s in SAMPLE_STEMS],
            out,
            fmt="kaggle",
            overwrite=True,
            extra_meta={"sample": SAMPLE_DIR.name},
        )
    except FileExistsError:  # another process finished the same sample first
        if not (is_complete(out) and _sample_matches(read_meta(out))):
            raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (errors go to stderr, status 1)."""
    p = argparse.ArgumentParser(
        prog="dlrm-preprocess",
        description="Convert raw Criteo TSV files (Kaggle train.txt split, or Terabyte day_N) into "
        "per-file numpy arrays with a vocabulary shared by all given files.",
    )
    p.add_argument("--format", required=True, choices=FORMATS, help="which Criteo data set the files come from")
    p.add_argument("--out", required=True, help="output directory (appears only when complete)")
    p.add_argument("files", nargs="+", help="TSV files (.gz allowed); each gives <stem>_{dense,sparse,labels}.npy")
    p.add_argument(
        "--frequency-threshold",
        type=int,
        default=0,
        help="map values seen fewer than T times to the shared id 1 (0: keep all)",
    )
    p.add_argument("--max-ind-range", type=int, default=0, help="hash raw values modulo M first (0: off)")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip and count malformed rows instead of stopping")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    p.add_argument(
        "--block-mb",
        type=float,
        default=DEFAULT_BLOCK_BYTES / 2**20,
        help="read size per block; bounds the parser's memory",
    )
    p.add_argument("--workers", type=int, default=1, help="processes sharing each pass (same output for any number)")
    p.add_argument(
        "--top-ids",
        type=int,
        default=DEFAULT_TOP_N,
        help="ids per feature whose counts meta.json's frequency keeps exactly (the tail is summarised)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    a = p.parse_args(argv)
    try:
        meta = preprocess(
            a.files,
            a.out,
            a.format,
            frequency_threshold=a.frequency_threshold,
            max_ind_range=a.max_ind_range,
            skip_bad_rows=a.skip_bad_rows,
            overwrite=a.overwrite,
            block_bytes=max(int(a.block_mb * 2**20), 1 << 10),
            verbose=not a.quiet,
            workers=a.workers,
            top_ids=a.top_ids,
        )
    except (CriteoFormatError, DatasetError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"dlrm-preprocess: error: {e}", file=sys.stderr)
        return 1
    except BrokenProcessPool:
        print("dlrm-preprocess: error: a worker process died (out of memory?); try fewer --workers", file=sys.stderr)
        return 1
    if not a.quiet:
        rows = ", ".join(f"{f['stem']}={f['rows']}" for f in meta["files"])
        secs = sum(meta["seconds"].values())
        print(
            f"wrote {a.out}: rows {rows}; table sizes {meta['num_embeddings']}; "
            f"{meta['bad_rows']['count']} bad rows skipped; {secs:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
