"""The layout of a run folder: where a rollout's files live, which questions it asks and which policy
it samples, for a training step or an evaluation of a checkpoint (its own namespace, never mixed
with training files)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from jobs.data import MathExample, read_examples, shuffled, take_batch
from jobs.evaluation import EVAL_MODES
from jobs.rollout_config import SEED_FIELDS
from jobs.run_setup import resolve_model
from jobs.settings import RunSettings, SettingsError


@dataclass(frozen=True)
class EvalSpec:
    dataset: str  # data file (native, AIME or DAPO layout)
    n: int  # samples per question (the group size of the eval rollout)
    mode: str  # retool (tool enabled) | text-only (no tool, one turn, the same budget)
    sft: bool = False  # evaluate the cold-start checkpoint (step -1) instead of the base model

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
    limit = 2 ** dict(SEED_FIELDS)["question_index"]
    if questions > limit:
        raise SettingsError(
            f"evaluation dataset {evaluation.dataset}: {questions} questions, over the {limit} one evaluation can "
            "seed apart; split the file"
        )
    text_only = evaluation.mode == "text-only"
    rollout = replace(
        settings.rollout,
        seed=settings.rollout.seed ^ 0x8000,  # evaluation draws apart from training's draws
        group_size=evaluation.n,
        shards=min(settings.rollout.shards, questions),
        max_assistant_turns=1 if text_only else settings.rollout.max_assistant_turns,
    )
    return replace(
        settings,
        data=replace(settings.data, train=evaluation.dataset, questions_per_step=questions),
        rollout=rollout,
        model=replace(settings.model, use_tools=not text_only),
    )


def step_folder(settings: RunSettings, step: int, evaluation: EvalSpec | None = None) -> Path:
    if evaluation is None:
        return settings.run_dir / f"step={step:04d}"
    name = ("sft" if evaluation.sft else "base") if step < 0 else f"{step:04d}"
    return (
        settings.run_dir
        / "eval"
        / Path(evaluation.dataset).stem
        / f"{evaluation.mode}-n{evaluation.n}"
        / f"step={name}"
    )


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


def step_examples(settings: RunSettings, step: int, evaluation: EvalSpec | None) -> list[MathExample]:
    if evaluation is not None:
        return list(_examples(evaluation.dataset))
    data = settings.data
    return take_batch(shuffled(_examples(data.train), data.seed), step, data.questions_per_step)
