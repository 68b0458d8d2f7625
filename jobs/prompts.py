"""Prompts: the step's questions (or an evaluation's) and each one's first model input -> prompts.parquet."""

from __future__ import annotations

from pathlib import Path

from retool.config.settings import RunSettings
from retool.evaluation.spec import EvalSpec, evaluation_settings
from retool.files.tables import write_table_atomically
from retool.rollout.stage_tables import describe_prompts, prompts_table
from retool.run.shared import protocol_for, step_examples


def prompts(out: Path, run: RunSettings, step: int, evaluation: EvalSpec | None = None) -> str:
    """The questions come from the run's training data (step `step`'s batch) or the evaluation's data file."""
    protocol = protocol_for(evaluation_settings(run, evaluation).model)
    table = prompts_table(step_examples(run, step, evaluation), protocol, step)
    write_table_atomically(table, out)
    return describe_prompts(table)
