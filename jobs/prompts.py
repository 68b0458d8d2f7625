"""Prompts: the step's questions (or an evaluation's) and each one's first model input -> prompts.parquet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import RunSettings
from retool.data.examples import MathExample
from retool.files.tables import TRAJECTORIES, read_table, write_table_atomically
from retool.rollout.stage_tables import describe_prompts, prompts_table
from retool.run.shared import protocol_for, step_draws


def prompts(
    out: Path,
    settings: RunSettings,
    step: int,
    questions: Sequence[MathExample] | None = None,
    history: Sequence[Path] = (),
) -> str:
    """The questions come from the run's training data (step `step`'s batch, or with [data] draw = frontier a draw
    by the outcomes in `history`: earlier steps' trajectories.parquet) or are an evaluation's (`questions`)."""
    protocol = protocol_for(settings.model)
    outcomes = [row for path in history for row in outcomes_of(path)]
    table = prompts_table(step_draws(settings, step, questions, outcomes), protocol, step)
    write_table_atomically(table, out)
    return describe_prompts(table)


def outcomes_of(trajectories: Path) -> list[dict]:
    """What the frontier draw reads of a step's trajectories: each one's question, family and correctness."""
    return read_table(trajectories, TRAJECTORIES).select(["example_id", "data_source", "correct"]).to_pylist()
