"""The training loop: pipelined (TrainPipelineSparseDist) or plain steps, evaluation passes.

Training runs in segments that end where something must see a drained pipeline (evaluation, a
checkpoint, the iteration limit, the end of an epoch). Within a segment TorchRec's pipeline
overlaps the input all-to-all of batch i+1 with the forward/backward of batch i.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator

import torch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from dlrm.metrics import Evaluator


class Stepper:
    """Runs training steps over an iterator of batches, with or without TorchRec's pipeline."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 pipelined: bool) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.pipeline = TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True) if pipelined else None

    def run(self, batches: Iterator[Any], on_step: Callable[[torch.Tensor], None]) -> None:
        """Train on every batch of ``batches``; call ``on_step(loss)`` after each optimizer step."""
        self.model.train()
        if self.pipeline is not None:
            while True:
                try:
                    loss, _, _ = self.pipeline.progress(batches)
                except StopIteration:
                    return
                on_step(loss)
        for batch in batches:
            batch = batch.to(self.device)
            self.optimizer.zero_grad()
            loss, _ = self.model(batch)
            loss.backward()
            self.optimizer.step()
            on_step(loss.detach())

    def release(self) -> None:
        """Give the model its own forwards back (after a drained segment) for plain evaluation."""
        if self.pipeline is not None:
            self.pipeline.detach()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Any], device: torch.device) -> dict[str, float]:
    """One pass over ``batches`` in eval mode; metrics are synchronized across ranks."""
    model.eval()
    evaluator = Evaluator(device)
    for batch in batches:
        batch = batch.to(device)
        _, (_, logits, labels) = model(batch)
        evaluator.update(logits, labels)
    model.train()
    return evaluator.compute()


def take(iterator: Iterator[Any], n: int | None) -> Iterator[Any]:
    return iterator if n is None else itertools.islice(iterator, n)
