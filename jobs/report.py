"""Report: plots and a Markdown summary of a run's steps up to one, and of the evaluations of their checkpoints
-> report/step=NNNN/ (`python -m retool report runs/NAME` draws one of every step by hand)."""

from __future__ import annotations

from pathlib import Path

from retool.config.settings import RunSettings
from retool.evaluation.report import make_report


def report(out: Path, run: RunSettings, step: int) -> str:
    """`out`: the report's folder. It reads every step's metrics up to `step` and every evaluation found."""
    make_report(run.run_dir, out, step)
    return f"plots and summary of {step + 1} steps"
