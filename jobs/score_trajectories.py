"""ScoreTrajectories: every trajectory of the step, scored, with its group's advantage and whether its group
trains -> trajectories.parquet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import RunSettings
from retool.evaluation.spec import EvalSpec, evaluation_settings
from retool.files.layout import RoundPaths
from retool.files.tables import write_table_atomically
from retool.rollout.replay import replay_shards
from retool.rollout.stage_tables import describe_trajectories, scored_table
from retool.run.shared import policy_step, protocol_for


def score_trajectories(
    prompts: Path,
    shards: Sequence[Sequence[RoundPaths]],
    out: Path,
    run: RunSettings,
    step: int,
    evaluation: EvalSpec | None = None,
) -> str:
    """`shards`: every round of every shard."""
    settings = evaluation_settings(run, evaluation)
    trajectories = replay_shards(prompts, shards, protocol_for(settings.model), settings.rollout, detail="lengths")
    table = scored_table(
        trajectories, step, policy_step(run, step, evaluation), settings.data.keep_limit, settings.reward,
        settings.rollout.max_trajectory_tokens,
    )  # fmt: skip
    write_table_atomically(table, out)
    return describe_trajectories(table)
