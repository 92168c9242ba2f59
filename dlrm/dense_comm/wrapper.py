"""TorchRec's data-parallel wrapper seam of ``DistributedModelParallel``, with our hook registered
on the DDP module it builds: the training loop does not change."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.types import ShardingEnv

from dlrm.dense_comm.hook import DenseComm


class CompressedDataParallelWrapper(DefaultDataParallelWrapper):
    """TorchRec's default DDP wrapping of the dense part, with our hook registered on it."""

    def __init__(self, dense: DenseComm) -> None:
        super().__init__(bucket_cap_mb=dense.spec.bucket_cap_mb)
        self.dense = dense

    def _ddp_wrap(self, dmp: Any, env: ShardingEnv, device: torch.device, ddp_ignore_param_names: set[str]) -> None:
        super()._ddp_wrap(dmp, env, device, ddp_ignore_param_names)
        ddp = dmp._dmp_wrapped_module
        if isinstance(ddp, DistributedDataParallel):
            assert env.process_group is not None
            self.dense.install(ddp, env.process_group)


def dense_comm_of(model: torch.nn.Module) -> DenseComm | None:
    """The :class:`DenseComm` a DMP model was wrapped with (TorchRec keeps the wrapper it used)."""
    wrapper = getattr(model, "_data_parallel_wrapper", None)
    return wrapper.dense if isinstance(wrapper, CompressedDataParallelWrapper) else None
