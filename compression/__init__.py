"""Error-bounded lossy compression of embedding tensors (no torchrec/dlrm imports).

API (docs/compression.md, "The compressor"; its layer: docs/architecture.md)::

    codec = compression.get_codec(name, **params)   # names: compression.available_codecs()
    payload = codec.encode(x, eb, ids=None, *, blocks=None)  # -> 1-D torch.uint8, self-describing
    y = codec.decode(payload, ids=None)              # -> x's shape and dtype, payload's device
    codec.decode(payload, ids=None, out=y)           # into a caller's tensor (any strides)

- ``x``: 2-D ``[rows, cols]`` float32 / float16 / bfloat16 (restored on decode).
- ``eb``: absolute bound, a float or one per column block; ``blocks=[d0, d1, ...]`` gives the
  block (table) widths, summing to cols. Without ``blocks`` the columns are split equally into
  ``len(eb)`` (or ``ids.shape[1]``) blocks. Bounded codecs guarantee
  ``|y - x| <= eb`` element-wise (NaN/Inf pass through exactly); the baselines ``none``, ``fp16``,
  ``bf16`` (and ``int8``, ``fp8``, ``mx4`` where present) ignore ``eb``.
- ``ids``: optional int64 ``[rows]`` (same id for every block) or ``[rows, n_blocks]`` (one id
  per row per table). Equal id in a block must mean equal row there. A payload encoded with ids
  carries no row index and must be decoded with the same ids; without ids it carries the index.
- Bad payloads (truncated, corrupted, foreign, wrong ids) raise ``compression.PayloadError``
  (a ``ValueError``). ``compression.decode(payload, ids)`` decodes with whichever codec wrote it.
- ``relative_to_absolute(x, rel, blocks)`` turns relative-to-range bounds into absolute ones.
- Codecs: ``lossy`` (bounded; params ``entropy=True|False|"auto"``, ``level``, ``dedup``,
  ``backend="auto"|"torch"|"triton"``, ``verify_ids``), and the unbounded baselines ``none``,
  ``fp16``, ``bf16``, ``int8`` (``row_dim``), ``fp8`` (``rowwise``, CUDA only), ``mx4``
  (``group_size``). Benchmark (in the trainer's package): ``python -m dlrm.bench.codec --help``.
"""

from . import baselines as _baselines  # noqa: F401  (register codecs)
from . import cast as _cast  # noqa: F401  (register codecs)
from . import composite as _composite  # noqa: F401  (register codecs)
from . import lossy as _lossy  # noqa: F401  (register codecs)
from . import sparse as _sparse  # noqa: F401  (register codecs)
from .base import Codec, available_codecs, codec_for, decode, get_codec, is_bounded, register
from .bounds import relative_to_absolute
from .format import PayloadError

__all__ = [
    "Codec",
    "PayloadError",
    "available_codecs",
    "codec_for",
    "decode",
    "get_codec",
    "is_bounded",
    "register",
    "relative_to_absolute",
]
