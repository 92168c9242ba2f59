"""The ``dense_comm`` group as a component: the hook on the DDP of the MLPs, registered through
TorchRec's data-parallel wrapper at sharding time; its state is each rank's own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from dlrm.dense_comm.config import parse_dense_comm_cfg
from dlrm.dense_comm.hook import DenseComm
from dlrm.dense_comm.wrapper import CompressedDataParallelWrapper
from dlrm.trainer.component import Component, Sharding


class DenseCommunication(Component):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.dense = DenseComm(parse_dense_comm_cfg(cfg))

    def shard(self, sharding: Sharding) -> None:
        sharding.data_parallel_wrapper = CompressedDataParallelWrapper(self.dense)

    @property
    def parts(self) -> Mapping[str, Stateful]:
        return {"dense_comm": self.dense}
