"""ScoreShard: one shard's trajectories, scored, with their groups' advantages -> shard=NN/scored.parquet;
ScoreTrajectories: the shards' together, and which groups train -> trajectories.parquet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import StageSettings
from retool.files.layout import RoundPaths
from retool.files.tables import TRAJECTORIES, read_table, write_table_atomically
from retool.rollout.replay import replay_files
from retool.rollout.stage_tables import describe_trajectories, merged_scores, scored_table
from retool.run.shared import protocol_for


def score_shard(
    prompts: Path, rounds: Sequence[RoundPaths], out: Path, stage: StageSettings, step: int, shard: int
) -> str:
    """`rounds`: every round of shard `shard`. A question's group lies in one shard: its advantages are the shard's to
    compute, and the answer checking of the step's shards runs in parallel."""
    settings = stage.settings
    trajectories = replay_files(prompts, rounds, protocol_for(settings.model), settings.rollout, shard, "lengths")
    table = scored_table(
        trajectories, step, stage.sampled_by, None, settings.reward, settings.rollout.max_trajectory_tokens
    )
    write_table_atomically(table, out)
    return describe_trajectories(table)


def score_trajectories(shards: Sequence[Path], out: Path, stage: StageSettings) -> str:
    """`shards`: every shard's scored.parquet."""
    table = merged_scores([read_table(path, TRAJECTORIES) for path in shards], stage.settings.data.keep_limit)
    write_table_atomically(table, out)
    return describe_trajectories(table)
