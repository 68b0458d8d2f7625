"""ColdStart: supervised fine-tuning of the model setting on the SFT examples -> sft/checkpoint/ (full weights:
the policy RL starts from) and sft/losses.parquet (the loss of every step)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from retool.config.settings import RunSettings
from retool.evaluation.tracking import Tracker
from retool.files.tables import SFT_EXAMPLES, read_table, write_table_atomically
from retool.sampling.engines import reclaim_sampler_memory, release_sampler_memory
from retool.training.cold_start import describe_cold_start, losses_table, sft_datums, train_cold_start
from retool.weights.models import resolve_model


def cold_start(
    examples: Path,
    checkpoint: Path,
    losses: Path,
    progress: Path,
    settings: RunSettings,
    on_step: Callable[[dict], None] | None = None,
) -> str:
    """Resumes from the resume point `progress` where it was stopped; `on_step` gets each step's loss row."""
    release_sampler_memory(settings)  # an engine left awake (the base model's evaluation) sleeps while SFT trains
    rows = train_cold_start(
        resolve_model(settings.model.name),
        sft_datums(read_table(examples, SFT_EXAMPLES)),
        settings.sft_trainer(),
        settings.cold_start,
        checkpoint,
        progress,
        settings.run.device,
        on_step,
    )
    reclaim_sampler_memory(settings)
    write_table_atomically(losses_table(rows), losses)
    Tracker.of(settings).log_steps([(row["step"], {"loss": row["loss"]}) for row in rows], prefix="cold_start/")
    return describe_cold_start(rows)
