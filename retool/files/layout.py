"""The layout of a run folder: where a rollout's files live, which questions it asks and which policy
it samples, for a training step or an evaluation of a checkpoint (its own namespace, never mixed
with training files)."""

from __future__ import annotations

from pathlib import Path

from retool.config.settings import RunSettings
from retool.evaluation.spec import EvalSpec
from retool.weights.models import resolve_model


def step_folder(settings: RunSettings, step: int, evaluation: EvalSpec | None = None) -> Path:
    if evaluation is None:
        return settings.run_dir / f"step={step:04d}"
    name = ("sft" if evaluation.sft else "base") if step < 0 else f"{step:04d}"
    return settings.run_dir / "eval" / evaluation.name / f"step={name}"


def round_dir(step_folder: Path, shard: int, round_index: int) -> Path:
    return step_folder / f"shard={shard:02d}" / f"round={round_index:02d}"


def checkpoint_dir(settings: RunSettings, step: int) -> Path:
    return step_folder(settings, step) / "checkpoint"


def sft_folder(settings: RunSettings) -> Path:
    return settings.run_dir / "sft"


def sft_checkpoint(settings: RunSettings) -> Path:
    return sft_folder(settings) / "checkpoint"


def policy_checkpoint(settings: RunSettings, step: int, evaluation: EvalSpec | None) -> Path | None:
    """Training step s samples from checkpoint s-1, step 0 from the cold-start checkpoint (if the run
    has one) or the base model; an evaluation of step s from checkpoint s, of step -1 from the base
    model or (sft) the cold-start checkpoint."""
    source = step if evaluation is not None else step - 1
    if source >= 0:
        return checkpoint_dir(settings, source)
    wants_sft = evaluation.sft if evaluation is not None else bool(settings.cold_start.data)
    return sft_checkpoint(settings) if wants_sft else None


def rl_base_model(settings: RunSettings) -> Path:
    """The weights RL starts from, which LoRA adapters of its checkpoints apply to: the cold-start
    checkpoint's full weights, or the model setting."""
    return sft_checkpoint(settings) / "model" if settings.cold_start.data else resolve_model(settings.model.name)
