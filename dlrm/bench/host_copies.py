"""Where the per-chunk code copies to the host: its calls of ``.numpy()``, ``.tolist()``, ``.cpu()``.

Why a static check: on CPU tensors these reach no dispatcher op, so the counter of
:mod:`dlrm.telemetry.sync_counter` cannot see them, yet on a GPU each one waits for the device and
copies. :data:`PER_CHUNK` is the one list of the code that runs once per chunk (per peer and
direction); the size exchange, one per collective (``comm_ops._send``), is left out on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
HOST_CALLS = ("numpy", "tolist", "cpu")

# module -> its per-chunk functions ("Class.method"), or None for every function of the module.
# compression=lossy (bounds, dedup, quantise, fixed-length coder, framing), the codecs of auto
# (per_block) and dct_mp (threshold), the trainer's per-chunk glue around them, and the forward
# row cache and its probe (their reads: one per chunk for all blocks, see
# tests/embedding_comm/test_cache_hot_host_syncs.py, which also lists hot-row replication's).
PER_CHUNK: dict[str, tuple[str, ...] | None] = {
    "compression.base": (
        "Codec.encode",
        "Codec.encode_deferred",
        "Codec.decode",
        "Codec._checked",
        "check_input",
        "resolve_blocks",
        "resolve_bounds",
        "check_ids",
        "check_out",
        "into",
    ),
    "compression.bounds": None,
    "compression.dedup": None,
    "compression.quantize": None,
    "compression.reference": None,
    "compression.coders": ("BlockCoder.encode", "BlockCoder.decode"),
    "compression.format": None,
    "compression.lossy": (
        "ids_fingerprint",
        "LossyCodec._bounds",
        "LossyCodec._encode",
        "LossyCodec._decode",
        "LossyCodec.decoded",
    ),
    "compression.cast": ("CastCodec._encode", "CastCodec._decode"),
    "compression.composite": (
        "PerBlockCodec.effective",
        "PerBlockCodec._encode",
        "PerBlockCodec._writer",
        "PerBlockCodec._decode",
    ),
    "compression.sparse": None,
    "dlrm.embedding_comm.bounds": ("policy_values", "absolute_bounds"),
    "dlrm.embedding_comm.ids": None,
    "dlrm.embedding_comm.codec": (
        "DirectionCodec.bounds",
        "DirectionCodec.thresholds",
        "DirectionCodec.encode",
        "DirectionCodec.kept",
        "DirectionCodec.decode",
    ),
    "compression.row_cache": (
        "RowCaches.find",
        "RowCaches.peek",
        "RowCaches.store",
        "RowCaches._evict",
        "RowCaches._free_rows",
        "RowCaches._grow",
        "RowCache.find",
        "RowCache.gather",
        "RowCache.store",
        "positions",
        "compact",
    ),
    "dlrm.embedding_comm.forward_cache": (
        "ForwardCache.encode",
        "ForwardCache.decode",
        "ForwardCache.encode_on_device",  # the device path: none (its counts go with the collective's reads)
        "ForwardCache.prepare_on_device",
        "ForwardCache.decode_on_device",
        "ForwardCache._look",
        "ForwardCache._classify",
        "ForwardCache._sent",
    ),
    "dlrm.embedding_comm.cache_layout": None,  # the chunk's layout, merge, bits and inner payload
    "compression.row_ops": None,
    "compression.row_reference": None,
    "dlrm.embedding_comm.cache_probe": ("CacheProbe.measure", "CacheProbe.observe", "_over_bound"),
}


class HostCopy(NamedTuple):
    """One call site: ``module:function:line .call()``."""

    module: str
    function: str
    line: int
    call: str

    def __str__(self) -> str:
        return f"{self.module}:{self.function}:{self.line} .{self.call}()"


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level functions and class methods by qualified name (nested ones belong to them)."""
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = item
    return out


def host_copies(per_chunk: dict[str, tuple[str, ...] | None] = PER_CHUNK, root: Path = ROOT) -> list[HostCopy]:
    """Every ``x.numpy()``, ``x.tolist()``, ``x.cpu()`` call in the listed functions, in file order.

    A listed module or function that does not exist is an error, so the list follows the code.
    """
    out = []
    for module, names in per_chunk.items():
        path = root / (module.replace(".", "/") + ".py")
        if not path.is_file():
            raise ValueError(f"PER_CHUNK names module {module!r}, but {path} does not exist")
        functions = _functions(ast.parse(path.read_text(), str(path)))
        missing = sorted(set(names or ()) - set(functions))
        if missing:
            raise ValueError(f"PER_CHUNK names {missing} in {module!r}, which {path} does not define")
        for name in names if names is not None else list(functions):
            for node in ast.walk(functions[name]):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_CALLS:
                    out.append(HostCopy(module, name, node.lineno, node.func.attr))
    return sorted(out, key=lambda s: (s.module, s.line))
