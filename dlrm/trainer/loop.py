"""The training loop: pipelined (TrainPipelineSparseDist) or plain steps, evaluation passes.

Training runs in segments that end where something must see a drained pipeline (evaluation, a
checkpoint, the iteration limit, the end of an epoch). Within a segment TorchRec's pipeline
overlaps the input all-to-all of batch i+1 with the forward/backward of batch i.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from dlrm.process.timeout import named_collective
from dlrm.trainer.evaluation import Evaluator


@dataclass
class TrainState:
    """Where training is: what a checkpoint restores, and the clocks of this process."""

    iteration: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    train_seconds: float = 0.0  # wall time inside training segments (not evaluation or saving)
    samples_seen: int = 0  # global samples trained in this process (not before a resume)
    rank_samples: int = 0  # this rank's samples trained in this process (a short last batch counted as it is)

    def position(self) -> dict[str, int]:
        """The part a checkpoint keeps (the clocks restart with the process)."""
        return {"iteration": self.iteration, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    @property
    def samples_per_s(self) -> float | None:
        return self.samples_seen / self.train_seconds if self.train_seconds else None


class StepObserver(Protocol):
    """Something that watches training segments from outside the trainer (e.g. a benchmark probe)."""

    def segment_start(self, model: torch.nn.Module) -> None: ...

    def step_end(self, model: torch.nn.Module) -> None: ...

    def segment_end(self, model: torch.nn.Module) -> None: ...


@dataclass(frozen=True)
class LoopPlan:
    """When training stops, and where it must drain the pipeline."""

    total: int  # iterations to reach
    steps_per_epoch: int
    eval_every: int | None  # None: evaluate at the end of each epoch
    checkpoint_every: int  # 0: only at the end

    def next_stop(self, state: TrainState) -> int:
        """The next iteration after the current one at which the pipeline must be drained."""
        i = state.iteration
        stops = [self.total, (state.epoch + 1) * self.steps_per_epoch]
        for every in (self.eval_every, self.checkpoint_every):
            if every:
                stops.append((i // every + 1) * every)
        return min(s for s in stops if s > i)

    def eval_due(self, state: TrainState) -> bool:
        if self.eval_every:
            return state.iteration % self.eval_every == 0
        return state.batch_in_epoch >= self.steps_per_epoch

    def checkpoint_due(self, state: TrainState) -> bool:
        """A periodic save (the final one is the caller's)."""
        return (
            bool(self.checkpoint_every)
            and state.iteration % self.checkpoint_every == 0
            and state.iteration < self.total
        )


class Stepper:
    """Runs training steps over an iterator of batches, with or without TorchRec's pipeline."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, pipelined: bool
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.pipeline = (
            TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True) if pipelined else None
        )

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


def train(
    state: TrainState,
    plan: LoopPlan,
    stepper: Stepper,
    batches: Callable[[int, int], Iterable[Any]],
    global_batch: int,
    lr_schedule: Any,
    on_step: Callable[[TrainState, torch.Tensor], None],
    on_drained: Callable[[TrainState], None],
    observers: Sequence[StepObserver] = (),
    should_stop: Callable[[], bool] = lambda: False,
) -> None:
    """Train from ``state`` to ``plan.total`` iterations, segment by segment, or until ``should_stop()``
    (asked before each segment: early stopping).

    ``batches(epoch, start)`` gives an epoch's batches from batch ``start``; ``on_step(state, loss)``
    runs after every optimizer step (``state`` already counts it), then ``lr_schedule.step()``;
    ``on_drained(state)`` after every segment, with the pipeline drained (evaluation and
    checkpoints happen there).
    """
    model = stepper.model

    def step(loss: torch.Tensor) -> None:
        state.iteration += 1
        state.batch_in_epoch += 1
        on_step(state, loss)
        lr_schedule.step()
        for o in observers:
            o.step_end(model)

    def unnamed() -> str:  # a timed-out collective of a step that our own code did not name
        return (
            f"a collective of training iteration {state.iteration + 1} issued by TorchRec or DDP (the sparse "
            "input all-to-all or the dense gradient all-reduce)"
        )

    while state.iteration < plan.total and not should_stop():
        if state.batch_in_epoch >= plan.steps_per_epoch:
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        stop = plan.next_stop(state)
        segment = counted(take(iter(batches(state.epoch, state.batch_in_epoch)), stop - state.iteration), state)
        for o in observers:
            o.segment_start(model)
        before, t0 = state.iteration, time.perf_counter()
        try:
            with named_collective(unnamed):
                stepper.run(segment, step)
        finally:
            for o in observers:
                o.segment_end(model)
        state.train_seconds += time.perf_counter() - t0
        state.samples_seen += (state.iteration - before) * global_batch
        stepper.release()
        on_drained(state)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: Iterable[Any], device: torch.device, split: str
) -> dict[str, float | None]:
    """One pass over the ``split``'s ``batches`` in eval mode; metrics are synchronized across ranks
    (``auc`` is None where undefined: a split of one class)."""
    model.eval()
    evaluator = Evaluator(device)
    with named_collective("the sparse input all-to-all (TorchRec's) of an evaluation pass"):
        for batch in batches:
            batch = batch.to(device)
            _, (_, logits, labels) = model(batch)
            evaluator.update(logits, labels)
    model.train()
    with named_collective("the metric all-reduce of an evaluation pass"):
        return evaluator.compute(split)


def take(iterator: Iterator[Any], n: int | None) -> Iterator[Any]:
    return iterator if n is None else itertools.islice(iterator, n)


def counted(batches: Iterator[Any], state: TrainState) -> Iterator[Any]:
    """``batches``, adding each one's samples to ``state.rank_samples`` as it is taken."""
    for batch in batches:
        state.rank_samples += len(batch.labels)
        yield batch
