"""Checks that run a test script's ``mode`` in a fresh interpreter process (``test_triton.py``,
``test_row_kernels.py``): TRITON_INTERPRET must be set before the kernels are decorated, and unset
for the ahead-of-time CUDA compile. Imported by the scripts on both sides (the test and its
subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (dtype, wire) of the cast checks: each dtype sent as it is, then float32 as fp16 and bf16
CAST_CASES = [("float32", 0), ("float16", 0), ("bfloat16", 0), ("float32", 1), ("float32", 2)]


def run_in_process(script: str, modes: Sequence[str], interpret: bool, timeout: int) -> subprocess.CompletedProcess:
    """Runs ``script MODE[,MODE...]`` from the repository root (under the Triton interpreter where
    ``interpret``), one OpenMP thread: the modes one after the other (:func:`run_modes`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, script, ",".join(modes)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def check_in_process(script: str, mode: str, interpret: bool, timeout: int) -> None:
    """Runs ``script mode`` in a fresh process (:func:`run_in_process`); it must exit 0 and print ALL OK."""
    r = run_in_process(script, [mode], interpret, timeout)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def check_mode(r: subprocess.CompletedProcess, mode: str) -> None:
    """``mode`` of a :func:`run_in_process` of several modes passed; else its traceback (or the crash)."""
    if f"{mode} OK" not in r.stdout.splitlines():
        start, end = f"--- {mode} FAILED\n", f"--- {mode} END"
        mine = r.stdout.split(start, 1)[1].split(end, 1)[0] if start in r.stdout else r.stdout  # else: a crash
        raise AssertionError(f"{mode} did not pass (exit {r.returncode}):\n{mine[-4000:]}\n{r.stderr[-4000:]}")


def run_modes(checks: dict[str, Callable[[], None]], arg: str) -> None:
    """The subprocess side: each mode of ``arg`` (comma-separated) in order, a failure printed with
    its traceback and the next mode run all the same; ALL OK and exit 0 only if every one passed."""
    failed = []
    for mode in arg.split(","):
        try:
            checks[mode]()
        except Exception:
            print(f"--- {mode} FAILED\n{traceback.format_exc()}--- {mode} END", flush=True)
            failed.append(mode)
        else:
            print(f"{mode} OK", flush=True)
    if failed:
        sys.exit(1)
    print("ALL OK")


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
