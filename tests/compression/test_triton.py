"""Triton kernels: bit-identical to the torch reference in the interpreter; compile for sm_80/sm_90.

Each check runs in a fresh interpreter process (the two without the interpreter in one):
TRITON_INTERPRET must be set before the kernels are decorated, and must be unset for the
ahead-of-time CUDA compile.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from fresh_process import CAST_CASES, ROOT, check_in_process, check_mode, compiled_for_cuda, run_in_process, run_modes


def test_kernels_are_bit_identical_to_the_reference_in_the_interpreter():
    check_in_process(__file__, "interpret", interpret=True, timeout=300)


@pytest.fixture(scope="module")
def without_interpreter() -> subprocess.CompletedProcess:
    """The two checks without the interpreter in one fresh process (starting it costs more than a check);
    no_interpreter first, as in a process of its own."""
    return run_in_process(__file__, ["no_interpreter", "aot"], interpret=False, timeout=300)


def test_kernels_compile_for_cuda_sm80_and_sm90_without_a_gpu(without_interpreter):
    check_mode(without_interpreter, "aot")


def test_triton_backend_on_cpu_without_interpreter_says_how_to_enable_it(without_interpreter):
    check_mode(without_interpreter, "no_interpreter")


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
                torch_codec = get_codec("lossy", entropy=entropy, kernels="torch")
                triton_codec = get_codec("lossy", entropy=entropy, kernels="triton")
                p1 = triton_codec.encode(xi, eb, i, blocks=[8, 8, 8])
                p2 = torch_codec.encode(xi, eb, i, blocks=[8, 8, 8])
                same(p1, p2, f"payload {dtype} entropy={entropy} ids={use_ids}")
                if not entropy and use_ids:  # the device framing (lengths left on the device): same bytes
                    from dlrm_compression import format as fmt

                    on_device = get_codec("lossy", entropy=entropy, kernels="triton", backend="device")
                    [p3] = fmt.settle([on_device.encode_deferred(xi, eb, i, blocks=[8, 8, 8])])
                    want = get_codec("lossy", entropy=entropy, kernels="torch", backend="device")
                    same(p3, want.encode(xi, eb, i, blocks=[8, 8, 8]), f"deferred payload {dtype}")
                same(
                    triton_codec.decode(p2, i).view(-1).view(torch.uint8),
                    torch_codec.decode(p2, i).view(-1).view(torch.uint8),
                    f"decode {dtype} entropy={entropy}",
                )
    print("codec OK")

    # the payload check and the framing: the kernels against the reference
    import zlib

    for n, end, skip in [(100, 100, (20, 4)), (50000, 49999, (20, 4)), (9000, 8193, (0, 16)), (70000, 65537, (0, 0))]:
        d = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        want = zlib.adler32(d[: skip[0]].numpy().tobytes() + d[sum(skip) : end].numpy().tobytes())
        for e, size in ((torch.tensor(end), 0), (None, end)):
            got = K.adler32(d, e, size, *skip, skip[0], R.ADLER_VALUE, block=1024)
            assert int(got) == int(R.adler32(d, e, size, *skip, skip[0], R.ADLER_VALUE)) == want, (n, end)
            if skip[1] >= 4:
                k1, r1 = d.clone(), d.clone()
                K.adler32(k1, e, size, *skip, skip[0], R.ADLER_SEAL, block=1024)
                R.adler32(r1, e, size, *skip, skip[0], R.ADLER_SEAL)
                same(k1, r1, f"sealed n={n}")
                assert int(K.adler32(k1, e, size, *skip, skip[0], R.ADLER_HOLDS, block=1024)) == 1
                k1[end - 1] ^= 4
                assert int(K.adler32(k1, e, size, *skip, skip[0], R.ADLER_HOLDS, block=1024)) == 0
    print("adler32 OK")
    for trial in range(12):
        n_sections = 1 + trial % 4
        section_of = sorted([*range(n_sections), *torch.randint(0, n_sections, (trial % 5,), generator=g).tolist()])
        pieces = [torch.randint(0, 256, (int(torch.randint(0, 9000, (1,), generator=g)),), generator=g,
                                dtype=torch.uint8) for _ in section_of]  # fmt: skip
        lens = [int(torch.randint(0, p.numel() + 1, (1,), generator=g)) for p in pieces]
        on_device = [k % 2 == 0 for k in range(len(pieces))]  # every other length a device value
        dev = [torch.tensor(n) for n, d in zip(lens, on_device, strict=True) if d]
        host = [-1 if d else n for n, d in zip(lens, on_device, strict=True)]
        head = torch.randint(0, 256, (64 + 8 * n_sections,), generator=g, dtype=torch.uint8)
        patches = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (4, 8)][: trial % 3]
        patch_at = [30, 40][: len(patches)]
        for align, fields in ((8, (64, 8)), (1, (-1, -1))):
            args = (head, patches, patch_at, pieces, dev, host, section_of, n_sections, align, *fields)
            a, ta = K.frame(*args)
            b, tb = R.frame(*args)
            assert int(ta) == int(tb) and a.numel() == b.numel(), trial
            same(a[: int(tb)], b[: int(tb)], f"frame trial {trial} align {align}")
    print("frame OK")

    # the lossy codec's device ops: plan runs, block ranges, pack and unpack, against the reference
    from dlrm_compression import dedup

    for rows, nb, n_ids, shared in [(300, 3, 40, False), (1, 2, 3, False), (257, 1, 7, False), (90, 4, 9, True)]:
        ids = torch.randint(0, n_ids, (rows, 1 if shared else nb), generator=g)
        keys = ids.expand(rows, nb) if shared else ids
        k = keys[:, :1].t().contiguous() if shared or nb == 1 else keys.t().contiguous()
        s_ids, perm = torch.sort(k, stable=True)
        for got, want in zip(K.id_runs(s_ids, perm, keys), R.id_runs(s_ids, perm, keys), strict=True):
            same(got, want, f"id_runs rows={rows} nb={nb} shared={shared}")
    print("id_runs OK")
    for widths in ([8, 8, 8], [5, 200, 0, 3], [1]):
        xr = torch.randn(150, sum(widths), generator=g)
        xr[3, 0], xr[4, -1], xr[:, widths[0] : widths[0] + 1] = float("nan"), float("inf"), float("-inf")
        rel = torch.rand(len(widths), generator=g, dtype=torch.float64)
        for dtype in (torch.float32, torch.bfloat16):
            same(K.relative_bounds(xr.to(dtype), rel, widths), R.relative_bounds(xr.to(dtype), rel, widths), "bounds")
    print("relative_bounds OK")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for widths in ([8, 8, 8], [5, 16, 3], [1, 0, 1]):
            nb, rows = len(widths), 200
            ids = torch.randint(0, 30, (rows, nb), generator=g)
            table = torch.randn(30, sum(widths), generator=g) * 0.05
            starts = [sum(widths[:b]) for b in range(nb)]
            x = torch.cat([table[ids[:, b], starts[b] : starts[b] + widths[b]] for b in range(nb)], 1).to(dtype)
            x[ids[:, 0] == ids[0, 0], 0] = float("nan")  # an exception in every row of that id
            plan = dedup.id_plan(ids)
            eb = [10.0 ** -(1 + b % 4) for b in range(nb)]
            bounds = torch.tensor(eb, dtype=torch.float64)
            for summed in (False, True):
                xs = torch.randn(rows, sum(widths), generator=g).to(dtype) if summed else x
                src = plan.inverse if summed else plan.first
                got = K.lossy_pack(xs, src, plan.counts, bounds, widths, summed, groups=64)
                want = R.lossy_pack(xs, src, plan.counts, bounds, widths, summed)
                same(got[4], want[4], f"lossy_pack lengths {dtype} {widths} summed={summed}")
                gp, nw, npos, nraw = want[4].tolist()
                for a, b, n, what in zip(got[:4], want[:4], (gp, nw // 4, npos // 4, nraw // x.element_size()),
                                         ("widths", "words", "positions", "raw"), strict=True):  # fmt: skip
                    if what == "raw":  # (their bits: NaN payloads, half precision)
                        ints = torch.int16 if dtype != torch.float32 else torch.int32
                        a, b = a.view(ints), b.view(ints)
                    same(a[:n], b[:n], f"lossy_pack {what} {dtype} {widths} summed={summed}")
            gw, words, pos, raw, lens = R.lossy_pack(x, plan.first, plan.counts, bounds, widths, False)
            gp, nw, npos, nraw = lens.tolist()
            n = sum(int(c) * w for c, w in zip(plan.counts, widths, strict=True))
            sections = (gw[: -(-n // 32)], words[: nw // 4], pos[: npos // 4], raw[: nraw // x.element_size()])
            for first in (None, plan.first):
                outs = [torch.full((rows, sum(widths) + 3), 7.0, dtype=dtype) for _ in range(2)]
                args = (*sections, plan.counts.tolist(), eb, widths, plan.inverse, first)
                K.lossy_unpack(*args, outs[0][:, 2 : 2 + sum(widths)], groups=64)
                R.lossy_unpack(*args, outs[1][:, 2 : 2 + sum(widths)])
                ints = torch.int16 if dtype != torch.float32 else torch.int32
                same(outs[0].view(ints), outs[1].view(ints), f"lossy_unpack {dtype} {widths} keep={first is not None}")
    print("lossy pack/unpack OK")
    for widths in ([8, 8, 8], [5, 16, 0, 3], [1]):
        xr = torch.randn(70, sum(widths), generator=g) * 0.05
        xr[3, 0], xr[4, -1], xr[5, 0], xr[6, -1] = float("nan"), float("inf"), 3e38, -0.0
        bounds = torch.tensor([10.0 ** -(1 + b % 4) for b in range(len(widths))], dtype=torch.float64)
        if len(widths) > 1:
            bounds[1] = 0.0  # sent exactly: every value a miss
        for tiles in ((32, 128), (16, 4)):
            got, want = K.lossy_roundtrip(xr, bounds, widths, *tiles), R.lossy_roundtrip(xr, bounds, widths)
            same(got, want, f"lossy_roundtrip {widths} tiles {tiles}")
    print("lossy roundtrip OK")

    head = torch.randint(0, 256, (104,), generator=g, dtype=torch.uint8)
    head[20:24] = 0  # (the check field)
    cast_cases = [(getattr(torch, name), wire) for name, wire in CAST_CASES]
    for dtype, wire in cast_cases:
        for rows, cols in ((37, 12), (300, 8), (1, 1)):
            x = (torch.randn(rows, cols, generator=g) * 1e3).to(dtype)
            specials = [float("nan") if wire == 0 else 7.0, float("inf"), -0.0]  # (a cast's NaN: any NaN's bits)
            x.view(-1)[:3] = torch.tensor(specials).to(dtype)[: x.numel()]
            payload = K.cast_pack(x, head, wire, block=64)
            same(payload, R.cast_pack(x, head, wire), f"cast_pack {dtype} wire {wire} {rows}x{cols}")
            for flip in (None, 30, 110, payload.numel() - 1):
                p = payload.clone()
                if flip is not None:
                    p[flip] ^= 1
                outs = [torch.full((rows, cols + 2), 5.0, dtype=dtype if wire == 0 else torch.float32) for _ in "ab"]
                got = K.cast_unpack(p, head, wire, outs[0][:, 1 : 1 + cols], block=64)
                want = R.cast_unpack(p, head, wire, outs[1][:, 1 : 1 + cols])
                assert got.tolist() == want.tolist() and (got.tolist() == [1, 1]) == (flip is None), (flip, got)
                ints = torch.int32 if outs[0].element_size() == 4 else torch.int16
                same(outs[0].view(ints), outs[1].view(ints), f"cast_unpack {dtype} wire {wire} flip {flip}")
    print("cast pack/unpack OK")

    # the casts with duplicate ids: each id's rows summed (in row order) as they are cast, the first
    # row of each id kept as they are decoded; the reference's sums are the transport's
    from dlrm.embedding_comm.ids import keep_first_duplicates, sum_duplicates
    from dlrm_compression.dedup import id_sort

    for dtype, wire in cast_cases:
        # (rows, widths, distinct ids, shared ids, tile rows): few programs (the interpreter is slow),
        # and the partial sums read 4 at a time (as 1,024 on a GPU) so that every loop turns
        for rows, widths, distinct, shared, segs in (
            (37, [4, 0, 7], 5, False, 16),
            (160, [8], 20, False, 64),
            (70, [3, 3], 2, True, 32),
            (1, [2], 1, False, 8),
            (0, [3], 1, False, 8),
        ):
            cols = sum(widths)
            x = torch.randn(rows, cols, generator=g) * torch.pow(
                10.0, torch.randint(-3, 4, (rows, cols), generator=g).float()
            )
            x = x.to(dtype)
            x.view(-1)[:3] = torch.tensor([float("inf"), -0.0, -0.0]).to(dtype)[: x.numel()]
            nb = len(widths)
            ids = torch.randint(0, distinct, (rows, 1 if shared else nb), generator=g)
            keys = ids.expand(rows, nb) if shared else ids
            srt, perm = id_sort(keys)
            what = f"{dtype} wire {wire} {rows}x{widths}"
            payload = K.cast_pack_summed(x, head, wire, srt, perm, widths, segs=segs, cols=8, finish=4)
            same(payload, R.cast_pack_summed(x, head, wire, srt, perm, widths), f"cast_pack_summed {what}")
            same(payload, R.cast_pack(sum_duplicates(x, keys, widths), head, wire), f"cast_pack_summed {what}")
            for flip in (None, 30, payload.numel() - 1):
                p = payload.clone()
                if flip is not None and flip < p.numel():
                    p[flip] ^= 1
                outs = [torch.full((rows, cols + 2), 5.0, dtype=dtype if wire == 0 else torch.float32) for _ in "ab"]
                got = K.cast_unpack_first(
                    p, head, wire, outs[0][:, 1 : 1 + cols], srt, perm, widths, segs=segs, cols=8, finish=4
                )
                want = R.cast_unpack(p, head, wire, outs[1][:, 1 : 1 + cols])
                keep_first_duplicates(outs[1][:, 1 : 1 + cols], keys, widths)
                assert got.tolist() == want.tolist() and (got.tolist() == [1, 1]) == (flip is None), (flip, got)
                ints = torch.int32 if outs[0].element_size() == 4 else torch.int16
                same(outs[0].view(ints), outs[1].view(ints), f"cast_unpack_first {what} flip {flip}")
    assert all(not t[2 * (len(t) // 2) :].any() for t in K._TABLES.values())  # every launch left its counter zero
    print("cast pack summed/unpack first OK")

    # the ids codec's bit streams and every payload's check at once
    i64 = torch.iinfo(torch.int64)
    for n in (0, 1, 700, 5000):
        widths = torch.randint(0, 65, (n,), generator=g)
        widths[: min(n, 3)] = torch.tensor([64, 0, 1])[: min(n, 3)]
        raw = torch.randint(i64.min, i64.max, (n,), generator=g)
        keep = torch.where(widths >= 64, -1, (1 << widths.clamp(max=63)) - 1)
        vals = raw & keep  # (each within its width)
        starts = 5 + widths.cumsum(0) - widths
        perm = torch.randperm(n, generator=g)  # the kernel places values in any order
        words = (int(starts[-1] + widths[-1]) if n else 5) // 64 + 1
        packed = K.bits_pack(vals[perm], starts[perm], words, block=256)
        same(packed, R.bits_pack(vals[perm], starts[perm], words), f"bits_pack n={n}")
        stride = torch.stack([starts, widths], 1)  # strided inputs, as the codec passes them
        got = K.bits_unpack(packed, stride[:, 0], stride[:, 1], block=256)
        same(got, R.bits_unpack(packed, stride[:, 0], stride[:, 1]), f"bits_unpack n={n}")
        same(got, vals, f"bits round trip n={n}")
    print("bits pack/unpack OK")
    data = torch.randint(0, 256, (30000,), generator=g, dtype=torch.uint8)
    starts, sizes = [0, 24, 5000, 9000], [24, 4976, 3000, 20999]
    for mode in (R.ADLER_VALUE, R.ADLER_HOLDS):
        got = K.adler32_segments(data, starts, sizes, 20, 4, 20, mode, block=1024)
        assert got.tolist() == R.adler32_segments(data, starts, sizes, 20, 4, 20, mode).tolist(), mode
    k1, r1 = data.clone(), data.clone()
    K.adler32_segments(k1, starts, sizes, 20, 4, 20, R.ADLER_SEAL, block=1024)
    R.adler32_segments(r1, starts, sizes, 20, 4, 20, R.ADLER_SEAL)
    same(k1, r1, "adler32_segments sealed")
    assert K.adler32_segments(k1, starts, sizes, 20, 4, 20, R.ADLER_HOLDS, block=1024).tolist() == [1, 1, 1, 1]
    k1[9000 + 20999 - 1] ^= 8
    assert K.adler32_segments(k1, starts, sizes, 20, 4, 20, R.ADLER_HOLDS, block=1024).tolist() == [1, 1, 1, 0]
    print("adler32 segments OK")


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
    adler = {"data_ptr": "*u8", "end_ptr": "*i64", "size": "i64", "skip_at": "i64", "skip_len": "i64"}
    specs += [
        (K.adler_partials_kernel, {**adler, "part_ptr": "*i64", "HAS_END": "constexpr", "BLOCK": "constexpr"},
         {"HAS_END": has, "BLOCK": K.ADLER_BLOCK})
        for has in (False, True)
    ]  # fmt: skip
    finish = {
        "part_ptr": "*i64", "n_parts": "i64", "end_ptr": "*i64", "size": "i64", "skip_len": "i64", "check_at": "i64",
        "data_ptr": "*u8", "out_ptr": "*i64", "HAS_END": "constexpr", "MODE": "constexpr", "CHUNK": "constexpr",
    }  # fmt: skip
    specs += [
        (K.adler_finish_kernel, finish, {"HAS_END": has, "MODE": mode, "CHUNK": 1024})
        for has in (False, True)
        for mode in (0, 1, 2)
    ]
    layout = {
        "src_ptr": "*u8", "table_ptr": "*i64", "n_pieces": "i32", "n_sections": "i32", "head_len": "i64",
        "align": "i64", "meta_ptr": "*i64", "PIECES": "constexpr",
    }  # fmt: skip
    copy = {
        "table_ptr": "*i64", "head_at": "i64", "head_len": "i64", "n_patches": "i32", "lengths_at": "i64",
        "total_at": "i64", "meta_ptr": "*i64", "n_sections": "i32", "src_ptr": "*u8", "n_pieces": "i32",
        "out_ptr": "*u8", "TILE": "constexpr", "STEPS": "constexpr",
    }  # fmt: skip
    specs += [
        (K.frame_layout_kernel, layout, {"PIECES": 8}),
        (K.frame_copy_kernel, copy, {"TILE": K.FRAME_TILE, "STEPS": 4}),
    ]
    runs = {
        "sorted_ptr": "*i64", "perm_ptr": "*i64", "rows": "i64", "keys_ptr": "*i64", "key_stride0": "i64",
        "key_stride1": "i64", "n_blocks": "i64", "shared": "i32", "counts_ptr": "*i64", "first_ptr": "*i64",
        "inverse_ptr": "*i64", "acc_ptr": "*i64", "CHUNK": "constexpr",
    }  # fmt: skip
    ranges = {
        "x_ptr": "*fp32", "stride": "i64", "rows": "i64", "table_ptr": "*i64", "n_blocks": "i32", "part_ptr": "*fp32",
        "n_row_tiles": "i32", "n_col_tiles": "i32", "ROWS": "constexpr", "COLS": "constexpr",
    }  # fmt: skip
    finish_ranges = {
        "part_ptr": "*fp32",
        "n_parts": "i32",
        "rel_ptr": "*fp64",
        "out_ptr": "*fp64",
        "CHUNK": "constexpr",
    }
    offsets = {
        "counts_ptr": "*i64", "table_ptr": "*i64", "bounds_ptr": "*fp64", "n_blocks": "i32", "off_ptr": "*i64",
        "step_ptr": "*fp32", "ed_ptr": "*fp32", "CHUNK": "constexpr",
    }  # fmt: skip
    values = {
        "x_ptr": "*fp32", "x_stride": "i64", "rows_ptr": "*i64", "rows": "i64", "table_ptr": "*i64", "n_blocks": "i32",
        "off_ptr": "*i64", "step_ptr": "*fp32", "ed_ptr": "*fp32", "n_groups": "i64", "widths_ptr": "*u8",
    }  # fmt: skip
    lossy = {"G": "constexpr", "STEPS": "constexpr", "IDENTITY": "constexpr", "OUT": "constexpr"}
    trip = {
        "x_ptr": "*fp32", "x_stride": "i64", "out_ptr": "*fp32", "out_stride": "i64", "rows": "i64", "cols": "i64",
        "table_ptr": "*i64", "n_blocks": "i32", "step_ptr": "*fp32", "ed_ptr": "*fp32", "ROWS": "constexpr",
        "COLS": "constexpr", "STEPS": "constexpr",
    }  # fmt: skip
    pack = {"ends_ptr": "*i64", "words_ptr": "*i32", "pos_ptr": "*i32", "raw_ptr": "*fp32", "lengths_ptr": "*i64",
            "item": "i64"}  # fmt: skip
    unpack = {
        "widths_ptr": "*u8", "ends_ptr": "*i64", "n_groups": "i64", "words_ptr": "*i32", "n_words": "i64",
        "table_ptr": "*i64", "n_blocks": "i32", "n": "i64", "vals_ptr": "*i32", "G": "constexpr", "STEPS": "constexpr",
        "OUT": "constexpr",
    }  # fmt: skip
    rows_k = {
        "vals_ptr": "*i32", "table_ptr": "*i64", "n_blocks": "i32", "rows": "i64", "cols": "i64", "inv_ptr": "*i64",
        "first_ptr": "*i64", "out_ptr": "*i32", "out_s0": "i64", "out_s1": "i64", "ROWS": "constexpr",
        "COLS": "constexpr", "STEPS": "constexpr", "INVERSE": "constexpr", "FIRST": "constexpr",
    }  # fmt: skip
    specs += [
        (K.id_runs_kernel, runs, {"CHUNK": K.RUNS_CHUNK}),
        (K.range_partials_kernel, ranges, {"ROWS": K.RANGE_ROWS, "COLS": K.RANGE_COLS}),
        (K.range_bounds_kernel, finish_ranges, {"CHUNK": 256}),
        (K.lossy_offsets_kernel, offsets, {"CHUNK": 1024}),
        (K.block_steps_kernel, {"bounds_ptr": "*fp64", "n_blocks": "i32", "step_ptr": "*fp32", "ed_ptr": "*fp32",
                                "CHUNK": "constexpr"}, {"CHUNK": 1024}),
        (K.roundtrip_kernel, trip, {"ROWS": K.TRIP_ROWS, "COLS": K.TRIP_COLS, "STEPS": 5}),
        *[
            (K.lossy_groups_kernel, {**values, "scan_ptr": "*i32", **lossy},
             {"G": K.LOSSY_GROUPS, "STEPS": 5, "IDENTITY": ident, "OUT": out})
            for ident in (False, True)
            for out in (0, 1, 2)
        ],
        *[
            (K.lossy_pack_kernel, {**values, **pack, **lossy},
             {"G": K.LOSSY_GROUPS, "STEPS": 5, "IDENTITY": ident, "OUT": 0})
            for ident in (False, True)
        ],
        *[(K.lossy_unpack_kernel, unpack, {"G": K.LOSSY_GROUPS, "STEPS": 5, "OUT": out}) for out in (0, 1, 2)],
        (K.lossy_exceptions_kernel, {"pos_ptr": "*i32", "raw_ptr": "*i32", "k": "i64", "n": "i64", "vals_ptr": "*i32",
                                     "BLOCK": "constexpr"}, {"BLOCK": 1024}),
        *[
            (K.lossy_rows_kernel, rows_k,
             {"ROWS": K.ROWS_TILE, "COLS": K.COLS_TILE, "STEPS": 5, "INVERSE": inv, "FIRST": first})
            for inv in (False, True)
            for first in (False, True)
            if inv or not first
        ],
    ]  # fmt: skip
    cast_pack = {
        "x_ptr": "*fp32", "n": "i64", "head_ptr": "*u8", "h": "i64", "total": "i64", "out_ptr": "*u8",
        "part_ptr": "*i64", "ITEM": "constexpr", "WIRE": "constexpr", "BLOCK": "constexpr",
    }  # fmt: skip
    cast_unpack = {
        "pay_ptr": "*u8", "n": "i64", "h": "i64", "total": "i64", "head_ptr": "*u8", "out_ptr": "*fp32", "s0": "i64",
        "s1": "i64", "cols": "i64", "part_ptr": "*i64", "verdict_ptr": "*i64", "ITEM": "constexpr",
        "WIRE": "constexpr", "BLOCK": "constexpr",
    }  # fmt: skip
    bits_pack = {"values_ptr": "*i64", "v_stride": "i64", "starts_ptr": "*i64", "s_stride": "i64", "n": "i64",
                 "words_ptr": "*i64", "n_words": "i64", "BLOCK": "constexpr"}  # fmt: skip
    bits_unpack = {"words_ptr": "*i64", "n_words": "i64", "starts_ptr": "*i64", "s_stride": "i64",
                   "widths_ptr": "*i64", "w_stride": "i64", "n": "i64", "out_ptr": "*i64",
                   "BLOCK": "constexpr"}  # fmt: skip
    seg_parts = {"data_ptr": "*u8", "table_ptr": "*i64", "n_segments": "i64", "skip_at": "i64", "skip_len": "i64",
                 "part_ptr": "*i64", "max_parts": "i64", "BLOCK": "constexpr"}  # fmt: skip
    seg_finish = {"part_ptr": "*i64", "max_parts": "i64", "table_ptr": "*i64", "n_segments": "i64", "skip_len": "i64",
                  "check_at": "i64", "data_ptr": "*u8", "out_ptr": "*i64", "MODE": "constexpr", "BLOCK": "constexpr",
                  "CHUNK": "constexpr"}  # fmt: skip
    specs += [
        (K.bits_pack_kernel, bits_pack, {"BLOCK": K.BITS_BLOCK}),
        (K.bits_unpack_kernel, bits_unpack, {"BLOCK": K.BITS_BLOCK}),
        (K.adler_segments_partials_kernel, seg_parts, {"BLOCK": K.ADLER_BLOCK}),
        *[(K.adler_segments_finish_kernel, seg_finish, {"MODE": m, "BLOCK": K.ADLER_BLOCK, "CHUNK": 1024})
          for m in (0, 1, 2)],
    ]  # fmt: skip
    for item, wire in ((4, 0), (4, 1), (4, 2)):
        specs.append((K.cast_pack_kernel, cast_pack, {"ITEM": item if wire == 0 else 2, "WIRE": wire, "BLOCK": 4096}))
        specs.append(
            (K.cast_unpack_kernel, cast_unpack, {"ITEM": item if wire == 0 else 2, "WIRE": wire, "BLOCK": 4096})
        )
    ids = {"sorted_ptr": "*i64", "perm_ptr": "*i64", "k_s0": "i64", "k_s1": "i64", "table_ptr": "*i64",
           "n_blocks": "i32"}  # fmt: skip
    summed = {
        "x_ptr": "*fp32", "rows": "i64", "cols": "i64", "n": "i64", **ids, "steps": "i32", "head_ptr": "*u8",
        "h": "i64", "total": "i64", "out_ptr": "*u8", "part_ptr": "*i64", "count_ptr": "*i64", "SRC": "constexpr",
        "TO": "constexpr", "ITEM": "constexpr", "SEGS": "constexpr", "COLS": "constexpr",
    }  # fmt: skip
    first = {
        "pay_ptr": "*u8", "rows": "i64", "cols": "i64", "n": "i64", **ids, "h": "i64", "total": "i64",
        "head_ptr": "*u8", "out_ptr": "*fp32", "s0": "i64", "s1": "i64", "part_ptr": "*i64", "verdict_ptr": "*i64",
        "count_ptr": "*i64", "ITEM": "constexpr", "WIRE": "constexpr", "SEGS": "constexpr", "COLS": "constexpr",
    }  # fmt: skip
    tile = {"SEGS": K.SUM_SEGS, "COLS": K.SUM_COLS, "FINISH": 1024}
    for wire in (0, 1, 2):
        item = 4 if wire == 0 else 2
        specs.append((K.cast_sum_pack_kernel, summed, {"SRC": 0, "TO": wire, "ITEM": item, **tile}))
        specs.append((K.cast_first_unpack_kernel, first, {"ITEM": item, "WIRE": wire, **tile}))
    return specs


def _check_aot() -> None:
    for fn, constexprs, cc, ptx in compiled_for_cuda(_aot_specs()):
        name = f"{fn.fn.__name__} {constexprs} sm_{cc}"
        assert "fma.rn.f32" not in ptx, f"{name}: contracted to FMA (reconstruction would differ)"
        assert "div.full" not in ptx and "div.approx" not in ptx, f"{name}: approximate division"
        if fn.fn.__name__ == "quantize_kernel":
            assert "div.rn.f32" in ptx, f"{name}: no IEEE division"
        print(name, "compiled")


def _check_no_interpreter() -> None:
    import torch

    from dlrm_compression import get_codec

    try:
        get_codec("lossy", kernels="triton").encode(torch.randn(4, 4), 1e-3)
    except RuntimeError as e:
        assert "TRITON_INTERPRET=1" in str(e), e
    else:
        raise AssertionError("triton backend on CPU ran without the interpreter")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    run_modes({"interpret": _check_interpret, "aot": _check_aot, "no_interpreter": _check_no_interpreter}, sys.argv[1])
