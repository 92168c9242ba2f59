"""One direction's codec with its bound policy: chunk ``[rows, D]`` of column blocks <-> payload.

A chunk packs the blocks (tables) one rank sends to one peer; each block gets its own absolute
bound from the policy (times the block's value range in ``rel`` mode). Decode failures become a
:class:`CompressedCommError` naming the source rank, the tables and the iteration.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import dlrm_compression as compression
from dlrm.embedding_comm.bounds import BoundFn, Bounds, absolute_bounds, host_bounds, policy_values
from dlrm.embedding_comm.config import DirectionSpec
from dlrm.embedding_comm.ids import keep_first_duplicates, sum_duplicates
from dlrm.process.config_checks import flag, integer
from dlrm_compression import format as fmt
from dlrm_compression.base import CodecContext
from dlrm_compression.composite import PerBlockCodec, worst_case_error
from dlrm_compression.format import Deferred, HostHead
from dlrm_compression.sparse import Threshold, ThresholdCodec, kth_largest_abs_tensor, refresh_due


class CompressedCommError(RuntimeError):
    """A compressed all-to-all payload could not be decoded (or had the wrong shape)."""


# Smallest positive float32: a threshold that keeps every non-zero entry and drops exact zeros.
NONZERO = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23


class DirectionCodec:
    """The codec, bound policy and dedup switch of one direction (``forward`` or ``backward``).

    With the ``threshold`` codec (DCT-MP, Gupta et al.) the direction keeps per-table thresholds
    instead of bounds: ``params.keep`` (fraction of each table block's entries kept, its threshold
    refreshed every ``params.refresh_every`` iterations from the chunk being sent), or, for the
    gradients, ``params.forward_positions: true`` (send only where the forward kept an entry: the
    derivative of the thresholding).
    """

    def __init__(
        self, spec: DirectionSpec, direction: str, bound_fn: BoundFn | None = None, backend: str = "auto"
    ) -> None:
        self.spec = spec
        self.direction = direction
        params = dict(spec.params)
        self.keep, self.refresh_every, self.refresh_warmup, self.forward_positions = _threshold_params(
            spec, params, direction
        )
        # feature -> (iteration refreshed, threshold: a 0-d tensor on the chunks' device, never read)
        self._taus: dict[str, tuple[int, torch.Tensor]] = {}
        try:
            self.codec = compression.get_codec(spec.codec, backend=backend, **params)
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
                "dlrm.embedding_comm.fixed_bound(eb))"
            )
        self.bound_fn = bound_fn
        self.dedup = spec.dedup
        self.exact = compression.get_codec("none", backend=backend)  # a stored chunk's (store)
        # compression=auto: the option of every feature (the per_block codec's choice; unset: its
        # fallback), and the calibration measurements not yet collected
        self.choice: dict[str, str] = {}
        self.samples: list[tuple[str, str, float, float, float, float, bool]] = []

    def __repr__(self) -> str:
        return f"DirectionCodec({self.direction}, codec={self.spec.codec!r}, mode={self.spec.mode}, dedup={self.dedup})"

    def policy(self, features: Sequence[str], iteration: int) -> list[float]:
        """The policy's value per feature (absolute bound, or fraction of range in rel mode)."""
        if not self.bounded or self.bound_fn is None:
            return [math.inf] * len(features)
        return policy_values(self.bound_fn, features, self.direction, iteration)

    def bounds(self, chunk: torch.Tensor, widths: Sequence[int], values: Sequence[float]) -> Bounds | None:
        """Absolute per-block bounds for this chunk, or None for unbounded (cast) codecs."""
        if not self.bounded:
            return None
        return absolute_bounds(chunk, widths, values, self.spec.mode)

    def thresholds(
        self,
        chunk: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        iteration: int,
        training: bool,
        stage: str,
    ) -> list[Threshold] | None:
        """DCT-MP's per-table thresholds for this chunk (None for every other codec): refreshed
        from a training chunk on schedule (evaluation uses them as they are), or, for gradients,
        the non-zero entries (where the forward kept values). Refreshed thresholds are 0-d
        tensors on the chunk's device: taking one does not wait for the device."""
        if self.forward_positions:
            return [NONZERO] * len(widths)
        if self.keep is None:
            return None
        out: list[Threshold] = []
        c = 0
        for f, w in zip(features, widths, strict=True):
            key = f"{stage}/{f}"
            seen = self._taus.get(key)
            due = (
                refresh_due(iteration, self.refresh_every, self.refresh_warmup)
                and seen is not None
                and seen[0] != iteration
            )
            if seen is None or (training and due):
                tau = kth_largest_abs_tensor(chunk[:, c : c + w], self.keep)
                if not training and seen is None:
                    out.append(tau)  # no threshold yet: this chunk's, not kept
                    c += w
                    continue
                self._taus[key] = (iteration, tau)
            elif self._taus[key][1].device != chunk.device:  # restored from a checkpoint: moved once
                self._taus[key] = (self._taus[key][0], self._taus[key][1].to(chunk.device, non_blocking=True))
            out.append(self._taus[key][1])
            c += w
        return out

    def state_dict(self) -> dict[str, Any]:
        """DCT-MP's thresholds (this rank's: each rank thresholds what it sends), as numbers (a
        checkpoint may wait for the device)."""
        return {"taus": {k: [it, float(tau)] for k, (it, tau) in self._taus.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._taus = {
            str(k): (int(v[0]), torch.tensor(float(v[1]), dtype=torch.float32))
            for k, v in state.get("taus", {}).items()
        }

    def merges_ids(self, device: torch.device) -> bool:
        """Whether the codec itself sums a gradient's rows by id as it encodes and keeps each sum on
        the id's first row as it decodes (the backward's dedup: one op each way on the device),
        rather than the transport's :class:`~dlrm.embedding_comm.codec_stages.DuplicateIds`."""
        return self.direction == "backward" and self.dedup and self.codec.sums_duplicates(device)

    def _context(
        self,
        features: Sequence[str] | None = None,
        thresholds: Sequence[Threshold] | None = None,
        **rest: Any,
    ) -> CodecContext:
        """What this call tells the codec: DCT-MP's thresholds, compression=auto's choice per
        block (its features'; unset: the codec's fallback), and ``rest``."""
        choice = None if features is None or not self.choice else [self.choice.get(f) for f in features]
        return CodecContext(thresholds=None if thresholds is None else list(thresholds), choice=choice, **rest)

    def encode(
        self,
        chunk: torch.Tensor,
        widths: Sequence[int],
        bounds: Bounds | None,
        ids: torch.Tensor | None,
        thresholds: Sequence[Threshold] | None = None,
        features: Sequence[str] | None = None,
        summed: bool = False,
    ) -> torch.Tensor:
        """Payload (uint8, 1-D) of one chunk; ``ids`` ``[rows, n_blocks]`` or None (value dedup);
        ``features`` name the blocks (the per_block codec's choice is per feature); ``summed``:
        each id's rows are sent as their sum (:meth:`merges_ids`)."""
        if summed and ids is not None:
            chunk = sum_duplicates(chunk, ids, widths)
        context = self._context(features, thresholds)
        return self.codec.encode(
            chunk.contiguous(), bounds, ids if self.dedup else None, blocks=list(widths), context=context
        )

    def encode_deferred(
        self,
        chunk: torch.Tensor,
        widths: Sequence[int],
        bounds: Bounds | None,
        ids: torch.Tensor | None,
        thresholds: Sequence[Threshold] | None = None,
        features: Sequence[str] | None = None,
        single: torch.Tensor | None = None,
        summed: bool = False,
    ) -> torch.Tensor | Deferred:
        """:meth:`encode`, with the payload's length left on the device where the codec can
        (:meth:`Codec.encode_deferred`). ``single``: a 0-d bool on the device saying whether
        ``ids`` hold (not read yet: see :meth:`picks_ids_on_device`); ``summed``: see
        :meth:`merges_ids`."""
        keys = ids if self.dedup else None
        context = self._context(features, thresholds, single=None if keys is None else single, summed=summed)
        return self.codec.encode_deferred(chunk.contiguous(), bounds, keys, blocks=list(widths), context=context)

    # Never more bytes than raw: a chunk whose payload is no smaller than its stored form travels
    # stored, the ``none`` codec's payload of one block (the rows as they are, an 80-byte header,
    # still checked). The receiver tells one by its size alone (a coded payload is always
    # smaller), so nothing more is read. Where a stage encodes a chunk it is never stored.

    def stored_size(self, shape: tuple[int, int], dtype: torch.dtype) -> int:
        """Bytes of a stored chunk of ``shape``: every coded payload sent is smaller."""
        rows, cols = shape
        n = rows * cols * dtype.itemsize
        return fmt.head_bytes(1, 1) + n + (-n % 8)

    def stored_first(self, shape: tuple[int, int], dtype: torch.dtype, widths: Sequence[int]) -> bool:
        """Whether a chunk travels stored, known before it is encoded: its payload's size is the
        host's up front (a cast's) and no smaller than its stored form's (then it is not encoded)."""
        known = self.codec.known_size(shape, dtype, list(widths))
        return known is not None and known >= self.stored_size(shape, dtype)

    def store(self, chunk: torch.Tensor) -> torch.Tensor:
        """The stored payload of ``chunk`` (the rows exactly as the peer is to decode them)."""
        return self.exact.encode(chunk.contiguous(), blocks=[chunk.shape[1]])

    def decode_stored(
        self,
        payload: torch.Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype,
        ids: torch.Tensor | None,
        widths: Sequence[int],
        checked: list[tuple[torch.Tensor, str]],
        **naming: Any,
    ) -> torch.Tensor:
        """A stored chunk (into ``naming``'s ``out`` window if given), each id's sum kept on its
        first row where the codec would have done so; a device verdict goes to ``checked`` (read
        with the collective's, :func:`raise_unless_sound`)."""
        out = naming.pop("out", None)
        target = out if out is not None else torch.empty(shape, dtype=dtype, device=payload.device)
        what = self._transfer(payload, **naming)
        try:
            if self.exact.checks_in_decode(payload.device):
                checked.append((self.exact.decode_checked(payload, target, [shape[1]]), what))
            else:
                self.exact.decode(payload, out=target)
        except Exception as e:  # any failure: name the transfer, keep the cause chained
            raise CompressedCommError(f"{what}: {type(e).__name__}: {e}") from e
        if ids is not None and self.dedup and self.merges_ids(payload.device):
            keep_first_duplicates(target, ids, widths)
        return target

    def picks_ids_on_device(self, device: torch.device) -> bool:
        """Whether :meth:`encode_deferred` can be told whether the ids hold by a device flag and
        choose between them and the rows on the device (no host read), or takes no ids at all."""
        return not self.dedup or self.codec.chooses_ids_on_device(device)

    def passthrough(self, features: Sequence[str]) -> bool:
        """compression=auto: every feature of a collective chose ``none``, so it travels as
        TorchRec's all-to-all does (the raw rows; send.send_raw)."""
        return (
            isinstance(self.codec, PerBlockCodec)
            and bool(self.choice)
            and all(self.choice.get(f) == "none" for f in features)
        )

    def calibrate(
        self,
        chunk: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        bounds: Bounds | None,
        ids: torch.Tensor | None,
    ) -> list[tuple[str, str, float, float, float, float, bool]]:
        """compression=auto: every option on every block of a real chunk, as (feature, option, raw
        bytes, wire bytes, encode s, decode s, within the block's bound); and feature ``*``, option
        ``regroup``: gathering and scattering the chunk's columns (the cost of mixing codecs)."""
        bounds = host_bounds(bounds)
        assert isinstance(self.codec, PerBlockCodec) and bounds is not None
        # what mixing codecs costs: the columns gathered by codec, decoded parts scattered back
        perm = torch.randperm(chunk.shape[1], generator=torch.Generator().manual_seed(0)).to(chunk.device)
        t0 = time.perf_counter()
        gathered = chunk.index_select(1, perm)
        t1 = time.perf_counter()
        torch.empty_like(chunk)[:, perm] = gathered
        t2 = time.perf_counter()
        raw = float(chunk.numel() * chunk.element_size())
        out: list[tuple[str, str, float, float, float, float, bool]] = [
            ("*", "regroup", raw, raw, t1 - t0, t2 - t1, True)
        ]
        c = 0
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            block = chunk[:, c : c + w].contiguous()
            sub_ids = None if ids is None or not self.dedup else ids[:, k : k + 1]
            for name, codec in self.codec.options.items():
                if name == "none":  # what a collective all at none costs (passthrough): no codec
                    raw_block = float(block.numel() * block.element_size())
                    out.append((f, name, raw_block, raw_block, 0.0, 0.0, True))
                    continue
                ok = getattr(codec, "bounded", False) or worst_case_error(name, block) <= bounds[k]
                t0 = time.perf_counter()
                payload = codec.encode(block, [bounds[k]], sub_ids, blocks=[w])
                t1 = time.perf_counter()
                codec.decode(payload, sub_ids)
                t2 = time.perf_counter()
                out.append(
                    (f, name, float(block.numel() * block.element_size()), float(payload.numel()), t1 - t0, t2 - t1, ok)
                )
            c += w
        return out

    def kept(self, payload: torch.Tensor, shape: tuple[int, int], head: HostHead | None = None) -> torch.Tensor:
        """Where a received DCT-MP forward payload holds values (bool ``shape``); ``head``: read
        with its collective's (:meth:`prepare_decode`), so that nothing more is read."""
        assert isinstance(self.codec, ThresholdCodec)
        mask = torch.zeros(shape, dtype=torch.bool, device=payload.device)
        mask.view(-1)[self.codec.positions(payload, head)] = True
        return mask

    def prepare_decode(
        self, payload: torch.Tensor, ids: torch.Tensor | None, features: Sequence[str]
    ) -> tuple[torch.Tensor | None, Any] | None:
        """Where decoding ``payload`` can read everything it needs on the host in its collective's
        one read (:func:`dlrm_compression.format.read_heads`): the device values to read with its
        head and the state that goes with them; else None (it reads for itself)."""
        return self.codec.prepare_decode(payload, ids if self.dedup else None, self._context(features))

    def prepared(
        self, payload: torch.Tensor, ids: torch.Tensor | None, features: Sequence[str]
    ) -> tuple[int, torch.Tensor | None, Any] | None:
        """:meth:`prepare_decode` with the bytes of the payload's head to read with it, as a
        stage's ``prepare_decode`` gives them; None where the codec reads for itself."""
        codec = self.prepare_decode(payload, ids, features)
        return None if codec is None else (self.head_size(len(features)), *codec)

    def block_bytes(self, payload: torch.Tensor, widths: Sequence[int], head: HostHead | None = None) -> torch.Tensor:
        """Each block's share of one of this direction's payloads, summing to its length
        (:meth:`dlrm_compression.base.Codec.block_bytes`); ``head``: read already."""
        return self.codec.block_bytes(payload, list(widths), head)

    def checks_in_decode(self, device: torch.device) -> bool:
        """Whether its payloads are decoded with no head read first, their verdicts read after
        every decode of the collective (:meth:`decode_checked`, :func:`raise_unless_sound`)."""
        return self.codec.checks_in_decode(device)

    def decode_checked(
        self,
        payload: torch.Tensor,
        shape: tuple[int, int],
        dtype: torch.dtype,
        widths: Sequence[int],
        ids: torch.Tensor | None = None,
        **naming: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where :meth:`checks_in_decode`: one peer's payload decoded (into ``naming``'s ``out``
        window if given) and its verdict, unread; a payload of the wrong size fails at once with
        :meth:`decode`'s message. Where the codec merges ids (:meth:`merges_ids`) each id's sum
        lands on its first row of ``ids`` alone, in the same op."""
        out = naming.pop("out", None)
        target = out if out is not None else torch.empty(shape, dtype=dtype, device=payload.device)
        keys = ids if self.dedup and self.merges_ids(payload.device) else None
        context = CodecContext(keep_first=keys is not None)
        try:
            return target, self.codec.decode_checked(payload, target, list(widths), context, ids=keys)
        except Exception as e:  # any codec failure: name the transfer, keep the cause chained
            raise CompressedCommError(f"{self._transfer(payload, **naming)}: {type(e).__name__}: {e}") from e

    def _transfer(
        self,
        payload: torch.Tensor,
        *,
        src: int,
        dst: int,
        features: Sequence[str],
        tables: Sequence[str],
        iteration: int,
        where: str,
    ) -> str:
        """What names a payload in an error: its receiver, sender, tables and iteration."""
        return (
            f"rank {dst} ({where}): cannot decode the {self.direction} payload ({payload.numel()} "
            f"bytes) from rank {src} carrying tables {list(tables)} (features {list(features)}) at "
            f"iteration {iteration}"
        )

    def head_size(self, n_blocks: int) -> int:
        """Bytes of a payload of ``n_blocks`` blocks its decoder reads with the collective's heads
        (with :meth:`prepare_decode`)."""
        size = self.codec.head_size(n_blocks)
        assert size is not None, f"codec {self.spec.codec!r} prepares no decode"  # (prepare_decode said None)
        return size

    def decode(
        self,
        payload: torch.Tensor,
        shape: tuple[int, int],
        ids: torch.Tensor | None,
        *,
        head: HostHead | None = None,
        src: int,
        dst: int,
        features: Sequence[str],
        tables: Sequence[str],
        iteration: int,
        where: str,
        out: torch.Tensor | None = None,
        keep_first: bool = True,
    ) -> torch.Tensor:
        """Decode one peer's payload (into ``out``, its window of the merged output, if given),
        checking its shape; any failure names source, tables, iteration. Where the codec merges
        ids (:meth:`merges_ids`) each id's sum lands on its first row alone (``keep_first``; off:
        on every row of the id, as the sender's own check of what it sent reads it)."""
        what = self._transfer(
            payload, src=src, dst=dst, features=features, tables=tables, iteration=iteration, where=where
        )
        keys = ids if self.dedup else None
        context = CodecContext(keep_first=keep_first and keys is not None and self.merges_ids(payload.device))
        try:
            out = self.codec.decode(payload, keys, out=out, head=head, context=context)
        except Exception as e:  # any codec failure: name the transfer, keep the cause chained
            raise CompressedCommError(f"{what}: {type(e).__name__}: {e}") from e
        if tuple(out.shape) != tuple(shape):
            raise CompressedCommError(f"{what}: decoded shape {tuple(out.shape)}, expected {tuple(shape)}")
        return out


def raise_unless_sound(checked: Sequence[tuple[torch.Tensor, str]]) -> None:
    """Read every verdict of a collective's :meth:`DirectionCodec.decode_checked` at once (one
    host read) and raise, naming the transfer (``checked``: (verdict, what names it)), where one
    payload is not sound; before the caller uses any decoded value."""
    if not checked:
        return
    verdicts = checked[0][0] if len(checked) == 1 else torch.stack([v for v, _ in checked])
    for held, (_, what) in zip(verdicts.reshape(len(checked), -1).tolist(), checked, strict=True):
        if not all(held):
            why = "checksum mismatch: the payload is corrupted" if not held[0] else "not the header expected"
            raise CompressedCommError(f"{what}: PayloadError: {why}")


def abs_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| with equal non-finite values (nan/nan, inf/inf) counted as 0 and mismatches as inf."""
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    err = (a - b).abs()
    return torch.where(same, torch.zeros_like(err), torch.nan_to_num(err, nan=torch.inf))


def _threshold_params(spec: DirectionSpec, params: dict, direction: str) -> tuple[float | None, int, bool, bool]:
    """Pop DCT-MP's own keys from a threshold codec's params (the rest go to the codec)."""
    if spec.codec != "threshold":
        return None, 1, False, False
    popped = {k: params.pop(k, None) for k in ("keep", "refresh_every", "refresh_warmup", "forward_positions")}
    own = {k: v for k, v in popped.items() if v is not None}  # null: the default
    where = f"compression.{direction}.params"
    keep, positions = own.get("keep"), flag(own, "forward_positions", where, False)
    if positions and direction != "backward":
        raise ValueError(f"{where}.forward_positions applies to the backward (gradients) only")
    if positions and ("refresh_every" in own or "refresh_warmup" in own):
        raise ValueError(
            f"{where}.refresh_every/refresh_warmup have no effect with forward_positions "
            "(the forward's thresholds decide)"
        )
    if positions == (keep is not None):
        raise ValueError(
            f"{where}: the threshold codec needs either keep (a fraction of each table's entries) "
            "or, backward, forward_positions: true"
        )
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1):
        raise ValueError(f"{where}.keep must be a fraction in (0, 1], got {keep!r}")
    refresh = integer(own, "refresh_every", where, 1000, minimum=1)
    warmup = flag(own, "refresh_warmup", where, True)
    return (None if keep is None else float(keep)), refresh, warmup, positions
