"""``dlrm-preprocess``: raw Criteo TSV files -> per-file numpy arrays with a shared vocabulary.

Two streaming passes over the input: the first parses and validates every row and counts the
raw values of each categorical feature over ALL files (so train/dev/test share ids), the second
parses again and writes ``<stem>_{dense,sparse,labels}.npy`` block by block. Memory depends on
the block size and the number of distinct values, never on the number of rows. TorchRec's
Criteo helpers are deliberately not used: its Kaggle parser silently treats any path containing
"test" as unlabeled, its dense transform shifts by each file's minimum, and it loads whole files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.layout import (
    DENSE_DTYPE,
    FORMAT_VERSION,
    LABEL_DTYPE,
    META,
    NUM_DENSE,
    NUM_SPARSE,
    DatasetError,
    NpyWriter,
    array_path,
    atomic_dataset_dir,
    base_meta,
    check_replaceable,
    is_complete,
    read_meta,
    sparse_dtype,
    transform_dense,
    write_meta,
)
from data.tsv import DEFAULT_BLOCK_BYTES, CriteoFormatError, read_chunks
from data.vocab import IdMap, ValueCounter

FORMATS = ("kaggle", "terabyte")
SAMPLE_DIR = Path(__file__).resolve().parent / "sample" / "kaggle_head8000"
SAMPLE_STEMS = ("train", "dev", "test")
MAX_REPORTED_BAD_ROWS = 10


def file_stem(path: str | os.PathLike) -> str:
    """The stem naming a file's arrays: its name without directory, ``.gz`` and last suffix."""
    name = Path(os.fspath(path)).name
    if name.endswith(".gz"):
        name = name[:-3]
    return Path(name).stem


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
) -> dict[str, Any]:
    """Convert Criteo TSV ``files`` into a dataset directory ``out_dir``; return its meta.json.

    ``frequency_threshold`` T > 0 maps values seen fewer than T times (over all files) to id 1;
    ``max_ind_range`` M > 0 replaces each raw hash by ``hash % M`` first. A malformed row raises
    CriteoFormatError naming file and line unless ``skip_bad_rows``. ``out_dir`` appears only
    when complete; an existing dataset there is kept unless ``overwrite``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if frequency_threshold < 0 or max_ind_range < 0:
        raise ValueError("frequency_threshold and max_ind_range must be >= 0")
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

    def chunks(path: str):
        return read_chunks(
            path, skip_bad_rows=skip_bad_rows, block_bytes=block_bytes, max_reported=MAX_REPORTED_BAD_ROWS
        )

    def raw_sparse(chunk, f: int) -> np.ndarray:
        v = chunk.sparse[:, f]
        return v % np.uint64(max_ind_range) if max_ind_range else v

    # Pass 1: validate, count rows/positives/bad rows, count raw values per feature.
    counters = [ValueCounter() for _ in range(NUM_SPARSE)]
    infos: list[dict[str, Any]] = []
    bad_count, bad_first = 0, []
    for path, stem in zip(paths, stems, strict=True):
        rows = positives = 0
        for chunk in chunks(path):
            rows += len(chunk.labels)
            positives += int(chunk.labels.sum())
            bad_count += chunk.n_bad
            bad_first += chunk.bad
            for f in range(NUM_SPARSE):
                counters[f].add(raw_sparse(chunk, f)[~chunk.sparse_missing[:, f]])
        infos.append(
            {
                "stem": stem,
                "source": os.path.abspath(path),
                "bytes": os.path.getsize(path),
                "rows": rows,
                "positives": positives,
            }
        )
        _log(verbose, f"pass 1: {path}: {rows} rows, {positives} positives")
    if bad_count:
        print(
            f"dlrm-preprocess: skipped {bad_count} malformed rows; first: " + "; ".join(bad_first[:3]), file=sys.stderr
        )
    id_maps = []
    distinct = []
    for c in counters:
        values, counts = c.result()
        distinct.append(len(values))
        id_maps.append(IdMap(values, counts, frequency_threshold))
    del counters
    num_embeddings = [m.num_embeddings for m in id_maps]
    ids_dtype = sparse_dtype(num_embeddings)
    t1 = time.perf_counter()

    # Pass 2: parse again and write the arrays of each file.
    with atomic_dataset_dir(out, overwrite=overwrite) as tmp:
        for path, info in zip(paths, infos, strict=True):
            stem, rows = info["stem"], info["rows"]
            writers = [
                NpyWriter(array_path(tmp, stem, "dense"), rows, (NUM_DENSE,), DENSE_DTYPE),
                NpyWriter(array_path(tmp, stem, "sparse"), rows, (NUM_SPARSE,), ids_dtype),
                NpyWriter(array_path(tmp, stem, "labels"), rows, (), LABEL_DTYPE),
            ]
            for chunk in chunks(path):
                ids = np.empty((len(chunk.labels), NUM_SPARSE), dtype=ids_dtype)
                for f in range(NUM_SPARSE):
                    ids[:, f] = id_maps[f](raw_sparse(chunk, f), chunk.sparse_missing[:, f])
                writers[0].write(transform_dense(chunk.dense))
                writers[1].write(ids)
                writers[2].write(chunk.labels)
            for w in writers:
                w.close()  # raises if the file changed between the passes
            _log(verbose, f"pass 2: {path}: wrote {stem}_*.npy")
        meta = base_meta(
            fmt,
            num_embeddings,
            infos,
            {
                "frequency_threshold": frequency_threshold,
                "max_ind_range": max_ind_range,
                "skip_bad_rows": skip_bad_rows,
            },
            reserved_rare=frequency_threshold > 0,
        )
        meta["distinct_values"] = distinct
        meta["bad_rows"] = {"count": bad_count, "first": bad_first[:MAX_REPORTED_BAD_ROWS]}
        meta["seconds"] = {"count_pass": round(t1 - t0, 3), "write_pass": round(time.perf_counter() - t1, 3)}
        meta.update(extra_meta or {})
        write_meta(tmp, meta)
    return meta


def _sample_matches(meta: dict[str, Any]) -> bool:
    files = {f["stem"]: f for f in meta.get("files", [])}
    return (
        meta.get("sample") == SAMPLE_DIR.name
        and meta.get("options") == {"frequency_threshold": 0, "max_ind_range": 0, "skip_bad_rows": False}
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
        )
    except (CriteoFormatError, DatasetError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"dlrm-preprocess: error: {e}", file=sys.stderr)
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
