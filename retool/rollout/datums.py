"""From a trajectory's turns to one token sequence with per-token training fields."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy
import pyarrow as pa

from retool.files.tables import DATUMS, list_column, row_views, write_tables_atomically

if TYPE_CHECKING:  # the trainer reads datums without the rollout's dependencies
    from retool.rollout.state import Trajectory


class PrefixError(ValueError):
    """A turn's prompt does not extend the tokens of the trajectory so far."""


@dataclass(frozen=True)
class TokenSequence:
    tokens: numpy.ndarray  # P(1) + C(1) + D(1) + C(2) + ...
    old_logprobs: numpy.ndarray  # sampler logprob on completion tokens, 0 elsewhere
    is_action: numpy.ndarray  # True exactly on tokens the model sampled
    turn_of: numpy.ndarray  # the turn that sampled each token, from 0; -1 on context


def trajectory_sequence(trajectory: Trajectory) -> TokenSequence:
    """Joins the turns, checking that every prompt extends everything before it (P(i+1) starts with P(i) + C(i));
    the tokens each prompt adds (first prompt, closing, observation, next-turn prefix) are context, not actions.
    So the whole sequence is the last prompt and its completion. In numpy: a turn's tokens may be views of its
    file's columns, and a step has tens of millions of them."""
    if not trajectory.turns:
        return TokenSequence(*(numpy.zeros(0, dtype) for dtype in (numpy.int64, numpy.float64, bool, numpy.int64)))
    last = trajectory.turns[-1]
    tokens = numpy.concatenate([numpy.asarray(last.prompt_tokens, numpy.int64), last.completion_tokens])
    logprobs, is_action = numpy.zeros(len(tokens)), numpy.zeros(len(tokens), bool)
    turn_of = numpy.full(len(tokens), -1)
    previous_prompt = previous_completion = numpy.zeros(0, numpy.int64)  # P(i-1) and C(i-1)
    for number, turn in enumerate(trajectory.turns, start=1):
        prompt, completion = numpy.asarray(turn.prompt_tokens), numpy.asarray(turn.completion_tokens)
        start = len(previous_prompt)
        end = start + len(previous_completion)
        if not (
            len(prompt) >= end
            and numpy.array_equal(prompt[:start], previous_prompt)
            and numpy.array_equal(prompt[start:end], previous_completion)
        ):
            raise PrefixError(
                f"trajectory (question {trajectory.question_index}, branch {trajectory.group_index}): the prompt of "
                f"turn {number} does not extend the {end} tokens of the turns before it"
            )
        sampled = slice(len(prompt), len(prompt) + len(completion))
        logprobs[sampled], is_action[sampled], turn_of[sampled] = turn.logprobs, True, number - 1
        previous_prompt, previous_completion = prompt, completion
    return TokenSequence(tokens, logprobs, is_action, turn_of)


@dataclass(frozen=True)
class Datum:
    question_index: int
    group_index: int
    # Sequences of equal length (numpy arrays as built and as read from datums.parquet; lists where tests write them)
    input_tokens: Sequence[int]  # tokens[:-1]: what the model reads
    target_tokens: Sequence[int]  # tokens[1:]: what it predicts at each position
    old_logprobs: Sequence[float]  # sampler logprob of each target on sampled tokens, 0 elsewhere
    advantages: Sequence[float]  # the trajectory's advantage on sampled targets, 0 elsewhere
    loss_mask: Sequence[bool]  # True on targets the model sampled: the only tokens the loss sees
    # The RL base policy's logprob of each target on loss tokens, 0 elsewhere: the trainer's own pass with [trainer]
    # kl_coef > 0 (never in datums.parquet); None without
    reference_logprobs: Sequence[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_tokens)

    @property
    def loss_tokens(self) -> int:
        return int(numpy.count_nonzero(self.loss_mask))


def build_datum(trajectory: Trajectory, trainer_max_tokens: int) -> Datum:
    """One PPO datum, shifted right: position t reads tokens[t] and is trained to predict
    tokens[t + 1]; only targets the model sampled carry a logprob and the advantage."""
    sequence = trajectory_sequence(trajectory)
    if len(sequence.tokens) > trainer_max_tokens:
        raise ValueError(
            f"trajectory (question {trajectory.question_index}, branch {trajectory.group_index}) has "
            f"{len(sequence.tokens)} tokens, "
            f"over the trainer's context of {trainer_max_tokens}"
        )
    advantage = float(trajectory.advantage)
    actions = sequence.is_action[1:]
    return Datum(
        trajectory.question_index,
        trajectory.group_index,
        sequence.tokens[:-1],
        sequence.tokens[1:],
        sequence.old_logprobs[1:],
        numpy.where(actions, advantage, 0.0),
        actions,
    )


def datums_of(trajectories: list[Trajectory], trainer_max_tokens: int) -> list[Datum]:
    """A datum for every trajectory whose advantage is not zero (the others carry no signal)."""
    return [build_datum(t, trainer_max_tokens) for t in trajectories if t.advantage and t.turns]


# Datums as datums.parquet's columns (files/tables.py DATUMS), and back.

LIST_COLUMNS = ("input_tokens", "target_tokens", "old_logprobs", "advantages", "loss_mask")  # in Datum's order
PART_TOKENS = 1 << 19  # tokens a part of a step's datums holds at most (one datum over it is a part alone)


def datums_to_table(datums: Sequence[Datum], step: int, policy_step: int) -> pa.Table:
    """Each list column built from all datums' arrays at once (no Python value per token)."""
    count = len(datums)
    columns = {
        "step": pa.array([step] * count, pa.int32()),
        "question_index": pa.array([d.question_index for d in datums], pa.int32()),
        "group_index": pa.array([d.group_index for d in datums], pa.int32()),
        **{name: list_column([getattr(d, name) for d in datums], DATUMS.field(name).type) for name in LIST_COLUMNS},
        "num_tokens": pa.array([d.num_tokens for d in datums], pa.int32()),
        "policy_step": pa.array([policy_step] * count, pa.int32()),
    }
    return pa.Table.from_arrays([columns[name] for name in DATUMS.names], schema=DATUMS)


def datums_to_tables(datums: Sequence[Datum], step: int, policy_step: int) -> Iterator[pa.Table]:
    """`datums_to_table` a part of about PART_TOKENS tokens at a time: a part's five columns (10 MB) stay in the
    CPU's caches while they are built and compressed (a 14 M-token step's, built whole, took 1.35 times as long)."""
    start, tokens = 0, 0
    for end, datum in enumerate(datums):
        if tokens and tokens + datum.num_tokens > PART_TOKENS:
            yield datums_to_table(datums[start:end], step, policy_step)
            start, tokens = end, 0
        tokens += datum.num_tokens
    if start < len(datums) or not datums:
        yield datums_to_table(datums[start:], step, policy_step)


def write_datums(datums: Sequence[Datum], step: int, policy_step: int, path: str | Path) -> pa.Table:
    """Writes datums.parquet a part at a time (`datums_to_tables`, a row group each); returns its table."""
    return write_tables_atomically(datums_to_tables(datums, step, policy_step), DATUMS, path)


def datums_from_table(table: pa.Table) -> list[Datum]:
    """The datums of a datums.parquet table, their token columns as numpy views of the table's (no Python value
    per token: a step's datums hold tens of millions)."""
    columns = {name: row_views(table.column(name)) for name in LIST_COLUMNS}
    return [
        Datum(q, g, *(columns[name][row] for name in LIST_COLUMNS))
        for row, (q, g) in enumerate(
            zip(table.column("question_index").to_pylist(), table.column("group_index").to_pylist(), strict=True)
        )
    ]


def step_datums(shards: Sequence[pa.Table]) -> list[Datum]:
    """A step's datums from its shards' tables, in (question, branch) order: each shard's rows are in that order, and
    merging their rows' numpy views copies no token."""
    parts = [datums_from_table(table) for table in shards]
    return list(heapq.merge(*parts, key=lambda datum: (datum.question_index, datum.group_index)))
