"""Memory the trainer gives back (release_memory), and a step's micro-batches re-planned when a pass runs out of it
(MicroBatchPlan: once a step, from the same state; CUDA raises the same torch.OutOfMemoryError as this hook-driven
CPU test of it)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging

import torch

from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.training import parallel
from retool.training.memory_plan import (
    TrainerOutOfMemoryError,
    datum_count,
    micro_batch_bounds,
    out_of_memory_advice,
    plan_step,
    shape_of,
    smaller_micro_batches,
)
from retool.training.packing import MicroBatch, rows_by_datum

log = logging.getLogger(__name__)


@contextlib.contextmanager
def out_of_memory_in(batch: MicroBatch):
    """Marks an out-of-memory error with the micro-batch it came from, which the re-plan halves and names."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        error.micro_batch = batch
        raise


def describe_micro_batch(batch: MicroBatch | None) -> str:
    if batch is None:
        return "a micro-batch"
    return f"a micro-batch of {datum_count(len(batch.indices))} x {batch.width} tokens ({batch.padded_tokens} padded)"


class MicroBatchPlan:
    """The step's micro-batch bounds. A pass that runs out of memory (torch.OutOfMemoryError, CUDA's too) is retried
    once from the same state, the rest of the step in micro-batches half the size of the one that failed; a second
    time fails the step, naming the micro-batch and the memory plan. First-fit decreasing keeps the datums in one
    order whatever the bounds, so passes before and after a re-plan line up token by token."""

    def __init__(self, model, optimizer, config: TrainerConfig, device: str) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.started = self.config = config
        self.retries = 0

    def run(self, attempt):
        """attempt(config) under the current bounds; once more under smaller ones if it runs out of memory. An
        attempt must change nothing before its last micro-batch (a gradient pass: no optimizer step)."""
        while True:
            try:
                return attempt(self.config)
            except torch.OutOfMemoryError as error:
                failed = getattr(error, "micro_batch", None)
                if self.retries or parallel.rank_and_world()[1] > 1:  # a process of several cannot retry alone
                    raise TrainerOutOfMemoryError(self._failure(failed)) from error
            # Freed outside the except clause: its traceback holds the failed pass's tensors (torch's FAQ).
            self.optimizer.zero_grad(set_to_none=True)
            release_memory(self.device)  # CUDA's cached blocks too
            size = (len(failed.indices), failed.padded_tokens) if failed else (10**9, 10**9)
            smaller = smaller_micro_batches(self.config, *size)
            log.warning(
                f"out of memory in {describe_micro_batch(failed)}: micro-batches re-planned from at most "
                f"{micro_batch_bounds(self.config)} to {micro_batch_bounds(smaller)}, retrying once from the same state"
            )
            self.config, self.retries = smaller, self.retries + 1

    def _failure(self, failed: MicroBatch | None) -> str:
        processes = parallel.rank_and_world()[1]
        if self.retries:
            what = (
                f"out of memory again in {describe_micro_batch(failed)} after the step's micro-batches were "
                f"re-planned from at most {micro_batch_bounds(self.started)} to {micro_batch_bounds(self.config)}"
            )
        else:
            what = (
                f"out of memory in {describe_micro_batch(failed)} (at most {micro_batch_bounds(self.config)}) in one "
                f"of {processes} training processes, which cannot retry it alone"
            )
        inner = getattr(self.model, "module", self.model)  # DDP's wrapper, then parallel.TokenLogprobs
        plan = plan_step(shape_of(getattr(inner, "policy", inner).config), self.config, processes)
        return f"{what}; {out_of_memory_advice(plan, self.config)}"


def repacked(proximal, batches: list[MicroBatch], datums: list[Datum]) -> list[torch.Tensor] | None:
    """The proximal logprobs, (micro-batches, their padded rows) as a pass took them, as the rows of `batches`
    (other micro-batches after an out-of-memory re-plan; one process: its share is every micro-batch)."""
    if proximal is None or proximal[0] == batches:
        return None if proximal is None else proximal[1]
    taken, padded = proximal
    rows = rows_by_datum(taken, padded, [d.num_tokens for d in datums])
    repacked = []
    for batch in batches:
        tensor = padded[0].new_zeros(len(batch.indices), batch.width)  # padding: 0, as a pass leaves it
        for r, i in enumerate(batch.indices):
            tensor[r, : datums[i].num_tokens] = rows[i]
        repacked.append(tensor)
    return repacked


def release_memory(device: str, collect: bool = True) -> None:
    """After training, the sampler in this process gets the memory back: CUDA's cached blocks, or on a CPU
    the heap that glibc keeps for reuse once tensors are freed (gigabytes after a training step). `collect`: the
    model was let go, so the garbage collector frees what its reference cycles hold (a quarter second)."""
    if collect:
        gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass
