"""What the dense hooks report (``dense/*`` keys of :mod:`dlrm.embedding_comm.stats`).

``raw_bytes`` is what stock DDP's ring all-reduce of fp32 gradients sends per rank (2 (W-1)/W x 4
bytes per element), ``wire_bytes`` what the chosen hook sends (a ring all-reduce of the cast or
low-rank factors; for DCT the all-gather of the padded payloads, (W-1) x the largest, plus the
size words; with the reduce-scatter, its all-to-all's payloads and size words too); ``codec_ms``
the host time of encoding and decoding, ``comm_ms`` the time from launch to arrival (it overlaps
the rest of the backward). DCT adds ``kept``/``numel`` (-> ``keep``), the largest ``threshold``
and ``residual_norm`` (the L2 norm of this rank's residuals after the iteration, largest over
ranks). The statistics are written under a lock from the collectives' callbacks and read at log
time, after DDP has waited for every bucket's future (so a read never races a write).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from dlrm.embedding_comm.stats import CommStats

Future = torch.futures.Future


class DenseStats(CommStats):
    """The hooks' :class:`CommStats`, written from the hook and from the collectives' threads."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def record(
        self,
        *,
        raw: float | None = None,
        wire: float | None = None,
        codec_ms: float | None = None,
        comm_ms: float | None = None,
        kept: int | None = None,
        numel: int | None = None,
        threshold: float | None = None,
        residual_norm: float | None = None,
    ) -> None:
        """Add the sums given (``raw`` also counts a call) and raise the maxima given."""
        with self._lock:
            for name, value in (
                ("raw_bytes", raw),
                ("wire_bytes", wire),
                ("codec_ms", codec_ms),
                ("comm_ms", comm_ms),
                ("kept", kept),
                ("numel", numel),
            ):
                if value is not None:
                    self.add(f"dense/{name}", float(value))
            if raw is not None:
                self.add("dense/calls", 1.0)
            for name, value in (("threshold", threshold), ("residual_norm", residual_norm)):
                if value is not None:
                    self.maximum(f"dense/{name}", float(value))

    def timed(self, fut: Future[torch.Tensor], raw: float, wire: float, t0: float) -> Future[torch.Tensor]:
        """A hook's future that records its bytes and its host time until launch now, and the time
        to arrival when it completes (the value unwrapped from torch's hooks' one-element lists)."""
        launched = time.perf_counter()
        self.record(raw=raw, wire=wire, codec_ms=1e3 * (launched - t0))
        return fut.then(self._arrived(launched))

    def _arrived(self, launched: float) -> Callable[[Future[torch.Tensor]], torch.Tensor]:
        def done(f: Future[torch.Tensor]) -> torch.Tensor:
            self.record(comm_ms=1e3 * (time.perf_counter() - launched))
            value = f.value()
            return value[0] if isinstance(value, list) else value

        return done
