"""Every config parser checks its integer and true/false keys with the one helper: true/false is
not a count, a count is not true/false, and the error names the key."""

from __future__ import annotations

import pytest

from dlrm.dense_comm.config import parse_dense_comm_cfg
from dlrm.embedding_comm import build_sharders
from dlrm.embedding_comm.config import parse_compression_cfg
from dlrm.embedding_comm.policy import build_policy
from dlrm.placement.config import parse_placement_cfg
from dlrm.strategy.config import parse_strategy_cfg

LOSSY = {"name": "lossy", "forward": {"codec": "lossy"}, "backward": {"codec": "lossy"}}
DCT_MP = {"name": "dct_mp", "forward": {"codec": "threshold", "dedup": False}, "backward": {"codec": "none"}}
SCHEDULED = LOOSE = {"kind": "iteration_wise", "eb": 0.01}


def _dct_mp(params: dict) -> dict:
    return {**DCT_MP, "forward": {**DCT_MP["forward"], "params": {"keep": 0.1, **params}}}


@pytest.mark.parametrize(
    "parse, key",
    [
        (lambda v: parse_compression_cfg({**LOSSY, "stats": {"sample_every": v}}), "compression.stats.sample_every"),
        (lambda v: parse_compression_cfg({**LOSSY, "forward": {"codec": "lossy", "dedup": v}}), "forward.dedup"),
        (
            lambda v: parse_compression_cfg({**LOSSY, "stats": {"cache_probe": {"capacity_rows": v}}}),
            "compression.stats.cache_probe.capacity_rows",
        ),
        (lambda v: parse_dense_comm_cfg({"name": "powersgd", "rank": v}), "dense_comm.rank"),
        (lambda v: build_sharders(parse_compression_cfg(_dct_mp({"refresh_every": v}))), "params.refresh_every"),
        (lambda v: build_sharders(parse_compression_cfg(_dct_mp({"refresh_warmup": v}))), "params.refresh_warmup"),
        (lambda v: parse_dense_comm_cfg({"name": "dct", "refresh_warmup": v}), "dense_comm.refresh_warmup"),
        (lambda v: parse_placement_cfg({"estimate_batches": v}, "table_wise", 2), "placement.estimate_batches"),
        (lambda v: parse_strategy_cfg({"replan_every": v}, None), "compression.strategy.replan_every"),
        (
            lambda v: build_policy({"forward": {**SCHEDULED, "schedule": {"early_stage": v}}, "backward": LOOSE}, []),
            "schedule.early_stage",
        ),
    ],
)
def test_a_bool_for_a_count_or_a_count_for_a_bool_is_refused_naming_the_key(parse, key):
    for wrong in (True, 2.5, "3"):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            parse(wrong if not key.endswith(("dedup", "warmup")) else 1)
