"""Two real gloo ranks shard a small EmbeddingBagCollection with DistributedModelParallel, with
stock TorchRec's sharder and with ours (``compression=none``, as the trainer builds it): both
look up exactly the rows of the gathered tables."""

from pathlib import Path

import pytest
import torch
from multiprocess import run_ranks
from omegaconf import OmegaConf
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dlrm.embedding_comm import make_sharders
from dlrm.embedding_comm.embeddingbag import CompressedEmbeddingBagCollectionSharder

NONE = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs" / "compression" / "none.yaml")

TABLES = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50 + 10 * i, feature_names=[f"f{i}"])
    for i in range(4)
]


def _batch(seed: int, batch: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, t.num_embeddings, (batch,), generator=g) for t in TABLES]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[t.feature_names[0] for t in TABLES],
        values=torch.cat(ids),
        lengths=torch.ones(batch * len(TABLES), dtype=torch.int32),
    )


def _shard_and_lookup(rank: int, world_size: int, ours: bool) -> dict:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    sharder = make_sharders(NONE)[0] if ours else EmbeddingBagCollectionSharder()
    assert isinstance(sharder, CompressedEmbeddingBagCollectionSharder) == ours
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in TABLES},
    )
    plan = planner.collective_plan(ebc, [sharder], torch.distributed.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    # Gather the full tables so each rank can check its own lookups against plain indexing.
    full = {}
    for key, value in model.state_dict().items():
        out = torch.zeros(value.size()) if rank == 0 else None
        value.gather(0, out)
        full[key] = out
    kjt = _batch(seed=rank, batch=6)
    pooled = {k: v.detach() for k, v in model(kjt).wait().to_dict().items()}
    owners = {t: ps.ranks for t, ps in plan.plan[""].items()}
    return {"pooled": pooled, "kjt": kjt.to_dict(), "full": full if rank == 0 else None, "owners": owners}


@pytest.mark.parametrize("ours", [False, True], ids=["stock", "ours"])
def test_two_ranks_shard_tables_and_lookups_match_the_gathered_tables(ours):
    results = run_ranks(_shard_and_lookup, 2, ours)
    owners = results[0]["owners"]
    assert sorted({r for ranks in owners.values() for r in ranks}) == [0, 1]  # both ranks own tables
    full = results[0]["full"]
    for res in results:
        for t in TABLES:
            feature = t.feature_names[0]
            weight = next(v for k, v in full.items() if k.endswith(f"{t.name}.weight"))
            ids = res["kjt"][feature].values()
            torch.testing.assert_close(res["pooled"][feature], weight[ids], rtol=0, atol=0)
