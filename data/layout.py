"""The on-disk dataset format shared by the preprocessor, the synthetic generator and the loader.

A dataset directory holds, per stem (one input file or one generated split):
``<stem>_dense.npy`` float32 [n, 13], ``<stem>_sparse.npy`` int32 (int64 when a table has 2^31
ids or more) [n, 26] of contiguous per-feature ids, ``<stem>_labels.npy`` uint8 [n] (0/1), and
one ``meta.json`` written last: a directory without ``meta.json`` is not a dataset.
Directories are built under a hidden temporary sibling and renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

FORMAT_VERSION = 1
NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = [f"int_{i}" for i in range(NUM_DENSE)]
SPARSE_NAMES = [f"cat_{i}" for i in range(NUM_SPARSE)]
META = "meta.json"
DENSE_DTYPE = np.dtype(np.float32)
LABEL_DTYPE = np.dtype(np.uint8)
MISSING_ID = 0  # reserved id of an empty categorical field, in every table
RARE_ID = 1  # reserved id of values seen fewer than frequency_threshold times (threshold > 0 only)
DENSE_TRANSFORM = "log(max(x, 0) + 1) in float64, rounded to float32; missing -> 0"


def transform_dense(raw: np.ndarray) -> np.ndarray:
    """log(max(x, 0) + 1) as the DLRM reference does (one transform for every file), float32."""
    return np.log1p(np.maximum(raw, 0).astype(np.float64)).astype(DENSE_DTYPE)


class DatasetError(ValueError):
    """A dataset directory is missing, incomplete or inconsistent."""


def array_path(data_dir: str | os.PathLike, stem: str, kind: str) -> Path:
    """Path of one array of a stem; ``kind`` is dense, sparse or labels."""
    if kind not in ("dense", "sparse", "labels"):
        raise ValueError(f"unknown array kind {kind!r}")
    return Path(data_dir) / f"{stem}_{kind}.npy"


def sparse_dtype(num_embeddings: list[int]) -> np.dtype:
    """int32 ids unless some table needs ids of 2^31 or more."""
    return np.dtype(np.int32 if max(num_embeddings, default=0) <= 2**31 else np.int64)


def read_meta(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Load ``meta.json`` of a complete dataset, or raise DatasetError naming the directory."""
    path = Path(data_dir) / META
    if not path.is_file():
        raise DatasetError(f"{data_dir}: no {META}; not a complete dataset (run dlrm-preprocess)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON ({e})") from e
    for key in ("version", "num_embeddings", "sparse_features", "dense_features", "files"):
        if key not in meta:
            raise DatasetError(f"{path}: missing key {key!r}")
    if meta["version"] != FORMAT_VERSION:
        raise DatasetError(f"{path}: format version {meta['version']}, this code reads {FORMAT_VERSION}")
    return meta


def is_complete(data_dir: str | os.PathLike) -> bool:
    """Whether ``data_dir`` holds a finished dataset (its meta.json is written last)."""
    return (Path(data_dir) / META).is_file()


def base_meta(
    fmt: str, num_embeddings: list[int], files: list[dict[str, Any]], options: dict[str, Any], reserved_rare: bool
) -> dict[str, Any]:
    """The meta.json fields common to preprocessed and synthetic datasets."""
    if len(num_embeddings) != NUM_SPARSE:
        raise ValueError(f"expected {NUM_SPARSE} table sizes, got {len(num_embeddings)}")
    return {
        "format": fmt,
        "version": FORMAT_VERSION,
        "dense_features": DENSE_NAMES,
        "sparse_features": SPARSE_NAMES,
        "num_embeddings": [int(n) for n in num_embeddings],
        "reserved_ids": {"missing": MISSING_ID, "rare": RARE_ID if reserved_rare else None},
        "dense_transform": DENSE_TRANSFORM,
        "dtypes": {"dense": DENSE_DTYPE.name, "sparse": sparse_dtype(num_embeddings).name, "labels": LABEL_DTYPE.name},
        "files": files,
        "rows": {f["stem"]: int(f["rows"]) for f in files},
        "options": options,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


class NpyWriter:
    """Append rows to a .npy file of known final shape without holding it in memory.

    The header is written first from the row count, so memory stays flat whatever the size;
    ``close`` fails if fewer or more rows than announced were written. With ``first_row``, the
    writer instead fills rows [first_row, first_row + rows) of a file that ``create_npy`` made,
    so several processes can write one array side by side.
    """

    def __init__(
        self, path: Path, rows: int, row_shape: tuple[int, ...], dtype: np.dtype, first_row: int | None = None
    ) -> None:
        self.path, self.rows, self.row_shape, self.dtype = path, rows, tuple(row_shape), np.dtype(dtype)
        self.written = 0
        if first_row is None:
            self._f: BinaryIO = open(path, "wb")  # noqa: SIM115  (owned by the writer, closed by close())
            np.lib.format.write_array_header_2_0(self._f, _header(rows, self.row_shape, self.dtype))
            return
        self._f = open(path, "r+b")  # noqa: SIM115
        np.lib.format.read_magic(self._f)
        shape, _, file_dtype = np.lib.format.read_array_header_2_0(self._f)
        if shape[1:] != self.row_shape or file_dtype != self.dtype or first_row + rows > shape[0]:
            self._f.close()
            raise ValueError(
                f"{path}: rows {first_row}..{first_row + rows} of {self.dtype} {self.row_shape} do not fit"
            )
        self._f.seek(first_row * self.dtype.itemsize * math.prod(self.row_shape), os.SEEK_CUR)

    def write(self, block: np.ndarray) -> None:
        """Append ``block`` [k, *row_shape], cast to the file's dtype."""
        if block.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path}: block shape {block.shape} does not match rows {self.row_shape}")
        if self.written + len(block) > self.rows:
            raise ValueError(f"{self.path}: more than the announced {self.rows} rows")
        self._f.write(np.ascontiguousarray(block, dtype=self.dtype).tobytes())
        self.written += len(block)

    def close(self) -> None:
        """Close the file, checking that exactly the announced rows were written."""
        self._f.close()
        if self.written != self.rows:
            raise ValueError(f"{self.path}: wrote {self.written} rows, announced {self.rows}")


def _header(rows: int, row_shape: tuple[int, ...], dtype: np.dtype) -> dict[str, Any]:
    return {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (rows, *row_shape)}


def create_npy(path: Path, rows: int, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
    """An unfilled .npy file of ``rows`` rows (header written, size set) for NpyWriter(first_row=...)."""
    dtype = np.dtype(dtype)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(f, _header(rows, tuple(row_shape), dtype))
        f.truncate(f.tell() + rows * dtype.itemsize * math.prod(row_shape))


@contextlib.contextmanager
def atomic_dataset_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out_dir`` to fill; rename it into place on success.

    On any exception the temporary directory is removed and ``out_dir`` is left as it was, so an
    interrupted run never leaves a directory that looks complete. An existing complete dataset
    (or any non-empty directory) is refused unless ``overwrite``.
    """
    out = Path(out_dir)
    check_replaceable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if not is_complete(tmp):
            raise DatasetError(f"{out}: internal error, {META} was not written")
        check_replaceable(out, overwrite)  # again: another process may have finished meanwhile
        old = None
        if out.exists() and any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        os.replace(tmp, out)  # atomic on one file system; replaces an empty directory too
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_replaceable(out: str | os.PathLike, overwrite: bool) -> None:
    """Raise FileExistsError unless ``out`` is absent, empty, or may be overwritten."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        what = "holds a complete dataset" if is_complete(out) else "is a non-empty directory"
        raise FileExistsError(f"{out} {what}; pass --overwrite (overwrite=True) to replace it")


def write_meta(data_dir: Path, meta: dict[str, Any]) -> None:
    """Write meta.json (the completion marker), flushed to disk."""
    path = data_dir / META
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
