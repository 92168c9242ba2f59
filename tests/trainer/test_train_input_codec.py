"""compression.input=ids through the trainer: the same losses as without it, fewer input bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_artifacts import scalars
from trainer_runs import train

from dlrm.embedding_comm.config import parse_compression_cfg


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


# compression=none; lossy table-wise (its dedup by id takes the input codec's plans); and lossy
# with hot rows replicated (bags of 0 or 1 cold ids: coded lengths, the keys with empty bags sorted)
@pytest.mark.parametrize(
    "base",
    [["compression=none"], ["sharding=table_wise"], ["sharding=table_wise", "placement.hot_rows=auto"]],
    ids=["none", "lossy", "hot_rows"],
)
def test_coded_input_trains_bit_identically_to_the_uncoded_one(tmp_path, cache, base):
    runs = {}
    for name, extra in (("plain", []), ("ids", ["compression.input=ids"])):
        run_dir = tmp_path / name
        train(run_dir, cache, [*base, "max_iterations=6", "loss_log=true", *extra])
        runs[name] = ((run_dir / "losses.txt").read_text(), json.loads((run_dir / "metrics.json").read_text()))
    (ref, m0), (got, m1) = runs["plain"], runs["ids"]
    assert ref == got and len(ref.splitlines()) >= 6
    stock, coded = m0["wire_bytes_by_path"]["input"], m1["wire_bytes_by_path"]["input"]
    # 26 single-valued Criteo features: about one byte an id, no (or 1-bit) lengths, against 8 + 4 bytes
    assert 0 < coded < stock / 4, (coded, stock)
    # the output dist's dedup by id sorts nothing the input codec sorted: every chunk with ids takes
    # its batch's plan (and the numbers above are the same as the sorting run's)
    plans, reused = (
        sum(scalars(tmp_path / "ids", f"comm/ids/{k}").get(f"comm/ids/{k}", {}).values())
        for k in ("plans", "plans_reused")
    )
    if base == ["sharding=table_wise"]:
        assert reused == plans > 0, (reused, plans)
    elif base == ["compression=none"]:
        assert plans == reused == 0
    else:
        assert 0 <= reused < plans, (reused, plans)  # keys with empty bags: sorted (not reused)


def test_input_ids_with_torchrecs_own_input_dist_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"compression.input=ids .*kind qcomm"):
        parse_compression_cfg({"name": "q", "kind": "qcomm", "input": "ids"})
    with pytest.raises(ValueError, match=r"compression.input must be one of none, ids"):
        parse_compression_cfg(
            {"name": "x", "input": "zstd", "forward": {"codec": "none"}, "backward": {"codec": "none"}}
        )
