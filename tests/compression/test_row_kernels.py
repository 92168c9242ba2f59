"""The row cache's Triton kernels (:mod:`compression.row_kernels`): bit-identical to their torch
references (:mod:`compression.row_reference`) in the interpreter, on edge cases (NaN and inf
rows, no-room bounds, empty blocks, tiles' carries); compile for sm_80/sm_90 without FMA.

Each check runs in a fresh interpreter process, as in ``test_triton.py``: TRITON_INTERPRET must
be set before the kernels are decorated, and unset for the ahead-of-time CUDA compile.
"""

from __future__ import annotations

import sys

from fresh_process import ROOT, check_in_process, compiled_for_cuda


def test_row_cache_kernels_are_bit_identical_to_the_reference_in_the_interpreter():
    check_in_process(__file__, "interpret", interpret=True, timeout=600)


def test_row_cache_kernels_compile_for_cuda_sm80_and_sm90_without_a_gpu():
    check_in_process(__file__, "aot", interpret=False, timeout=600)


# --------------------------------------------------------------------------- subprocess side ----


def _check_interpret() -> None:
    import torch

    from dlrm_compression import row_kernels as K
    from dlrm_compression import row_reference as R

    def eq(a, b, what):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
        if a.dtype.is_floating_point:
            bits = torch.int64 if a.dtype == torch.float64 else torch.int32
            a, b = a.view(bits), b.view(bits)
        assert torch.equal(a, b), f"{what}: kernel differs from reference"

    g = torch.Generator().manual_seed(0)
    for n, q in [(3, 50), (1, 1), (4, 2500), (2, 0), (0, 5), (5, 1024), (2, 1025)]:
        counts = torch.randint(0, q + 1, (n,), generator=g)
        valid = torch.arange(q)[None] < counts[:, None]
        held = valid & (torch.rand(n, q, generator=g) < 0.6)
        moved = held & (torch.rand(n, q, generator=g) < 0.4)
        if n > 1:
            held[1], moved[1] = valid[1], False  # every id a hit: an empty block
        uid = torch.randint(-5, 100, (n, q), generator=g)
        for a, b in zip(K.row_layout(valid, held, moved, uid), R.row_layout(valid, held, moved, uid), strict=True):
            eq(a, b, f"row_layout {n} {q}")
    print("row_layout OK")

    for nb, q, w, n in [(3, 50, 8, 50), (2, 70, 130, 70), (1, 1, 1, 1), (4, 33, 16, 40)]:
        dec = torch.randn(n, nb, w, generator=g)
        dec[0, 0, 0], dec[-1, 0, -1] = float("nan"), -0.0
        valid = torch.arange(q)[None] < torch.randint(1, q + 1, (nb,), generator=g)[:, None]
        held = valid & (torch.rand(nb, q, generator=g) < 0.6)
        moved = held & (torch.rand(nb, q, generator=g) < 0.4)
        fresh, _, place, *_ = R.row_layout(valid, held, moved, torch.zeros(nb, q, dtype=torch.int64))
        table = torch.randn(3 * q + 1, w, generator=g)
        table[2, 0] = float("inf")
        rows = torch.randint(0, 3 * q + 1, (nb, q), generator=g) * held
        delta = torch.rand(nb, generator=g) < 0.5
        inverse = torch.randint(0, q, (nb, n), generator=g)
        for d in (dec, dec.transpose(0, 1).contiguous().transpose(0, 1)):
            args = (d, place, fresh, moved, table, rows, delta, inverse)
            for a, b in zip(K.row_merge(*args), R.row_merge(*args), strict=True):
                eq(a, b, f"row_merge {nb} {q} {w}")
    print("row_merge OK")

    for nb, q, pool in [(3, 50, 40), (1, 1, 3), (5, 1500, 3000), (2, 0, 5)]:
        bits = 58
        held_ids = [torch.randperm(pool, generator=g)[: pool // 2].sort().values for _ in range(nb)]
        keys = torch.cat([h | (k << bits) for k, h in enumerate(held_ids)])
        index = torch.stack(
            [torch.cat([keys, torch.tensor([2**63 - 1])]), torch.randperm(keys.numel() + 1, generator=g)]
        )
        ids = torch.randint(0, pool, (q + 3, nb), generator=g)
        first = torch.randint(0, q + 3, (nb, q), generator=g)
        counts = torch.randint(0, q + 1, (nb,), generator=g)
        for idv in (ids, ids[:, :1].expand(q + 3, nb), ids.to(torch.int32)):
            args = (index, idv, first, counts, bits)
            for a, b in zip(K.row_find(*args), R.row_find(*args), strict=True):
                eq(a, b, f"row_find {nb} {q} {idv.dtype}")
    print("row_find OK")

    cases = [(3, 50, 8, 60, True), (2, 70, 130, 70, True), (1, 1, 1, 1, True), (4, 33, 16, 40, False)]
    for nb, q, w, n, deltas in [*cases, (2, 0, 4, 0, True), (6, 100, 3, 100, True)]:
        scale = torch.pow(10.0, torch.randint(-3, 3, (n, nb, w), generator=g).float())
        xp = torch.randn(n, nb, w, generator=g) * scale
        if n > 3:
            xp[1, 0, 0], xp[2, -1, -1], xp[3, 0, 1] = float("nan"), float("inf"), -0.0
        first = torch.randint(0, max(n, 1), (nb, q), generator=g)
        table = torch.randn(3 * q + 1, w, generator=g)
        if q > 3:
            table[3, 0] = float("nan")
        held = torch.rand(nb, q, generator=g) < 0.7
        rows = torch.randint(0, 3 * q + 1, (nb, q), generator=g) * held
        if q and n:  # hits: held rows near the exact ones
            exact = xp[first[held], torch.arange(nb)[:, None].expand(nb, q)[held]]
            table[rows[held]] = exact + 1e-4 * torch.randn(int(held.sum()), w, generator=g)
            table[0] = 0
        bounds = torch.tensor([0.01, 1e-9, float("nan"), float("inf"), -1.0, 0.5][:nb]).double()
        args = (xp, first, table, rows, held, bounds, deltas)
        got, want = K.row_classify(*args), R.row_classify(*args)
        for a, b in zip(got, want, strict=True):
            eq(a, b, f"row_classify {nb} {q} {w}")
        moved, delta = want[0], want[3]
        valid = torch.arange(q)[None] < torch.randint(0, q + 1, (nb,), generator=g)[:, None]
        _, order, _, _, empty, *_ = R.row_layout(valid, held & valid, moved & valid, torch.zeros(nb, q).long())
        uid = torch.randint(0, 1000, (nb, q), generator=g)
        args = (xp, first, table, rows, moved, delta, order, empty, uid)
        for a, b in zip(K.row_sent(*args), R.row_sent(*args), strict=True):
            eq(a, b, f"row_sent {nb} {q} {w}")
    print("row_classify row_sent OK")

    for nb, q, length, total in [(3, 50, 37, 200), (1, 1, 0, 80), (4, 700, 123, 1200), (2, 3000, 16, 5000)]:
        payload = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=g)
        payload[8:16] = torch.tensor([length], dtype=torch.int64).view(torch.uint8)
        held = torch.rand(nb, q, generator=g) < 0.5
        for skip in (0, 8):
            eq(K.row_moved(payload, held, 8, 24, skip), R.row_moved(payload, held, 8, 24, skip), f"row_moved {nb} {q}")
    print("row_moved OK")

    for nb, q in [(3, 50), (1, 1), (4, 700), (2, 3000), (1, 1024), (3, 7), (0, 4)]:
        held = torch.rand(nb, q, generator=g) < 0.5
        moved = held & (torch.rand(nb, q, generator=g) < 0.5)
        for a, b in zip(K.row_bits(held, moved), R.row_bits(held, moved), strict=True):
            eq(a, b, f"row_bits {nb} {q}")
    print("row_bits OK")


def _aot_specs():
    from dlrm_compression import row_kernels as K

    c = "constexpr"
    layout = {
        "valid_ptr": "*i1", "held_ptr": "*i1", "moved_ptr": "*i1", "uid_ptr": "*i64", "rows": "i64",
        "fresh_ptr": "*i1", "order_ptr": "*i64", "place_ptr": "*i64", "sending_ptr": "*i1", "empty_ptr": "*i1",
        "n_held_ptr": "*i64", "ids_ptr": "*i64", "CHUNK": c,
    }  # fmt: skip
    merge = {
        "dec_ptr": "*fp32", "dec_s0": "i64", "dec_s1": "i64", "place_ptr": "*i64", "fresh_ptr": "*i1",
        "moved_ptr": "*i1", "table_ptr": "*fp32", "rows_ptr": "*i64", "delta_ptr": "*i1", "inv_ptr": "*i64",
        "unique_ptr": "*fp32", "spread_ptr": "*fp32", "n_blocks": "i64", "q": "i64", "n_rows": "i64", "width": "i64",
        "ROWS": c, "COLS": c,
    }  # fmt: skip
    find = {
        "index_ptr": "*i64", "index_s0": "i64", "m": "i64", "steps": "i32", "ids_ptr": "*i64", "ids_s0": "i64",
        "ids_s1": "i64", "first_ptr": "*i64", "counts_ptr": "*i64", "n": "i64", "q": "i64", "bits": "i32",
        "uid_ptr": "*i64", "valid_ptr": "*i1", "rows_ptr": "*i64", "held_ptr": "*i1", "keys_ptr": "*i64", "BLOCK": c,
    }  # fmt: skip
    classify = {
        "x_ptr": "*fp32", "xs0": "i64", "xs1": "i64", "first_ptr": "*i64", "table_ptr": "*fp32", "rows_ptr": "*i64",
        "held_ptr": "*i1", "bounds_ptr": "*fp64", "q": "i64", "width": "i64", "n_tiles": "i64", "moved_ptr": "*i1",
        "part_ptr": "*i64", "big_ptr": "*fp32", "ROWS": c, "COLS": c,
    }  # fmt: skip
    finish = {
        "part_ptr": "*i64", "big_ptr": "*fp32", "n_tiles": "i64", "bounds_ptr": "*fp64", "deltas": "i32",
        "scale": "fp32", "held_ptr": "*i64", "hit_ptr": "*i64", "delta_ptr": "*i1", "coded_ptr": "*fp64", "CHUNK": c,
    }  # fmt: skip
    sent = {
        "x_ptr": "*fp32", "xs0": "i64", "xs1": "i64", "first_ptr": "*i64", "table_ptr": "*fp32", "rows_ptr": "*i64",
        "moved_ptr": "*i1", "delta_ptr": "*i1", "order_ptr": "*i64", "empty_ptr": "*i1", "uid_ptr": "*i64",
        "out_ptr": "*fp32", "ids_ptr": "*i64", "n_blocks": "i64", "q": "i64", "width": "i64", "ROWS": c, "COLS": c,
    }  # fmt: skip
    moved = {
        "held_ptr": "*i1", "n": "i64", "counts_ptr": "*i64", "pay_ptr": "*u8", "pay_n": "i64", "lengths_at": "i64",
        "head": "i64", "skip": "i64", "out_ptr": "*i1", "BLOCK": c,
    }  # fmt: skip
    bits = {
        "held_ptr": "*i1", "moved_ptr": "*i1", "n": "i64", "n_pad": "i64", "counts_ptr": "*i64", "tiles": "i64",
        "bits_ptr": "*u8", "bytes_ptr": "*i64", "BLOCK": c,
    }  # fmt: skip
    tiles = {"ROWS": K.CLASSIFY_ROWS, "COLS": K.CLASSIFY_COLS}
    return [
        (K.row_layout_kernel, layout, {"CHUNK": K.LAYOUT_CHUNK}),
        (K.row_merge_kernel, merge, {"ROWS": K.MERGE_ROWS, "COLS": K.MERGE_COLS}),
        (K.row_find_kernel, find, {"BLOCK": K.FIND_BLOCK}),
        (K.row_classify_kernel, classify, tiles),
        (K.row_bounds_kernel, finish, {"CHUNK": 1024}),
        (K.row_sent_kernel, sent, {"ROWS": K.SENT_ROWS, "COLS": K.SENT_COLS}),
        (K.held_counts_kernel, {"held_ptr": "*i1", "n": "i64", "counts_ptr": "*i64", "BLOCK": c}, {"BLOCK": 1024}),
        (K.row_moved_kernel, moved, {"BLOCK": K.MOVED_BLOCK}),
        (K.row_bits_kernel, bits, {"BLOCK": K.MOVED_BLOCK}),
        (K.bits_pack8_kernel, {"bits_ptr": "*u8", "n_bytes": "i64", "out_ptr": "*u8", "BLOCK": c}, {"BLOCK": 1024}),
    ]


def _check_aot() -> None:
    for fn, _, cc, ptx in compiled_for_cuda(_aot_specs()):
        name = f"{fn.fn.__name__} sm_{cc}"
        assert "fma.rn" not in ptx, f"{name}: contracted to FMA (the reference rounds twice)"
        print(name, "compiled")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    {"interpret": _check_interpret, "aot": _check_aot}[sys.argv[1]]()
    print("ALL OK")
