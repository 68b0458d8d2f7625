"""From a trajectory's turns to one token sequence with per-token training fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy
import pyarrow as pa

if TYPE_CHECKING:  # the trainer reads datums without the rollout's dependencies
    from retool.rollout.state import Trajectory


class PrefixError(ValueError):
    """A turn's prompt does not extend the tokens of the trajectory so far."""


@dataclass(frozen=True)
class TokenSequence:
    tokens: list[int]  # P(1) + C(1) + D(1) + C(2) + ...
    old_logprobs: list[float]  # sampler logprob on completion tokens, 0 elsewhere
    is_action: list[bool]  # True exactly on tokens the model sampled
    turn_of: list[int]  # the turn that sampled each token, from 0; -1 on context


def trajectory_sequence(trajectory: Trajectory) -> TokenSequence:
    """Joins the turns, checking that every prompt extends everything before it; the tokens each
    prompt adds (first prompt, closing, observation, next-turn prefix) are context, not actions."""
    tokens: list[int] = []
    logprobs: list[float] = []
    is_action: list[bool] = []
    turn_of: list[int] = []
    for number, turn in enumerate(trajectory.turns, start=1):
        if turn.prompt_tokens[: len(tokens)] != tokens:
            raise PrefixError(
                f"trajectory (question {trajectory.question_index}, branch {trajectory.group_index}): the prompt of "
                "turn "
                f"{number} does not extend the {len(tokens)} tokens of the turns before it"
            )
        context = turn.prompt_tokens[len(tokens) :]
        tokens += context + turn.completion_tokens
        logprobs += [0.0] * len(context) + turn.logprobs
        is_action += [False] * len(context) + [True] * len(turn.completion_tokens)
        turn_of += [-1] * len(context) + [number - 1] * len(turn.completion_tokens)
    return TokenSequence(tokens, logprobs, is_action, turn_of)


@dataclass(frozen=True)
class Datum:
    question_index: int
    group_index: int
    input_tokens: list[int]  # tokens[:-1]: what the model reads
    target_tokens: list[int]  # tokens[1:]: what it predicts at each position
    old_logprobs: list[float]  # sampler logprob of each target on sampled tokens, 0 elsewhere
    advantages: list[float]  # the trajectory's advantage on sampled targets, 0 elsewhere
    loss_mask: list[bool]  # True on targets the model sampled: the only tokens the loss sees

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
    return Datum(
        trajectory.question_index,
        trajectory.group_index,
        sequence.tokens[:-1],
        sequence.tokens[1:],
        sequence.old_logprobs[1:],
        [advantage if action else 0.0 for action in sequence.is_action[1:]],
        sequence.is_action[1:],
    )


def build_datums(trajectories: list[Trajectory], trainer_max_tokens: int) -> list[Datum]:
    """A datum for every trajectory whose advantage is not zero (the others carry no signal)."""
    return [build_datum(t, trainer_max_tokens) for t in trajectories if t.advantage and t.turns]


# A datum's row in datums.parquet (files/tables.py DATUMS), and back.


def datum_row(datum: Datum, step: int, policy_step: int) -> dict:
    return {
        "step": step,
        "question_index": datum.question_index,
        "group_index": datum.group_index,
        "input_tokens": datum.input_tokens,
        "target_tokens": datum.target_tokens,
        "old_logprobs": datum.old_logprobs,
        "advantages": datum.advantages,
        "loss_mask": datum.loss_mask,
        "num_tokens": datum.num_tokens,
        "policy_step": policy_step,
    }


def datums_from_table(table: pa.Table) -> list[Datum]:
    """The datums of a datums.parquet table, their token columns as numpy views of the table's (no Python value
    per token: a step's datums hold tens of millions)."""
    columns = {name: _row_views(table.column(name)) for name in LIST_COLUMNS}
    return [
        Datum(q, g, *(columns[name][row] for name in LIST_COLUMNS))
        for row, (q, g) in enumerate(
            zip(table.column("question_index").to_pylist(), table.column("group_index").to_pylist(), strict=True)
        )
    ]


LIST_COLUMNS = ("input_tokens", "target_tokens", "old_logprobs", "advantages", "loss_mask")  # in Datum's order


def _row_views(column: pa.ChunkedArray) -> list[numpy.ndarray]:
    """Each row of a list column as a numpy view of its values."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if array.null_count:
        raise ValueError(f"a datum's {column.type} column has nulls")
    values, offsets = array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy()
    return [values[start:end] for start, end in zip(offsets[:-1], offsets[1:])]
