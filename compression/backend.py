"""Where a chunk's stages run: the host's shortcuts, or the device's code that never waits for it.

Every per-chunk stage has one implementation, written for a device: sizes and choices stay in
device tensors, read once per collective. On a CPU the host can read them for free, and a few
stages have measured-faster host versions; :data:`HOST` takes those, :data:`DEVICE` takes none.
A codec picks one per device, once (:func:`backend_for`), from its ``backend`` parameter:
``"auto"`` (the host's on a CPU, the device's elsewhere), ``"host"`` or ``"device"`` (e.g. the
device code on CPU tensors, as the launch and sync counts and their tests run it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHOICES = ("auto", "host", "device")


@dataclass(frozen=True)
class Backend:
    """The shortcuts a chunk's stages take (every one measured faster on a CPU than the device
    code there; each costs a host read or a host copy on a device)."""

    name: str
    # the payload check: zlib's crc32 on the host (the CPU's fastest), Adler-32 on the device
    # (crc32 would copy the payload to the host)
    check: str
    # payload lengths read as each payload is made (else left on the device until the
    # collective's one read of every length: compression.format.Deferred)
    reads_sizes: bool
    # numpy's sorts and compares for dedup (~3x torch's on a CPU)
    numpy_sorts: bool
    # a CPU tensor of bounds read as Python floats (cheaper there than the device's small ops)
    host_bounds: bool
    # DCT-MP positions coded with zstd deltas or numpy's bitmap (smaller and faster on a CPU)
    host_positions: bool
    # the row cache's compactions by ``nonzero`` (no wait to avoid on a CPU; ~5x the scatter)
    host_compaction: bool

    @property
    def on_host(self) -> bool:
        return self.name == "host"


HOST = Backend("host", "crc32", True, True, True, True, True)
DEVICE = Backend("device", "adler32", False, False, False, False, False)


def backend_for(device: torch.device | str, choice: str = "auto") -> Backend:
    """The backend for tensors on ``device``: ``choice`` ``"host"`` or ``"device"``, or for
    ``"auto"`` the host's on a CPU and the device's elsewhere."""
    if choice not in CHOICES:
        raise ValueError(f"backend must be one of {CHOICES}, got {choice!r}")
    if choice == "auto":
        return HOST if torch.device(device).type == "cpu" else DEVICE
    return HOST if choice == "host" else DEVICE


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A tensor made on the host, on ``device``: one asynchronous copy, made even onto a CPU (a
    copy there too), so that the dispatcher sees the copy a device makes and launch counts taken
    on a CPU count it."""
    return host.to(device, non_blocking=True, copy=True)
