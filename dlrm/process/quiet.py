"""Third-party warnings that tell a user of the trainer nothing, silenced one by one.

Each filter names the module a warning is attributed to and the start of its message, so every
other warning of the same libraries, and all of ours, still shows. The list comes from reading
the stderr of 2-rank runs with ``PYTHONWARNINGS=default`` (torch 2.13, TorchRec 1.8.0, FBGEMM
1.8.0, torchmetrics 1.0.3); several fire while TorchRec is imported, so ``dlrm/__init__.py``
installs them before anything imports it.
"""

from __future__ import annotations

import logging
import re
import warnings

# (category, module the warning is attributed to, regex matching the start of its message; FBGEMM
# colours its messages, hence the leading "(?s).*")
NOISE: tuple[tuple[type[Warning], str, str], ...] = (
    # the DDP that TorchRec builds (the dense MLPs, data-parallel tables) passes an argument torch renamed
    (FutureWarning, r"torchrec\.distributed\.", r"`broadcast_buffers` is deprecated"),
    # TorchRec's optimizer and torch's checkpoint planner touching TorchRec's sharded tables
    (
        FutureWarning,
        r"(torchrec|torch\.distributed)\.",
        r"Please use DTensor instead and we are deprecating ShardedTensor",
    ),
    # TorchRec's quantized comms (compression=qcomm_*) call collectives torch renamed
    (
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    ),
    # FBGEMM's dense CPU kernel (data-parallel tables) does its autograd inside the op; the warning
    # concerns torch.compile only and FBGEMM registers the key in later releases (pytorch/FBGEMM#5886)
    (UserWarning, r"torch\.autograd\.graph", r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel"),
    # torchmetrics' rank gather indexes the way torch 2.9 deprecated
    (UserWarning, r"torchmetrics\.utilities\.distributed", r"Using a non-tuple sequence for multidimensional"),
    # imports of the libraries themselves (shown under PYTHONWARNINGS=default and in pytest)
    (DeprecationWarning, r"fbgemm_gpu\.split_embedding_codegen_lookup_invokers", r"(?s).*Failed to import: fbgemm_gpu"),
    (DeprecationWarning, r"fbgemm_gpu\.split_table_batched_embeddings_ops", r"(?s).*The Python module fbgemm_gpu"),
    (DeprecationWarning, r"torchmetrics\.utilities\.imports", r"distutils Version classes are deprecated"),
    (DeprecationWarning, r"torch\.jit\._script", r"`torch\.jit\.(script|interface)` is deprecated"),
    (DeprecationWarning, r"torchrec\.optim\.apply_optimizer_in_backward", r"This API is deprecated"),
)
# (logger, regex matching the start of the message): these go through logging, not warnings
NOISE_LOGS: tuple[tuple[str, str], ...] = (
    # TorchRec's modules ask torch.fx whether they are being traced, on every run
    ("torch.fx._symbolic_trace", r"is_fx_tracing will return true for both fx\.symbolic_trace and torch\.export"),
    # TorchRec's planner on the root logger, for every data-parallel table (those have no spec)
    ("root", r"Sharding spec not found for "),
    # no run of ours sets caching parameters
    ("torchrec.distributed.utils", r"(Sharding Type is data_parallel|Compute Kernel is dense), caching params will"),
)


class _DropMessages(logging.Filter):
    """A logger filter that drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def silence_third_party_noise() -> None:
    """Install the filters of ``NOISE`` and ``NOISE_LOGS`` (idempotent)."""
    for category, module, message in NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern in NOISE_LOGS:
        logger = logging.getLogger(None if name == "root" else name)
        if not any(isinstance(f, _DropMessages) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMessages(pattern))  # a logger's filters see only its own records
