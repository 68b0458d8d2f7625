"""ExecuteRound: one round's tool calls run in the sandbox, and the state of every trajectory that was live at
the round's start -> observations.parquet."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from retool.config.settings import StageSettings
from retool.files.layout import RoundPaths
from retool.files.tables import SAMPLES, read_table, write_table_atomically
from retool.rollout.stage_tables import describe_observations, observations_table
from retool.run.shared import replayed_shard, sandbox_for


def execute_round(
    prompts: Path,
    rounds: Sequence[RoundPaths],
    samples: Path,
    out: Path,
    stage: StageSettings,
    step: int,
    shard: int,
    round_index: int,
    status: Callable[[str], None] = lambda message: None,  # the task's status line in the scheduler
) -> str:
    """`rounds`: the shard's rounds before this one; `samples`: this round's."""
    settings = stage.settings
    protocol, trajectories = replayed_shard(prompts, rounds, settings, shard)
    sampled = read_table(samples, SAMPLES)
    status(f"running the tool calls of {sampled.num_rows} turns")
    sandbox = sandbox_for(settings.sandbox)
    table = observations_table(trajectories, sampled, sandbox, protocol, settings.rollout, step, round_index)
    write_table_atomically(table, out)
    return describe_observations(table)
