"""Triton kernels: bit-identical to the torch reference in the interpreter; compile for sm_80/sm_90.

Each check runs in a fresh interpreter process: TRITON_INTERPRET must be set before the kernels
are decorated, and must be unset for the ahead-of-time CUDA compile.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, __file__, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_kernels_are_bit_identical_to_the_reference_in_the_interpreter():
    r = _run("interpret", interpret=True)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def test_kernels_compile_for_cuda_sm80_and_sm90_without_a_gpu():
    r = _run("aot", interpret=False)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def test_triton_backend_on_cpu_without_interpreter_says_how_to_enable_it():
    r = _run("no_interpreter", interpret=False)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


# --------------------------------------------------------------------------- subprocess side ----


def _tensor_cases():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6000, generator=g) * torch.pow(10.0, torch.randint(-8, 5, (6000,), generator=g).float())
    x[::97] = float("nan")
    x[5], x[6], x[7], x[8], x[9] = float("inf"), -float("inf"), 3e38, 1e-40, -0.0
    return x


def _check_interpret() -> None:
    import torch

    from dlrm_compression import get_codec
    from dlrm_compression import kernels as K
    from dlrm_compression import reference as R

    def same(a, b, what):
        if a.dtype.is_floating_point:
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: kernel differs from reference"

    x = _tensor_cases()
    g = torch.Generator().manual_seed(1)
    per_value_eb = torch.pow(10.0, torch.randint(-9, 3, (x.numel(),), generator=g).double())
    for eb in [1e-3, 1e-6, 5.0]:
        for per in (False, True):
            ebs = per_value_eb.tolist() if per else [eb]
            step = torch.tensor([R.step_of(e) for e in ebs])
            ed = torch.tensor([R.float32_at_most(e) for e in ebs])
            if not per:
                step, ed = step[0], ed[0]
            for out in (torch.float32, torch.float16, torch.bfloat16):
                xs = x.to(out).float()
                c1, m1 = K.quantize(xs, step, ed, out, block=4096)
                c2, m2 = R.quantize(xs, step, ed, out)
                same(c1, c2, f"codes eb={eb} per={per} {out}")
                same(m1, m2, f"misses eb={eb} per={per} {out}")
            same(K.dequantize(c2, step, block=4096), R.dequantize(c2, step), f"dequantize eb={eb} per={per}")
    print("quantize/dequantize OK")

    for n in (0, 1, 31, 32, 33, 1000, 4099):
        kinds = {
            "small": torch.randint(0, 7, (n,), generator=g, dtype=torch.int32),
            "mixed": (
                torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
                >> torch.randint(0, 31, (n,), generator=g, dtype=torch.int32)
            ),
            "zeros": torch.zeros(n, dtype=torch.int32),
        }
        if n > 40:
            kinds["mixed"][:32] = 0
            kinds["mixed"][40] = 2**31 - 1
        for kind, v in kinds.items():
            w2, words2 = R.block_pack(v)
            for groups in (8, 64):
                w1, words1 = K.block_pack(v, groups=groups)
                same(w1, w2, f"widths n={n} {kind} G={groups}")
                same(words1, words2, f"words n={n} {kind} G={groups}")
                same(K.block_unpack(w2, words2, n, groups=groups), v, f"unpack n={n} {kind} G={groups}")
    print("pack/unpack OK")

    ids = torch.randint(0, 40, (300,), generator=g)
    table = torch.randn(40, 24, generator=g) * 0.01
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xt = table[ids].to(dtype)
        xt[3, 4] = float("nan")  # row 3's id may repeat: keep ids consistent by using no ids below
        for entropy in (False, True):
            for use_ids in (False, True):
                xi = table[ids].to(dtype) if use_ids else xt
                i = ids if use_ids else None
                eb = [1e-3, 1e-2, 1e-4]
                torch_codec = get_codec("lossy", entropy=entropy, backend="torch")
                triton_codec = get_codec("lossy", entropy=entropy, backend="triton")
                p1 = triton_codec.encode(xi, eb, i, blocks=[8, 8, 8])
                p2 = torch_codec.encode(xi, eb, i, blocks=[8, 8, 8])
                same(p1, p2, f"payload {dtype} entropy={entropy} ids={use_ids}")
                if not entropy and use_ids:  # the device framing (lengths left on the device): same bytes
                    from dlrm_compression import format as fmt

                    check, fmt._check_for = fmt._check_for, lambda device: "adler32"
                    try:
                        [p3] = fmt.settle([triton_codec.encode_deferred(xi, eb, i, blocks=[8, 8, 8])])
                        same(p3, torch_codec.encode(xi, eb, i, blocks=[8, 8, 8]), f"deferred payload {dtype}")
                    finally:
                        fmt._check_for = check
                same(
                    triton_codec.decode(p2, i).view(-1).view(torch.uint8),
                    torch_codec.decode(p2, i).view(-1).view(torch.uint8),
                    f"decode {dtype} entropy={entropy}",
                )
    print("codec OK")


def _aot_specs():
    from dlrm_compression import kernels as K

    quant = {
        "x_ptr": "*fp32",
        "step_ptr": "*fp32",
        "ed_ptr": "*fp32",
        "codes_ptr": "*i32",
        "miss_ptr": "*i8",
        "n": "i32",
        "PER_VALUE": "constexpr",
        "OUT": "constexpr",
        "BLOCK": "constexpr",
    }
    deq = {
        "codes_ptr": "*i32",
        "step_ptr": "*fp32",
        "out_ptr": "*fp32",
        "n": "i32",
        "PER_VALUE": "constexpr",
        "BLOCK": "constexpr",
    }
    groups = {"n": "i32", "n_groups": "i32", "G": "constexpr"}
    specs = [
        (K.quantize_kernel, quant, {"PER_VALUE": per, "OUT": out, "BLOCK": K.QUANT_BLOCK})
        for per in (False, True)
        for out in (0, 1, 2)
    ]
    specs += [(K.dequantize_kernel, deq, {"PER_VALUE": per, "BLOCK": K.QUANT_BLOCK}) for per in (False, True)]
    specs += [
        (K.widths_kernel, {"codes_ptr": "*i32", "widths_ptr": "*u8", **groups}, {"G": K.PACK_GROUPS}),
        (
            K.pack_kernel,
            {"codes_ptr": "*i32", "widths_ptr": "*u8", "offsets_ptr": "*i64", "words_ptr": "*i32", **groups},
            {"G": K.PACK_GROUPS},
        ),
        (
            K.unpack_kernel,
            {"words_ptr": "*i32", "widths_ptr": "*u8", "offsets_ptr": "*i64", "codes_ptr": "*i32", **groups},
            {"G": K.PACK_GROUPS},
        ),
    ]
    return specs


def _check_aot() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for fn, sig, constexprs in _aot_specs():
        for cc in (80, 90):
            c = triton.compile(
                ASTSource(fn, sig, constexprs=constexprs),
                target=GPUTarget("cuda", cc, 32),
                options={"enable_fp_fusion": False},
            )
            name = f"{fn.fn.__name__} {constexprs} sm_{cc}"
            assert c.asm["cubin"], f"{name}: no cubin"
            ptx = c.asm["ptx"]
            assert "fma.rn.f32" not in ptx, f"{name}: contracted to FMA (reconstruction would differ)"
            assert "div.full" not in ptx and "div.approx" not in ptx, f"{name}: approximate division"
            if fn.fn.__name__ == "quantize_kernel":
                assert "div.rn.f32" in ptx, f"{name}: no IEEE division"
            print(name, "compiled")


def _check_no_interpreter() -> None:
    import torch

    from dlrm_compression import get_codec

    try:
        get_codec("lossy", backend="triton").encode(torch.randn(4, 4), 1e-3)
    except RuntimeError as e:
        assert "TRITON_INTERPRET=1" in str(e), e
    else:
        raise AssertionError("triton backend on CPU ran without the interpreter")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    {"interpret": _check_interpret, "aot": _check_aot, "no_interpreter": _check_no_interpreter}[sys.argv[1]]()
    print("ALL OK")
