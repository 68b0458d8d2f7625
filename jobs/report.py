"""Report: plots and a Markdown summary of a run's steps up to one, and of the evaluations of their checkpoints
-> report/step=NNNN/ (`python -m retool report runs/NAME` draws one of every step by hand)."""

from __future__ import annotations

from pathlib import Path

from retool.config.settings import RunSettings
from retool.evaluation.report import report_with_page
from retool.evaluation.viewer import PageFiles
from retool.files.layout import VIEW
from retool.run.shared import token_decoder


def report(out: Path, settings: RunSettings, step: int, page: PageFiles) -> str:
    """`out`: the report's folder. It reads every step's metrics up to `step` and every evaluation found, and
    holds the page of step `step`'s trajectories (drawn from `page`), which it links."""
    report_with_page(out, settings, step, page, token_decoder(settings.model))
    return f"plots and summary of {step + 1} steps, and step {step}'s trajectories ({VIEW})"
