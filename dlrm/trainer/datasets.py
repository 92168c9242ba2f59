"""Resolve the `data` config group to a preprocessed array directory and its splits."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from data.frequency import DEFAULT_TOP_N, FeatureFrequency, estimate_from_batches, read_frequency
from data.loader import CriteoBatches, criteo_batches, dataset_info, parse_stem
from data.preprocess import prepare_sample
from dlrm.process.env import DistEnv
from dlrm.process.timeout import named_collective

log = logging.getLogger("dlrm.trainer.datasets")


def _cache_dir(cfg: Mapping[str, Any], what: str, options: Mapping[str, Any]) -> Path:
    root = Path(os.path.expanduser(cfg.get("cache_dir") or "~/.cache/dlrm-compress"))
    key = hashlib.sha1(json.dumps(options, sort_keys=True).encode()).hexdigest()[:10]
    return root / f"{what}-{key}"


def prepare_data(cfg: Mapping[str, Any], env: DistEnv) -> Path:
    """The array directory for this config; rank 0 builds cached data, the others wait for it."""
    name = cfg["name"]
    if name == "criteo":
        if not cfg.get("processed_dir"):
            raise ValueError("data=criteo needs data.processed_dir=DIR (the output of dlrm-preprocess)")
        path = Path(cfg["processed_dir"]).expanduser()
        if not (path / "meta.json").exists():
            raise FileNotFoundError(f"data.processed_dir={path} has no meta.json: run dlrm-preprocess first")
        return path
    if name == "criteo_sample":
        path = _cache_dir(cfg, "criteo_sample", {"v": 1})

        def build() -> None:
            prepare_sample(path)

    elif name == "synthetic":
        options = {k: cfg[k] for k in ("rows", "max_cardinality", "seed", "positive_rate")}
        options["rows"] = dict(options["rows"])
        path = _cache_dir(cfg, "synthetic", {**options, "v": 2})  # v2: meta.json records id frequencies
        from data.synthetic import generate

        def build() -> None:
            if not (path / "meta.json").exists():
                generate(
                    path,
                    rows=options["rows"],
                    seed=int(options["seed"]),
                    max_cardinality=options["max_cardinality"],
                    positive_rate=float(options["positive_rate"]),
                )

    else:
        raise ValueError(f"data.name must be criteo, criteo_sample or synthetic (got {name!r})")
    if env.is_main:
        build()
    if dist.is_initialized():
        with named_collective("the barrier while rank 0 prepares the data cache (raise comm_timeout_s for large data)"):
            dist.barrier()
    return path


def split_stems(cfg: Mapping[str, Any], info: Mapping[str, Any], path: Path) -> dict[str, list[str]]:
    """train/val/test stems from the config, checked against the dataset's files."""
    available = [f["stem"] for f in info["files"]]
    splits = {}
    for split in ("train", "val", "test"):
        stems = list(cfg.get(f"{split}_stems") or [])
        if not stems:
            raise ValueError(f"data.{split}_stems is empty; {path} has stems {available}")
        missing = [s for s in stems if parse_stem(s)[0] not in available]
        if missing:
            raise ValueError(f"data.{split}_stems names {missing}, but {path} has only {available}")
        splits[split] = stems
    return splits


@dataclass(frozen=True)
class RunData:
    """One rank's view of the run's dataset: its tables and the batches of each split."""

    path: Path
    info: Mapping[str, Any]
    splits: Mapping[str, list[str]]
    rank: int
    world_size: int
    seed: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], env: DistEnv, seed: int) -> RunData:
        path = prepare_data(cfg, env)
        info = dataset_info(path)
        return cls(path, info, split_stems(cfg, info, path), env.rank, env.world_size, int(seed))

    @property
    def features(self) -> list[str]:
        return list(self.info["sparse_features"])

    @property
    def num_embeddings(self) -> list[int]:
        return [int(n) for n in self.info["num_embeddings"]]

    @property
    def num_dense(self) -> int:
        return len(self.info["dense_features"])

    def frequency(
        self, batch_size: int, estimate_batches: int, top_n: int = DEFAULT_TOP_N
    ) -> tuple[list[FeatureFrequency], str]:
        """Per-feature id frequencies and where they come from: meta.json's, or (when it records
        none) estimated from the first ``estimate_batches`` global training batches (``batch_size``
        rows per rank), read alike on every rank so that all of them agree on the hot ids."""
        try:
            recorded = read_frequency(self.info)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from e
        if recorded is not None:
            return recorded, str(self.info["frequency"]["source"])
        everyone = criteo_batches(
            self.path, self.splits["train"], batch_size * self.world_size, 0, 1, shuffle=False, seed=0
        )
        freqs, rows = estimate_from_batches(itertools.islice(iter(everyone), estimate_batches), top_n)
        if self.rank == 0:
            log.info(
                "%s records no id frequencies: estimated from the first %d training batches (%d rows) "
                "(placement.estimate_batches)",
                self.path,
                estimate_batches,
                rows,
            )
        return freqs, "batches"

    def batches(
        self, split: str, batch_size: int, epoch: int = 0, start: int = 0, shuffle: bool = False
    ) -> CriteoBatches:
        """This rank's batches of ``split`` in ``epoch``, from batch ``start`` on."""
        return criteo_batches(
            self.path,
            self.splits[split],
            batch_size,
            self.rank,
            self.world_size,
            shuffle=shuffle,
            seed=self.seed,
            epoch=epoch,
            start_batch=start,
        )


__all__ = ["RunData", "criteo_batches", "dataset_info", "prepare_data", "split_stems"]
