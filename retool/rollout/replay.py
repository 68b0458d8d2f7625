"""A shard's trajectories rebuilt from the files of its rounds: the state of a round is never stored
separately, so a re-run stage starts from exactly what its inputs say."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc

from retool.config.rollout import RolloutConfig
from retool.files.layout import RoundPaths
from retool.files.tables import OBSERVATIONS, PROMPTS, SAMPLES, read_table, row_views
from retool.protocol.chat import ChatProtocol
from retool.rollout.rows import example_of, restore_observation, turn_of
from retool.rollout.state import Trajectory, start_trajectories


class StaleInputError(ValueError):
    """A stage's input no longer matches the state it was made from (an upstream file changed)."""


@dataclass(frozen=True)
class RoundFiles:
    samples: pa.Table  # what SampleRound wrote for this round
    observations: pa.Table  # what ExecuteRound wrote for this round


TOKEN_COLUMNS = ("prompt_tokens", "completion_tokens", "logprobs")  # of samples.parquet


def sample_rows(samples: pa.Table) -> list[dict]:
    """A samples table's rows, its token columns (where read) as numpy views of the table's, not Python lists."""
    tokens = [name for name in TOKEN_COLUMNS if name in samples.column_names]
    rows = samples.drop_columns(tokens).to_pylist()
    for name in tokens:
        for row, view in zip(rows, row_views(samples.column(name)), strict=True):
            row[name] = view
    return rows


def shard_of(question_index: int, shards: int) -> int:
    return question_index % shards


def replay(
    prompts: pa.Table, rounds: Sequence[RoundFiles], protocol: ChatProtocol, config: RolloutConfig, shard: int = 0
) -> list[Trajectory]:
    """The trajectories of one shard as they stand after `rounds`, rebuilt from the files alone."""
    rows = [row for row in prompts.to_pylist() if shard_of(row["question_index"], config.shards) == shard]
    trajectories = start_trajectories(
        [example_of(row) for row in rows], protocol, config, [row["question_index"] for row in rows]
    )
    stored = {row["question_index"]: list(row["prompt_tokens"]) for row in rows}
    for trajectory in trajectories:
        if trajectory.next_prompt_tokens != stored[trajectory.question_index]:
            raise StaleInputError(
                f"prompts.parquet: question {trajectory.question_index}'s prompt is not what the protocol renders "
                "now; re-run its Prompts stage"
            )
    by_branch = {(t.question_index, t.group_index): t for t in trajectories}
    for files in rounds:
        for row in sample_rows(files.samples):
            trajectory = by_branch[(row["question_index"], row["group_index"])]
            trajectory.turns.append(turn_of(row))
            trajectory.messages.append(protocol.assistant_message(row["text"]))
        for row in files.observations.to_pylist():
            restore_observation(by_branch[(row["question_index"], row["group_index"])], row, protocol)
    return trajectories


Detail = Literal["tokens", "lengths", "state"]
"""What a replay reads of the earlier rounds' tokens: every turn's, as numpy views (ShardDatums, which needs no next
prompt: every trajectory has ended); only their counts (scoring); or none but the next prompts, from the last
round's observations (a round's stages: what they sample from and extend). A round then reads each earlier
round's small columns, and the tokens of none of them."""


def replay_files(
    prompts: Path,
    rounds: Sequence[RoundPaths],
    protocol: ChatProtocol,
    config: RolloutConfig,
    shard: int = 0,
    detail: Detail = "tokens",
) -> list[Trajectory]:
    """`replay` of the files at these paths: a shard's prompts and its first rounds, in order."""
    tables = [
        RoundFiles(
            _samples(paths.samples, detail), _observations(paths.observations, detail, last=number == len(rounds))
        )
        for number, paths in enumerate(rounds, start=1)
    ]
    return replay(read_table(prompts, PROMPTS), tables, protocol, config, shard)


def _samples(path: Path, detail: Detail) -> pa.Table:
    if detail == "tokens":
        return read_table(path, SAMPLES)
    small = [name for name in SAMPLES.names if name not in TOKEN_COLUMNS]
    if detail == "state":
        return read_table(path, SAMPLES, small)
    table = read_table(path, SAMPLES, [*small, "prompt_tokens", "completion_tokens"])
    return (
        table.select(small)
        .append_column("prompt_length", pc.list_value_length(table["prompt_tokens"]))
        .append_column("completion_length", pc.list_value_length(table["completion_tokens"]))
    )


def _observations(path: Path, detail: Detail, last: bool) -> pa.Table:
    if detail == "state" and last:  # the next prompts: what the round samples from
        return read_table(path, OBSERVATIONS)
    return read_table(path, OBSERVATIONS, [name for name in OBSERVATIONS.names if name != "next_prompt_tokens"])


def replay_shards(
    prompts: Path,
    shards: Sequence[Sequence[RoundPaths]],
    protocol: ChatProtocol,
    config: RolloutConfig,
    detail: Detail = "tokens",
) -> list[Trajectory]:
    """Every shard's trajectories after all of its rounds (`shards[s]`: shard s's rounds, in order)."""
    return [
        t for shard, rounds in enumerate(shards) for t in replay_files(prompts, rounds, protocol, config, shard, detail)
    ]
