"""Evaluate: Average@N and Pass@N of one checkpoint's trajectories on an evaluation set -> summary.parquet (and
the scores to the run's tracker, under eval/<evaluation>/<base|sft|rl>/ at the checkpoint's step)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from retool.config.settings import RunSettings
from retool.evaluation.scores import describe_eval, summarize_eval
from retool.evaluation.spec import EvalSpec, content_hash
from retool.evaluation.tracking import Tracker, scalars
from retool.files.tables import TRAJECTORIES, read_table, write_table_atomically


def evaluate(trajectories: Path, out: Path, settings: RunSettings, evaluation: EvalSpec, step: int) -> str:
    """`step`: the checkpoint evaluated (-1: the base model, or with `evaluation.sft` the cold start's)."""
    stage = ("sft" if evaluation.sft else "base") if step < 0 else "rl"
    summary = {
        "dataset": evaluation.dataset,
        "dataset_sha256": content_hash(evaluation.dataset),  # the leading digits, as in the folder's name
        "questions_limit": evaluation.limit,
        "temperature": evaluation.temperature,
        "top_p": evaluation.top_p,
        "mode": evaluation.mode,
        "step": step,
        "policy": stage if step < 0 else f"step {step}",
        **summarize_eval(read_table(trajectories, TRAJECTORIES), evaluation.n),
    }
    write_table_atomically(pa.Table.from_pylist([summary]), out)
    scores = scalars({name: value for name, value in summary.items() if name not in ("temperature", "top_p")})
    Tracker.of(settings).log(step, scores, prefix=f"eval/{evaluation.name}/{stage}/")
    return f"{evaluation.mode} on {evaluation.dataset}: {describe_eval(summary)}"
