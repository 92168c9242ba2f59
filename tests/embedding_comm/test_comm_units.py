"""Single-process pieces of dlrm.embedding_comm: config validation, ids and duplicate-id gradients, layouts."""

from __future__ import annotations

import functools
import json
import operator
from pathlib import Path

import pytest
import torch
from torchrec import KeyedJaggedTensor

from dlrm.embedding_comm.comm_ops import Blocks, PooledA2ALayout, ReduceScatterLayout
from dlrm.embedding_comm.config import parse_compression_cfg
from dlrm.embedding_comm.ids import EMPTY_BAG, Region, chunk_ids, chunk_ids_of, keep_first_duplicates, sum_duplicates

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "compression"


# -- config ------------------------------------------------------------------------------------


def test_every_shipped_config_parses_and_builds_a_sharder():
    from hydra import compose, initialize_config_dir

    from dlrm.embedding_comm import fixed_bound, make_sharders

    names = set()
    for path in sorted(CONFIGS.glob("*.yaml")):
        # as the trainer gets it: composed (defaults lists, interpolations) by Hydra
        with initialize_config_dir(config_dir=str(CONFIGS.parent), version_base="1.3"):
            cfg = compose("config", overrides=[f"compression={path.stem}"]).compression
        spec = parse_compression_cfg(cfg)
        assert spec.name == path.stem
        bound = fixed_bound(0.01) if spec.kind == "compressed" else None
        (sharder,) = make_sharders(cfg, bound_fn_forward=bound, bound_fn_backward=bound)
        assert "table_wise" in sharder.sharding_types("cpu")
        names.add(spec.name)
    shipped = {"none", "fp16", "bf16", "int8", "qcomm_fp16", "qcomm_bf16", "qcomm_int8", "qcomm_mx4", "lossy", "auto"}
    shipped.add("dct_mp")
    assert shipped <= names


def test_row_wise_is_offered_on_cpu_unlike_stock_torchrec():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from dlrm.embedding_comm import make_sharders

    ours = make_sharders({"name": "x", "forward": {"codec": "none"}, "backward": {"codec": "none"}})[0]
    assert {"row_wise", "table_row_wise"} <= set(ours.sharding_types("cpu"))
    assert "row_wise" not in EmbeddingBagCollectionSharder().sharding_types("cpu")


def test_codec_params_that_do_not_fit_the_codec_name_the_key():
    from dlrm.embedding_comm import make_sharders

    # `compression=lossy compression.backward.codec=none` keeps lossy's params for `none`
    cfg = {"name": "x", "forward": {"codec": "lossy"}, "backward": {"codec": "none", "params": {"level": 1}}}
    with pytest.raises(
        ValueError,
        match=r"compression\.backward\.params \{'level': 1\} do not fit codec 'none'.*"
        r"~compression\.backward\.params",
    ):
        make_sharders(cfg, bound_fn_forward=lambda f, d, i: 0.01)


def test_a_bounded_codec_without_a_policy_says_what_it_needs():
    from dlrm.embedding_comm import make_sharders

    with pytest.raises(
        ValueError, match=r"compression\.forward\.codec 'lossy' is error-bounded: it needs a bound policy"
    ):
        make_sharders({"name": "x", "forward": {"codec": "lossy"}, "backward": {"codec": "none"}})


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"name": "x", "forward": {"codec": "lossy"}}, "compression.backward is missing"),
        (
            {"name": "x", "forward": {"codec": "lossy", "eb": 0.01}, "backward": {"codec": "none"}},
            "compression.forward.eb: the policy group owns every bound: policy.forward.eb",
        ),
        (
            {"name": "x", "forward": {"codec": "lossy", "mode": "relative"}, "backward": {"codec": "none"}},
            "compression.forward.mode",
        ),
        (
            {"name": "x", "forward": {"codec": "lossy", "bound": 1}, "backward": {"codec": "none"}},
            "unknown key(s) ['bound']",
        ),
        ({"name": "x", "kind": "qcomm", "qcomm": {"forward_precision": "fp12"}}, "compression.qcomm.forward_precision"),
        (
            {"name": "x", "kind": "qcomm", "qcomm": {"forward_precision": "fp16", "mx4_quantize_dim": 8}},
            "compression.qcomm.mx4_quantize_dim(_bwd) only apply to MX4",
        ),
        ({"name": "x", "kind": "zip"}, "compression.kind"),
        (
            {
                "name": "x",
                "forward": {"codec": "none"},
                "backward": {"codec": "none"},
                "sharding_types": ["grid_shard"],
            },
            "compression.sharding_types",
        ),
    ],
)
def test_bad_config_names_the_key(cfg, message):
    with pytest.raises(
        ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        parse_compression_cfg(cfg)


def test_unknown_codec_is_reported_by_name():
    from dlrm.embedding_comm import make_sharders

    with pytest.raises(ValueError, match="unknown codec 'zfp'"):
        make_sharders({"name": "x", "forward": {"codec": "zfp"}, "backward": {"codec": "none"}})


def test_policy_returning_a_bad_bound_is_rejected_with_feature_and_iteration():
    from dlrm.embedding_comm.bounds import policy_values

    with pytest.raises(ValueError, match="'f_b' \\(forward, iteration 7\\)"):
        policy_values(lambda f, d, i: -1.0 if f == "f_b" else 0.1, ["f_a", "f_b"], "forward", 7)


# -- ids ------------------------------------------------------------------------------------------


def kjt(lengths: list[list[int]], values: list[int], weights: bool = False) -> KeyedJaggedTensor:
    keys = [f"k{i}" for i in range(len(lengths))]
    v = torch.tensor(values)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=v,
        lengths=torch.tensor(functools.reduce(operator.iadd, lengths, [])),
        weights=torch.ones(len(values)) if weights else None,
    )


def test_chunk_ids_gives_ids_only_where_every_bag_holds_at_most_one_id():
    # 2 keys, stride 4: key 0 is single-valued; key 1 has an empty bag at position 2
    k = kjt([[1, 1, 1, 1], [1, 1, 0, 1]], [10, 11, 12, 13, 20, 21, 23])
    got = chunk_ids(k, [Region(0, 1, 0, 4), Region(0, 2, 0, 2), Region(0, 2, 2, 2), Region(1, 1, 3, 1)])
    assert torch.equal(got[0], torch.tensor([[10], [11], [12], [13]]))
    assert torch.equal(got[1], torch.tensor([[10, 20], [11, 21]]))
    assert torch.equal(got[2], torch.tensor([[12, EMPTY_BAG], [13, 23]]))  # the empty bag pools to 0: its own id
    assert chunk_ids(kjt([[2, 1]], [5, 6, 7]), [Region(0, 1, 0, 2)]) == [None]  # a bag of two ids
    assert torch.equal(got[3], torch.tensor([[23]]))
    assert chunk_ids(kjt([[1, 1]], [1, 2], weights=True), [Region(0, 1, 0, 2)]) == [None]  # weighted


def test_chunk_ids_of_several_kjts_gives_each_kjts_own_chunk_ids():
    one = kjt([[1, 1, 1, 1], [1, 1, 0, 1]], [10, 11, 12, 13, 20, 21, 23])
    two = kjt([[2, 1]], [5, 6, 7])
    r1, r2 = [Region(0, 2, 0, 2), Region(1, 1, 2, 2)], [Region(0, 1, 0, 2), Region(0, 1, 1, 1)]
    got = chunk_ids_of([(one, r1), (None, r1), (two, r2)])
    want = [chunk_ids(one, r1), [None, None], chunk_ids(two, r2)]
    assert len(got) == 3
    for g, w in zip(got, want, strict=True):
        assert [x is None for x in g] == [x is None for x in w]
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True) if a is not None)
    assert got[2][1] is not None and torch.equal(got[2][1], torch.tensor([[7]]))  # the second bag holds one id


def test_duplicate_id_gradients_sum_to_the_same_per_id_totals_with_inf():
    ids = torch.tensor([[4, 1], [7, 1], [4, 2], [4, 1], [9, 3]])
    widths = [3, 2]
    g = torch.randint(-5, 6, (5, 5)).float()
    g[3, 0] = float("inf")
    sent = sum_duplicates(g, ids, widths)
    assert torch.equal(sent[0, :3], sent[2, :3]) and torch.equal(sent[0, :3], sent[3, :3])  # equal rows per id
    received = keep_first_duplicates(sent.clone(), ids, widths)
    assert (received[2:4, :3] == 0).all() and (received[3, 3:] == 0).all()  # zeros, not inf * 0 = nan
    for k, (c0, c1) in enumerate([(0, 3), (3, 5)]):
        for i in ids[:, k].unique():
            rows = ids[:, k] == i
            assert torch.equal(received[rows, c0:c1].sum(0), g[rows, c0:c1].sum(0))


def test_duplicate_id_sums_and_first_rows_match_a_row_by_row_reference_bit_for_bit():
    """Zipf ids (many duplicates, empty bags), unequal and empty blocks: each id's rows summed in
    row order in float32, the first row per id kept, as a plain loop over the rows does it."""
    from dlrm.bench.criteo_like import criteo_like_batch

    batch = criteo_like_batch(rows=300, tables=4, dim=3, seed=7)
    ids = torch.stack([t["ids"] for t in batch.values()], 1)
    ids[::17, 2] = EMPTY_BAG
    widths = [5, 0, 3, 7]
    g = torch.randn(300, sum(widths), generator=torch.Generator().manual_seed(7)) * 1e3
    want_sum, want_keep, c = g.clone(), torch.zeros_like(g), 0
    for k, w in enumerate(widths):
        acc: dict[int, torch.Tensor] = {}
        first: dict[int, int] = {}
        for r, i in enumerate(ids[:, k].tolist()):
            acc[i] = acc.get(i, torch.zeros(w)) + g[r, c : c + w]
            first.setdefault(i, r)
        for r, i in enumerate(ids[:, k].tolist()):
            want_sum[r, c : c + w] = acc[i]
            want_keep[r, c : c + w] = g[r, c : c + w] if first[i] == r else 0.0
        c += w
    assert torch.equal(sum_duplicates(g, ids, widths).view(torch.int32), want_sum.view(torch.int32))
    assert torch.equal(keep_first_duplicates(g.clone(), ids, widths).view(torch.int32), want_keep.view(torch.int32))


# -- layouts ----------------------------------------------------------------------------------------


def test_pooled_a2a_layout_cuts_rows_out_and_columns_back():
    blocks = [Blocks(["a"], [2]), Blocks(["b", "c"], [1, 3])]
    layout = PooledA2ALayout(rank=1, batch_size_per_rank=[3, 2], blocks_per_rank=blocks)
    x = torch.arange(5 * 4).view(5, 4).float()  # rank 1's lookup output: [B_global, D_local]
    assert [c.shape[0] for c in layout.split("forward", x)] == [3, 2]
    assert layout.recv_shape("forward", 0) == (2, 2) and layout.recv_shape("backward", 0) == (3, 4)
    g = torch.arange(2 * 6).view(2, 6).float()  # gradient of [B_local, D_global]
    assert [c.shape[1] for c in layout.split("backward", g)] == [2, 4]
    assert layout.send_blocks("forward", 0) == blocks[1] and layout.send_blocks("backward", 0) == blocks[0]
    # Received chunks are decoded into windows of one output: peers' columns forward, rows backward.
    out, windows = layout.output("forward", x)
    assert out.shape == (2, 6) and [w.shape for w in windows] == [(2, 2), (2, 4)]
    windows[0].fill_(1.0)
    windows[1].fill_(2.0)
    assert torch.equal(out, torch.tensor([[1.0] * 2 + [2.0] * 4] * 2))
    out, windows = layout.output("backward", g)
    assert out.shape == (5, 4) and [w.shape for w in windows] == [(3, 4), (2, 4)]
    assert windows[1].data_ptr() == out[3:].data_ptr()


def test_reduce_scatter_layout_sums_partials_in_rank_order():
    layout = ReduceScatterLayout(rank=0, rows_per_rank=[2, 1], blocks=Blocks(["a"], [2]), world_size=2)
    parts = [torch.ones(2, 2), torch.full((2, 2), 2.0)]
    assert torch.equal(layout.merge("forward", parts), torch.full((2, 2), 3.0))
    assert layout.output("forward", parts[0]) is None  # partial sums are added, not placed
    out, windows = layout.output("backward", parts[0])
    assert out.shape == (3, 2) and [w.shape for w in windows] == [(2, 2), (1, 2)]
    g = torch.ones(2, 2)
    chunks = layout.split("backward", g)
    assert chunks[0] is chunks[1] is g  # one gradient, encoded once, sent to every rank


@pytest.mark.parametrize("width", [16, 128])
def test_qcomm_ratios_are_what_the_formats_send(width):
    """The measured ratio against the formats' own layout: fp16/bf16 values of half an fp32's
    bytes (torch's element sizes), fbgemm's row-wise int8 with an fp32 scale and bias per 32
    values (QCommsConfig's default row length), and MX4's 4-bit values with one 8-bit exponent
    per group (8 forward, 16 backward in qcomm_mx4.yaml)."""
    import yaml

    from dlrm.embedding_comm import parse_compression_cfg, qcomm_ratios

    configs = Path(__file__).resolve().parents[2] / "configs" / "compression"
    fp32 = torch.finfo(torch.float32).bits // 8
    int8_row = 32 * (torch.iinfo(torch.int8).bits // 8) + 2 * fp32  # per 32 values
    expected = {
        "qcomm_fp16": fp32 / torch.finfo(torch.float16).bits * 8,
        "qcomm_bf16": fp32 / torch.finfo(torch.bfloat16).bits * 8,
        "qcomm_int8": 32 * fp32 / int8_row,
    }
    for name, ratio in expected.items():
        spec = parse_compression_cfg(yaml.safe_load((configs / f"{name}.yaml").read_text()))
        assert qcomm_ratios(spec, width) == {"forward_ratio": ratio, "backward_ratio": ratio}, name
    mx4 = parse_compression_cfg(yaml.safe_load((configs / "qcomm_mx4.yaml").read_text()))
    per_group = {g: g * fp32 / (g * 4 / 8 + 1) for g in (8, 16)}  # e2m1 nibbles + one exponent byte
    assert qcomm_ratios(mx4, width) == {"forward_ratio": per_group[8], "backward_ratio": per_group[16]}


def test_dct_mp_thresholds_refresh_on_training_chunks_only_and_survive_a_checkpoint():
    from dlrm.embedding_comm.codec import DirectionCodec
    from dlrm.embedding_comm.config import DirectionSpec

    spec = DirectionSpec(codec="threshold", dedup=False, params={"keep": 0.25, "refresh_every": 10})
    dc = DirectionCodec(spec, "forward")
    train = torch.arange(1.0, 9.0).view(4, 2)  # |x| 1..8: the 2 largest of 8 are >= 7
    evaluation = train * 100
    assert dc.thresholds(train, ["f"], [2], 0, True, "a2a") == [7.0]
    # an evaluation chunk at a refresh iteration is thresholded as it comes, not remembered
    assert dc.thresholds(evaluation, ["f"], [2], 10, False, "a2a") == [7.0]
    assert dc.thresholds(train * 2, ["f"], [2], 10, True, "a2a") == [14.0]  # the training refresh
    assert dc.thresholds(train, ["f"], [2], 11, True, "a2a") == [14.0]  # kept until the next one
    assert dc.thresholds(train, ["f"], [2], 11, True, "reduce_scatter") == [7.0]  # each stage its own
    twin = DirectionCodec(spec, "forward")
    twin.load_state_dict(json.loads(json.dumps(dc.state_dict())))  # a rank's checkpoint
    assert twin.thresholds(train, ["f"], [2], 12, True, "a2a") == [14.0]
    with pytest.raises(ValueError, match="have no effect with forward_positions"):
        DirectionCodec(DirectionSpec("threshold", params={"forward_positions": True, "refresh_every": 5}), "backward")
