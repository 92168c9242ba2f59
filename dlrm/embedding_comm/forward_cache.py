"""``compression.forward.cache``: a receiver-side cache of forward rows, mirrored by the sender.

For single-valued features (a pooled row is one table row, known to both sides by its id), each
rank keeps per peer and table block a :class:`compression.row_cache.RowCache`: as sender a mirror
of what the peer holds, as receiver what it holds from the peer. Both are driven by the same
sequence of unique ids, so they stay identical without extra messages. Per chunk and block, over
its unique ids in ascending order:

* *fresh* (id not held): sent as today;
* *hit* (held, exact value within the block's bound of the held value): nothing but a 0 bit;
* *moved* (held, past the bound): a 1 bit and its difference from the held value, coded with the
  bound less the fp32 rounding of the two sums (:func:`_delta_bound`), so that held + decoded
  difference stays within the bound; a block with no room left (a bound within rounding of its
  values, non-finite values) sends its moved rows whole (flag 0).

Payload: one flag byte per block (1: moved rows travel as differences), the bits of every held
id (packed), then one lossy payload of each block's fresh rows then moved rows, with ids
``fresh ++ moved`` (padded, see :func:`_code`). Only
training forwards use the caches (evaluation sends as today); each rank's caches are part of its
checkpoint (:meth:`ForwardCache.state_dict`), so saving changes nothing and a resumed run matches
an uninterrupted one bit for bit.

Each block is classified, merged and stored in a few whole-array operations on host (numpy)
views of the chunk: the cache path runs on CPU tensors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dlrm.embedding_comm.bounds import host_bounds
from dlrm.embedding_comm.codec import CompressedCommError, DirectionCodec
from dlrm.embedding_comm.stage import Incoming, Outgoing, Stage
from dlrm_compression.dedup import plan_by_ids
from dlrm_compression.row_cache import RowCache

EPS = float(torch.finfo(torch.float32).eps)


class ForwardCache:
    """Every cache of one rank: (role, peer global rank, feature, block) -> rows.

    ``deltas=False`` sends moved rows whole (flag 0), a scheme the probe measures beside the cache.
    """

    def __init__(self, capacity_rows: int = 0, deltas: bool = True) -> None:
        if capacity_rows < 0:
            raise ValueError(
                f"compression.forward.cache.capacity_rows must be >= 0 (0: unlimited), got {capacity_rows}"
            )
        self.capacity_rows = capacity_rows
        self.deltas = deltas
        self.caches: dict[tuple[str, int, str, int], RowCache] = {}

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    def state_dict(self) -> dict[str, Any]:
        """This rank's caches, as [role, peer, feature, block, cache state] (for its checkpoint)."""
        return {"capacity_rows": self.capacity_rows, "caches": [[*k, c.state_dict()] for k, c in self.caches.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.caches = {}
        for role, peer, feature, k, saved in state.get("caches", []):
            cache = RowCache(int(saved["dim"]), self.capacity_rows, saved["rows"].dtype)
            cache.load_state_dict(saved)
            self.caches[(str(role), int(peer), str(feature), int(k))] = cache

    def _cache(self, role: str, peer: int, feature: str, k: int, dim: int, dtype: torch.dtype) -> RowCache:
        return self.caches.setdefault((role, peer, feature, k), RowCache(dim, self.capacity_rows, dtype))

    def encode(
        self,
        dc: DirectionCodec,
        chunk: torch.Tensor,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        bounds: Sequence[float],
        dst: int,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """(payload for global rank ``dst``, the chunk as ``dst`` will decode it, row counts:
        ``unique_rows``, ``held_rows``, ``hit_rows``, ``moved_rows`` sent as differences, each
        also per feature as ``<name>/<feature>``)."""
        if chunk.dtype != torch.float32:  # _delta_bound's rounding margin is fp32's, and numpy has no bf16
            raise TypeError(
                f"compression.forward.cache needs fp32 pooled embeddings, got a {chunk.dtype} chunk "
                "(turn the cache off for this run)"
            )
        firsts, inverse, idn = _unpack(ids)
        x = chunk.detach().numpy()
        flags, bits, sends, sent_ids, coded_bounds, steps = [], [], [], [], [], []
        counts = dict.fromkeys(("unique_rows", "held_rows", "hit_rows", "moved_rows"), 0)
        c = 0
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            rows = firsts[k]
            uid = idn[rows, k]
            cache = self._cache("send", dst, f, k, w, chunk.dtype)
            slots, cached = _look(cache, uid)
            held = slots >= 0
            exact = x[rows, c : c + w]
            # NaN compares false: a row with a NaN (exact or held) is never a hit
            hit = held & (np.abs(exact - cached) <= bounds[k]).all(axis=1)
            moved = held & ~hit
            em, cm = exact[moved], cached[moved]
            room = _delta_bound(em, cm, bounds[k])
            delta = self.deltas and room > 0 and em.shape[0] > 0
            fresh = ~held
            flags.append(int(delta))
            bits.append(moved[held])
            sends.append(np.concatenate([exact[fresh], em - cm if delta else em]))
            sent_ids.append(np.concatenate([uid[fresh], uid[moved]]))
            coded_bounds.append(room if delta else bounds[k])
            steps.append((cache, uid, slots, fresh, moved, cached, delta))
            n_held, n_hit = int(held.sum()), int(hit.sum())
            block = {"unique_rows": uid.size, "held_rows": n_held, "hit_rows": n_hit}
            block["moved_rows"] = n_held - n_hit if delta else 0
            for name, n in block.items():
                counts[name] += n
                counts[f"{name}/{f}"] = counts.get(f"{name}/{f}", 0) + n
            c += w
        inner = _code(dc, sends, sent_ids, widths, coded_bounds)
        out = np.empty(x.shape, dtype=x.dtype)
        _finish(steps, _decode(dc, inner, sent_ids, widths), inverse, widths, out)
        head = np.array(flags, dtype=np.uint8)
        packed = np.packbits(np.concatenate(bits)) if bits else head[:0]
        return torch.cat([torch.from_numpy(head), torch.from_numpy(packed), inner]), torch.from_numpy(out), counts

    def decode(
        self,
        dc: DirectionCodec,
        payload: torch.Tensor,
        ids: torch.Tensor,
        features: Sequence[str],
        widths: Sequence[int],
        src: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chunk global rank ``src`` sent (into ``out`` if given), updating our caches alike."""
        if out is None:
            out = torch.empty(ids.shape[0], sum(widths), dtype=torch.float32)
        firsts, inverse, idn = _unpack(ids)
        nb = len(widths)
        raw = payload.numpy()
        flags = raw[:nb].tolist()
        looked = []
        for k, (f, w) in enumerate(zip(features, widths, strict=True)):
            uid = idn[firsts[k], k]
            cache = self._cache("recv", src, f, k, w, out.dtype)
            looked.append((cache, uid, *_look(cache, uid)))
        n_held = sum(int((s >= 0).sum()) for _, _, s, _ in looked)
        n_bytes = (n_held + 7) // 8
        bits = np.unpackbits(raw[nb : nb + n_bytes], count=n_held).astype(bool)
        inner = payload[nb + n_bytes :].clone()  # aligned (format.view_as fails on an empty misaligned section)
        sent_ids, steps, at = [], [], 0
        for (cache, uid, slots, cached), flag in zip(looked, flags, strict=True):
            held = slots >= 0
            h = int(held.sum())
            moved = np.zeros_like(held)
            moved[held] = bits[at : at + h]
            at += h
            fresh = ~held
            sent_ids.append(np.concatenate([uid[fresh], uid[moved]]))
            steps.append((cache, uid, slots, fresh, moved, cached, bool(flag)))
        _finish(steps, _decode(dc, inner, sent_ids, widths), inverse, widths, out.numpy())
        return out


class CacheStage(Stage):
    """The row cache in the transport: training forwards by id, both sides deciding alike (they
    hold the same ids and training flag); statistics under ``forward/cache/``."""

    def __init__(self, cache: ForwardCache) -> None:
        self.cache = cache

    @staticmethod
    def _applies(direction: str, ids: torch.Tensor | None, dc: DirectionCodec) -> bool:
        return direction == "forward" and ids is not None and dc.dedup

    def encode(self, c: Outgoing) -> bool:
        if not (self._applies(c.direction, c.ids, c.dc) and c.bounds is not None):
            return False
        assert c.ids is not None
        bounds = host_bounds(c.bounds)  # the cache is host-side: it reads the bounds as floats
        assert bounds is not None
        c.payload, c.held, counts = self.cache.encode(
            c.dc, c.chunk, c.ids, c.blocks.features, c.blocks.widths, bounds, c.dst
        )
        for name, n in counts.items():
            if "/" not in name:  # totals (the per-feature counts serve the probe)
                c.stats.add(f"{c.direction}/cache/{name}", n)
        c.stats.maximum(f"{c.direction}/cache_bytes", self.cache.nbytes)
        return True

    def decode(self, r: Incoming) -> torch.Tensor | None:
        if not self._applies(r.direction, r.ids, r.dc):
            return None
        assert r.ids is not None
        try:
            part = self.cache.decode(r.dc, r.payload, r.ids, r.blocks.features, r.blocks.widths, r.src, out=r.window)
        except Exception as e:  # name the transfer, keep the cause chained
            raise CompressedCommError(
                f"rank {r.dst} ({r.where}): cannot decode the row-cached forward payload "
                f"({r.payload.numel()} bytes) from rank {r.src} carrying features {r.blocks.features} at "
                f"iteration {r.iteration}: {type(e).__name__}: {e}"
            ) from e
        r.stats.maximum("forward/cache_bytes", self.cache.nbytes)
        return part


def _unpack(ids: torch.Tensor) -> tuple[list[np.ndarray], np.ndarray | None, np.ndarray]:
    """Host views: each block's first rows of its unique ids (ascending ids: the dedup
    plan's canonical order), the plan's inverse [n_blocks, rows] (None: identity), the ids."""
    plan = plan_by_ids(ids)
    firsts = np.split(plan.first.numpy(), np.cumsum(plan.counts.numpy())[:-1])
    inverse = None if plan.inverse is None else plan.inverse.numpy()
    return firsts, inverse, ids.numpy()


def _look(cache: RowCache, uid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slots, held rows: zeros where not held) of ``uid`` in ``cache``."""
    slots = cache.find(uid)[0].numpy()
    return slots, cache.gather(slots).numpy()


def _delta_bound(exact: np.ndarray, held: np.ndarray, bound: float) -> float:
    """The bound for the differences ``exact - held`` of moved rows: ``bound`` less what fp32
    rounding of ``exact - held`` and of ``held + decoded`` can add (at most ~2.5 eps x the largest
    magnitude; 4 taken). Negative (send whole) where any value is non-finite: a NaN or inf
    difference cannot restore the exact value."""
    if exact.size == 0:
        return bound
    m = float(np.maximum(np.abs(exact).max(), np.abs(held).max()))  # keeps a NaN (Python max() may drop it)
    room = bound - 4 * EPS * m
    return room if math.isfinite(room) else -1.0


def _finish(
    steps: Sequence[tuple],
    values: Sequence[np.ndarray],
    inverse: np.ndarray | None,
    widths: Sequence[int],
    out: np.ndarray,
) -> None:
    """Per block: the unique rows as decoded (held for hits, decoded for fresh, held +
    difference for moved), stored the same way on both sides (which makes every id of the batch
    the most recent), then spread over the chunk's rows into ``out``."""
    c = 0
    for k, (cache, uid, slots, fresh, moved, unique, delta) in enumerate(steps):
        n_fresh, n_moved = int(fresh.sum()), int(moved.sum())
        unique[fresh] = values[k][:n_fresh]  # ``unique`` was the held rows, gathered for this call
        moved_rows = values[k][n_fresh : n_fresh + n_moved]
        unique[moved] = unique[moved] + moved_rows if delta else moved_rows
        cache.store(uid, torch.from_numpy(unique), slots)
        w = widths[k]
        out[:, c : c + w] = unique[inverse[k]] if inverse is not None else unique
        c += w


def _padded_ids(sent_ids: Sequence[np.ndarray]) -> tuple[int, np.ndarray]:
    """[n, n_blocks] ids: shorter blocks repeat their first id, an empty block has id -1."""
    n = max([1, *(i.size for i in sent_ids)])
    out = np.empty((n, len(sent_ids)), dtype=np.int64)
    for k, i in enumerate(sent_ids):
        out[: i.size, k] = i
        out[i.size :, k] = i[0] if i.size else -1
    return n, out


def _code(
    dc: DirectionCodec,
    sends: Sequence[np.ndarray],
    sent_ids: Sequence[np.ndarray],
    widths: Sequence[int],
    bounds: Sequence[float],
) -> torch.Tensor:
    """One lossy payload of each block's rows ``sends[k]`` under ids ``sent_ids[k]``. Shorter
    blocks repeat their first row under its id (dedup sends it once); an empty block carries one
    zero row under id -1."""
    n, ids = _padded_ids(sent_ids)
    cols = np.zeros((n, sum(widths)), dtype=sends[0].dtype if sends else np.float32)
    c = 0
    for s, w in zip(sends, widths, strict=True):
        cols[: s.shape[0], c : c + w] = s
        if s.shape[0]:
            cols[s.shape[0] :, c : c + w] = s[:1]
        c += w
    return dc.encode(torch.from_numpy(cols), widths, list(bounds), torch.from_numpy(ids))


def _decode(
    dc: DirectionCodec, inner: torch.Tensor, sent_ids: Sequence[np.ndarray], widths: Sequence[int]
) -> list[np.ndarray]:
    """Each block's decoded rows of :func:`_code`'s payload (both sides rebuild the same ids)."""
    _, ids = _padded_ids(sent_ids)
    rows = dc.codec.decode(inner, torch.from_numpy(ids)).numpy()
    starts = np.cumsum([0, *widths])
    return [rows[:, a:b] for a, b in itertools.pairwise(starts)]
