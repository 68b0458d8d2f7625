"""ScoreTrajectories: every trajectory of the step, scored, with its group's advantage and whether its group
trains -> trajectories.parquet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import StageSettings
from retool.files.layout import RoundPaths
from retool.files.tables import write_table_atomically
from retool.rollout.replay import replay_shards
from retool.rollout.stage_tables import describe_trajectories, scored_table
from retool.run.shared import protocol_for


def score_trajectories(
    prompts: Path,
    shards: Sequence[Sequence[RoundPaths]],
    out: Path,
    stage: StageSettings,
    step: int,
) -> str:
    """`shards`: every round of every shard."""
    settings = stage.settings
    trajectories = replay_shards(prompts, shards, protocol_for(settings.model), settings.rollout, detail="lengths")
    table = scored_table(
        trajectories, step, stage.sampled_by, settings.data.keep_limit, settings.reward,
        settings.rollout.max_trajectory_tokens,
    )  # fmt: skip
    write_table_atomically(table, out)
    return describe_trajectories(table)
