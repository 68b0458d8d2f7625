"""Where a rollout's files live, which questions it asks and which policy it samples: a training
step, or an evaluation of a checkpoint (its own namespace, never mixed with training files)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from jobs.data import MathExample, read_examples, shuffled, take_batch
from jobs.evaluation import EVAL_MODES
from jobs.settings import RunSettings, SettingsError


@dataclass(frozen=True)
class EvalSpec:
    dataset: str  # data file (native, AIME or DAPO layout)
    n: int  # samples per question (the group size of the eval rollout)
    mode: str  # retool (tool enabled) | text-only (no tool, one turn, the same budget)

    def __post_init__(self) -> None:
        if self.n <= 0:
            raise SettingsError(f"evaluation n must be positive, got {self.n}")
        if self.mode not in EVAL_MODES:
            raise SettingsError(f"evaluation mode must be one of {EVAL_MODES}, got {self.mode!r}")


@lru_cache(maxsize=16)
def _examples(path: str) -> tuple[MathExample, ...]:
    return tuple(read_examples(path))


def rollout_settings(settings: RunSettings, evaluation: EvalSpec | None) -> RunSettings:
    """The run's settings, or those of an evaluation rollout: every question of the data set once,
    `n` samples each; text-only mode declares no tool and allows one turn."""
    if evaluation is None:
        return settings
    questions = len(_examples(evaluation.dataset))
    text_only = evaluation.mode == "text-only"
    return replace(
        settings, seed=settings.seed ^ 0x8000,  # evaluation draws apart from training's draws
        train_data=evaluation.dataset, questions_per_step=questions, group_size=evaluation.n,
        shards=min(settings.shards, questions), use_tools=not text_only,
        max_assistant_turns=1 if text_only else settings.max_assistant_turns,
    )


def step_folder(settings: RunSettings, step: int, evaluation: EvalSpec | None = None) -> Path:
    if evaluation is None:
        return settings.run_dir / f"step={step:04d}"
    name = "base" if step < 0 else f"{step:04d}"
    return settings.run_dir / "eval" / Path(evaluation.dataset).stem / f"{evaluation.mode}-n{evaluation.n}" / f"step={name}"


def checkpoint_dir(settings: RunSettings, step: int) -> Path:
    return step_folder(settings, step) / "checkpoint"


def policy_checkpoint(settings: RunSettings, step: int, evaluation: EvalSpec | None) -> Path | None:
    """Training step s samples from checkpoint s-1; an evaluation of step s from checkpoint s;
    step 0 of training and step -1 of an evaluation from the base model."""
    source = step if evaluation is not None else step - 1
    return checkpoint_dir(settings, source) if source >= 0 else None


def step_examples(settings: RunSettings, step: int, evaluation: EvalSpec | None) -> list[MathExample]:
    if evaluation is not None:
        return list(_examples(evaluation.dataset))
    return take_batch(shuffled(_examples(settings.train_data), settings.data_seed), step, settings.questions_per_step)
