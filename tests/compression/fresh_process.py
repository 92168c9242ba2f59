"""Checks that run a test script's ``mode`` in a fresh interpreter process (``test_triton.py``,
``test_row_kernels.py``): TRITON_INTERPRET must be set before the kernels are decorated, and unset
for the ahead-of-time CUDA compile. Imported by the scripts on both sides (the test and its
subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (dtype, wire) of the cast checks: each dtype sent as it is, then float32 as fp16 and bf16
CAST_CASES = [("float32", 0), ("float16", 0), ("bfloat16", 0), ("float32", 1), ("float32", 2)]


def check_in_process(script: str, mode: str, interpret: bool, timeout: int) -> None:
    """Runs ``script mode`` from the repository root (under the Triton interpreter where
    ``interpret``), one OpenMP thread; it must exit 0 and print ALL OK."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(
        [sys.executable, script, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def compiled_for_cuda(specs):
    """Each ``(kernel, signature, constexprs)`` of ``specs`` compiled ahead of time for sm_80 and
    sm_90 without FMA contraction (no GPU needed), a cubin made: yields (kernel, constexprs, compute
    capability, PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for fn, sig, constexprs in specs:
        for cc in (80, 90):
            c = triton.compile(
                ASTSource(fn, sig, constexprs=constexprs),
                target=GPUTarget("cuda", cc, 32),
                options={"enable_fp_fusion": False},
            )
            assert c.asm["cubin"], f"{fn.fn.__name__} {constexprs} sm_{cc}: no cubin"
            yield fn, constexprs, cc, c.asm["ptx"]
