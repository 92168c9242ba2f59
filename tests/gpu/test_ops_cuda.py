"""The codec ops on CUDA (their Triton kernels) against their CPU implementation, bit for bit, and
the launches each makes against what :data:`compression.ops.LAUNCHES` declares (the figure the
launch budget counts on CPU), seen by the profiler; the GPU collective benchmark's table."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dlrm.bench import gpu_collective
from dlrm_compression import dedup, ops

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False here); run `make test-gpu` on a GPU machine"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync")


def launches(fn) -> int:
    """Kernel launches and copies the CUDA runtime saw while ``fn()`` ran (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name in LAUNCH_EVENTS)


def ints(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def chunk(rows: int = 2048, nb: int = 13, dim: int = 64, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (rows, nb), generator=g)
    table = torch.randn(300, nb * dim, generator=g) * 0.05
    x = torch.cat([table[ids[:, b], b * dim : (b + 1) * dim] for b in range(nb)], 1).to(dtype)
    x[ids[:, 0] == ids[0, 0], 0] = float("nan")
    return x, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lossy_pack_and_unpack_on_cuda_are_the_cpu_ops(dtype: torch.dtype) -> None:
    x, ids = chunk(dtype=dtype)
    widths = [64] * 13
    plan = dedup.id_plan(ids)
    bounds = torch.tensor([10.0 ** -(1 + b % 3) for b in range(13)], dtype=torch.float64)
    cpu = ops.lossy_pack(x, plan.first, plan.counts, bounds, widths, False)
    gi = ids.cuda()
    gplan = dedup.id_plan(gi)
    for got, want in zip(gplan, plan, strict=True):
        assert torch.equal(ints(got), ints(want))
    cuda = ops.lossy_pack(x.cuda(), gplan.first, gplan.counts, bounds.cuda(), widths, False)
    lengths = cpu[4].tolist()
    assert cuda[4].tolist() == lengths
    used = (lengths[0], lengths[1] // 4, lengths[2] // 4, lengths[3] // x.element_size())
    for a, b, k in zip(cuda[:4], cpu[:4], used, strict=True):
        assert torch.equal(ints(a)[:k], ints(b)[:k])
    n = sum(int(c) * 64 for c in plan.counts)
    sections = [t[:k] for t, k in zip(cpu[:4], (-(-n // 32), *used[1:]), strict=True)]
    counts, eb = plan.counts.tolist(), bounds.tolist()
    out = torch.empty_like(x)
    ops.lossy_unpack(*sections, counts, eb, widths, plan.inverse, plan.first, out)
    gout = torch.empty_like(x.cuda())
    ops.lossy_unpack(*[t.cuda() for t in sections], counts, eb, widths, gplan.inverse, gplan.first, gout)
    assert torch.equal(ints(gout), ints(out))


@pytest.mark.parametrize("wire", [0, 1, 2])
def test_the_fused_casts_on_cuda_are_the_cpu_ops(wire: int) -> None:
    x, _ = chunk()
    x[0, :3] = torch.tensor([7.0, float("inf"), -0.0])  # (NaN's bits are a device's own in a cast)
    head = torch.randint(0, 256, (104,), dtype=torch.uint8)
    head[20:24] = 0
    cpu = ops.cast_pack(x, head, wire)
    cuda = ops.cast_pack(x.cuda(), head.cuda(), wire)
    assert torch.equal(cuda.cpu(), cpu)
    out, gout = torch.empty_like(x), torch.empty_like(x.cuda())
    assert ops.cast_unpack(cpu, head, wire, out).tolist() == [1, 1]
    assert ops.cast_unpack(cuda, head.cuda(), wire, gout).tolist() == [1, 1]
    assert torch.equal(ints(gout), ints(out))


@pytest.mark.parametrize("wire", [0, 1, 2])
def test_the_casts_with_duplicate_ids_on_cuda_are_the_cpu_ops(wire: int) -> None:
    """A gradient's rows summed by id as they are cast (in row order: the same floats) and each
    id's first row kept as they are decoded, on CUDA as on the CPU; the ids shared by every block
    too (one sorted column)."""
    x, ids = chunk()
    x[:, 0] = torch.randn(x.shape[0])  # (no NaN: a sum's NaN bits are a device's own)
    x[0, :3] = torch.tensor([7.0, float("inf"), -0.0])
    head = torch.randint(0, 256, (104,), dtype=torch.uint8)
    head[20:24] = 0
    widths = [64] * 13
    for keys in (ids, ids[:, :1].expand(-1, 13)):
        srt, perm = dedup.id_sort(keys)
        gsrt, gperm = dedup.id_sort(keys.cuda())
        cpu = ops.cast_pack_summed(x, head, wire, srt, perm, widths)
        cuda = ops.cast_pack_summed(x.cuda(), head.cuda(), wire, gsrt, gperm, widths)
        assert torch.equal(cuda.cpu(), cpu)
        out, gout = torch.empty_like(x), torch.empty_like(x.cuda())
        assert ops.cast_unpack_first(cpu, head, wire, out, srt, perm, widths).tolist() == [1, 1]
        assert ops.cast_unpack_first(cuda, head.cuda(), wire, gout, gsrt, gperm, widths).tolist() == [1, 1]
        assert torch.equal(ints(gout), ints(out))
        bad = cuda.clone()
        bad[-1] ^= 1
        assert ops.cast_unpack_first(bad, head.cuda(), wire, gout, gsrt, gperm, widths).tolist() == [0, 1]


def test_each_codec_op_launches_what_it_declares() -> None:
    x, ids = chunk()
    x, ids = x.cuda(), ids.cuda()
    widths = [64] * 13
    rel = torch.full((13,), 0.01, dtype=torch.float64, device="cuda")
    k = ids.t().contiguous()
    s, perm = torch.sort(k, stable=True)
    plan = dedup.id_plan(ids)
    bounds = ops.relative_bounds(x, rel, widths)
    payload = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    end = torch.tensor(700_000, device="cuda")
    head = torch.zeros(104, dtype=torch.uint8, device="cuda")
    cast = ops.cast_pack(x, head, 1)
    out = torch.empty_like(x)
    widths_t = torch.arange(1000, device="cuda") % 13
    starts = widths_t.cumsum(0) - widths_t
    values = torch.zeros(1000, dtype=torch.int64, device="cuda")
    words = ops.bits_pack(values, starts, 200)
    segments = ([0, 100_000, 500_000], [100_000, 400_000, 24], 20, 4, 20)
    by_id = dedup.id_sort(ids)
    summed = ops.cast_pack_summed(x, head, 1, *by_id, widths)
    seen = {
        "cast_pack_summed": launches(lambda: ops.cast_pack_summed(x, head, 1, *by_id, widths)),
        "cast_unpack_first": launches(lambda: ops.cast_unpack_first(summed, head, 1, out, *by_id, widths)),
        "cast_pack": launches(lambda: ops.cast_pack(x, head, 1)),
        "cast_unpack": launches(lambda: ops.cast_unpack(cast, head, 1, out)),
        "relative_bounds": launches(lambda: ops.relative_bounds(x, rel, widths)),
        "id_runs": launches(lambda: ops.id_runs(s, perm, ids)),
        "lossy_pack": launches(lambda: ops.lossy_pack(x, plan.first, plan.counts, bounds, widths, False)),
        "adler32_holds": launches(lambda: ops.adler32_holds(payload, end, 0, 20, 4, 20)),
        "bits_pack": launches(lambda: ops.bits_pack(values, starts, 200)),
        "bits_unpack": launches(lambda: ops.bits_unpack(words, starts, widths_t)),
        "adler32_segments_holds": launches(lambda: ops.adler32_segments_holds(payload, *segments)),
    }
    declared = {name: ops.LAUNCHES[name] for name in seen if not callable(ops.LAUNCHES[name])}
    declared["lossy_pack"] = ops.LAUNCHES["lossy_pack"](x, plan.first, plan.counts, bounds, widths, False)  # type: ignore[operator]
    declared["adler32_segments_holds"] = ops.LAUNCHES["adler32_segments_holds"](payload, *segments)  # type: ignore[operator]
    print("launches seen by the profiler / declared:", {n: (seen[n], declared[n]) for n in seen})
    assert seen == declared


def test_the_ids_codec_on_cuda_writes_and_reads_the_cpu_payloads() -> None:
    """The input codec's device path on CUDA (its bit-packing and check kernels) writes the bytes the
    same code writes on CPU tensors, coded and stored, and decodes a collective's payloads (one
    received buffer) to the same ids; a damaged one is refused."""
    from dlrm_compression.format import PayloadError
    from dlrm_compression.ids_codec import STORED_VERSION, IdsCodec

    g = torch.Generator().manual_seed(3)
    bags = [300, 300, 0, 7, 2]
    lengths = torch.randint(0, 4, (sum(bags),), generator=g, dtype=torch.int32)
    n = int(lengths.sum())
    values = torch.randint(0, 5000, (n,), generator=g)
    values[:5] = torch.tensor([-(2**63), 2**63 - 1, -1, 0, 1])
    weights = torch.rand(n, generator=g)
    codec = IdsCodec(backend="device")
    for keys_per_dest in ([5], [2, 1, 1, 1], [1, 0, 4]):
        cpu = codec.encode(lengths, values, bags, weights, keys_per_dest)
        gpu = codec.encode(lengths.cuda(), values.cuda(), bags, weights.cuda(), keys_per_dest)
        assert [p.numel() for p in cpu] == [p.numel() for p in gpu]
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu, strict=True))
        assert any(int(p[4]) == STORED_VERSION for p in cpu) or keys_per_dest == [5]
        received = list(torch.split(torch.cat(gpu), [p.numel() for p in gpu]))
        for a, b in zip(codec.decode_all(cpu), codec.decode_all(received), strict=True):
            assert torch.equal(a.lengths, b.lengths.cpu()) and torch.equal(a.values, b.values.cpu())
            assert torch.equal(a.weights, b.weights.cpu()) and a.bags_per_key == b.bags_per_key
        bad = torch.cat(gpu)
        bad[bad.numel() - 3] ^= 1
        with pytest.raises(PayloadError, match="checksum"):
            codec.decode_all(list(torch.split(bad, [p.numel() for p in gpu])))


def test_the_gpu_collective_benchmark_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_collective.main(["--device", "cuda", "--repeats", "5", "--warmup", "2"]) == 0
    print(capsys.readouterr().out)
