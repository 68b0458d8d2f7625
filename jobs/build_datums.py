"""BuildDatums: the trajectories of the groups that train, as the trainer's token rows -> datums.parquet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import RunSettings
from retool.files.layout import RoundPaths
from retool.files.tables import TRAJECTORIES, read_table, write_table_atomically
from retool.rollout.replay import replay_shards
from retool.rollout.stage_tables import datums_table, describe_datums
from retool.run.shared import policy_step, protocol_for


def build_datums(
    prompts: Path, shards: Sequence[Sequence[RoundPaths]], trajectories: Path, out: Path, run: RunSettings, step: int
) -> str:
    """`shards`: every round of every shard; `trajectories`: the step's scores, advantages and kept groups."""
    replayed = replay_shards(prompts, shards, protocol_for(run.model), run.rollout)
    scored = read_table(trajectories, TRAJECTORIES)
    table = datums_table(replayed, scored, step, policy_step(run, step), run.rollout.trainer_max_tokens)
    write_table_atomically(table, out)
    return describe_datums(table)
