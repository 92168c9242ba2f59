"""One direction's codec with its bound policy: chunk ``[rows, D]`` of column blocks <-> payload.

A chunk packs the blocks (tables) one rank sends to one peer; each block gets its own absolute
bound from the policy (times the block's value range in ``rel`` mode). Decode failures become a
:class:`CompressedCommError` naming the source rank, the tables and the iteration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import compression
from dlrm.comm.bounds import BoundFn, absolute_bounds, policy_values
from dlrm.comm.config import DirectionSpec


class CompressedCommError(RuntimeError):
    """A compressed all-to-all payload could not be decoded (or had the wrong shape)."""


class DirectionCodec:
    """The codec, bound policy and dedup switch of one direction (``forward`` or ``backward``)."""

    def __init__(self, spec: DirectionSpec, direction: str, bound_fn: BoundFn | None = None) -> None:
        self.spec = spec
        self.direction = direction
        try:
            self.codec = compression.get_codec(spec.codec, **dict(spec.params))
        except TypeError as e:  # e.g. `compression.backward.codec=none` keeping lossy's params
            raise ValueError(
                f"compression.{direction}.params {dict(spec.params)} do not fit codec "
                f"{spec.codec!r} ({e}); override them, or drop them with "
                f"~compression.{direction}.params"
            ) from None
        self.bounded = bool(getattr(self.codec, "bounded", False))
        if self.bounded and bound_fn is None:
            raise ValueError(
                f"compression.{direction}.codec {spec.codec!r} is error-bounded: it needs a bound "
                f"policy (bound_fn_{direction}=a compression.policies.Policy, or "
                "dlrm.comm.fixed_bound(eb))"
            )
        self.bound_fn = bound_fn
        self.dedup = spec.dedup

    def __repr__(self) -> str:
        return f"DirectionCodec({self.direction}, codec={self.spec.codec!r}, mode={self.spec.mode}, dedup={self.dedup})"

    def policy(self, features: Sequence[str], iteration: int) -> list[float]:
        """The policy's value per feature (absolute bound, or fraction of range in rel mode)."""
        if not self.bounded or self.bound_fn is None:
            return [math.inf] * len(features)
        return policy_values(self.bound_fn, features, self.direction, iteration)

    def bounds(self, chunk: torch.Tensor, widths: Sequence[int], values: Sequence[float]) -> list[float] | None:
        """Absolute per-block bounds for this chunk, or None for unbounded (cast) codecs."""
        if not self.bounded:
            return None
        return absolute_bounds(chunk, widths, values, self.spec.mode)

    def encode(
        self, chunk: torch.Tensor, widths: Sequence[int], bounds: Sequence[float] | None, ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Payload (uint8, 1-D) of one chunk; ``ids`` ``[rows, n_blocks]`` or None (value dedup)."""
        return self.codec.encode(
            chunk.contiguous(),
            None if bounds is None else list(bounds),
            ids if self.dedup else None,
            blocks=list(widths),
        )

    def decode(
        self,
        payload: torch.Tensor,
        shape: tuple[int, int],
        ids: torch.Tensor | None,
        *,
        src: int,
        dst: int,
        features: Sequence[str],
        tables: Sequence[str],
        iteration: int,
        where: str,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode one peer's payload (into ``out``, its window of the merged output, if given),
        checking its shape; any failure names source, tables, iteration."""
        what = (
            f"rank {dst} ({where}): cannot decode the {self.direction} payload ({payload.numel()} "
            f"bytes) from rank {src} carrying tables {list(tables)} (features {list(features)}) at "
            f"iteration {iteration}"
        )
        try:
            out = self.codec.decode(payload, ids if self.dedup else None, out=out)
        except Exception as e:  # any codec failure: name the transfer, keep the cause chained
            raise CompressedCommError(f"{what}: {type(e).__name__}: {e}") from e
        if tuple(out.shape) != tuple(shape):
            raise CompressedCommError(f"{what}: decoded shape {tuple(out.shape)}, expected {tuple(shape)}")
        return out
