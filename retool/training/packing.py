"""Micro-batches for the trainer: first-fit-decreasing packing, and per-token loss weights that
make accumulated micro-batch gradients equal the gradient of the step's global mean loss."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retool.config.trainer import LOSS_AGGREGATIONS


@dataclass(frozen=True)
class MicroBatch:
    indices: tuple[int, ...]  # datum positions in this micro-batch
    width: int  # longest datum: every row is padded to it

    @property
    def padded_tokens(self) -> int:
        return self.width * len(self.indices)


def rows_by_datum(batches: Sequence[MicroBatch], padded: Sequence, lengths: Sequence[int]) -> dict:
    """Each datum's row of a pass's padded per-token values (one tensor per micro-batch), cut to its length."""
    return {i: row[: lengths[i]] for batch, rows in zip(batches, padded) for i, row in zip(batch.indices, rows)}


def pack_micro_batches(lengths: Sequence[int], max_items: int, max_padded_tokens: int) -> list[MicroBatch]:
    """First-fit decreasing: longest first, each into the first batch where it still fits both
    bounds (rows padded to the batch's longest). A datum longer than the token bound gets its own.
    Longest first, a batch's width is its first datum's, so whether it takes one more no longer depends on
    which: a batch that refuses one is full for good, and the first that fits is always the newest (linear time)."""
    if max_items <= 0 or max_padded_tokens <= 0:
        raise ValueError(
            f"micro-batch bounds must be positive, got max_items={max_items}, max_padded_tokens={max_padded_tokens}"
        )
    bins: list[list[int]] = []
    widths: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if bins and len(bins[-1]) < max_items and widths[-1] * (len(bins[-1]) + 1) <= max_padded_tokens:
            bins[-1].append(index)
        else:
            bins.append([index])
            widths.append(lengths[index])
    return [MicroBatch(tuple(members), width) for members, width in zip(bins, widths)]


def loss_token_weights(loss_token_counts: Sequence[int], aggregation: str, num_samples: int) -> list[float]:
    """The weight of each loss token of each datum, so that the sum of weight x token loss over all
    micro-batches is the step's loss:
      sample_mean  mean over samples of each sample's mean token loss (the reference's choice);
      token_mean   mean over every loss token of the step.
    `num_samples` is the denominator of sample_mean: all trajectories of the step, or only those with
    a learning signal when zero-variance groups are filtered."""
    if aggregation == "sample_mean":
        return [1.0 / (num_samples * count) if count else 0.0 for count in loss_token_counts]
    if aggregation == "token_mean":
        total = sum(loss_token_counts)
        return [1.0 / total if total else 0.0 for _ in loss_token_counts]
    raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")
