"""What an evaluation is: a data file, samples per question, a mode and its sampling; and the rollout
settings it runs under."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from retool.config.rollout import RolloutConfig, seed_capacity
from retool.config.settings import RunSettings, SettingsError
from retool.data.examples import MathExample, cached_examples
from retool.evaluation.scores import EVAL_MODES


@dataclass(frozen=True)
class EvalSpec:
    dataset: str  # data file (native, AIME or DAPO layout)
    n: int  # samples per question (the group size of the eval rollout)
    mode: str  # retool (tool enabled) | text-only (no tool, one turn, the same budget)
    sft: bool = False  # evaluate the cold-start checkpoint (step -1) instead of the base model
    limit: int = 0  # evaluate the file's first `limit` questions only; 0 = all
    temperature: float | None = None  # sampling temperature; None = the run's [rollout] temperature
    top_p: float | None = None  # nucleus sampling; None = the run's [rollout] top_p

    def __post_init__(self) -> None:
        if self.n <= 0 or self.limit < 0:
            raise SettingsError(f"evaluation n must be positive and limit >= 0, got {self.n} and {self.limit}")
        if self.mode not in EVAL_MODES:
            raise SettingsError(f"evaluation mode must be one of {EVAL_MODES}, got {self.mode!r}")

    @property
    def name(self) -> str:
        """The evaluation's folder: its data set by name and content, then how it samples."""
        sampling = "".join(
            f"-{key}{value:g}" for key, value in (("t", self.temperature), ("p", self.top_p)) if value is not None
        )
        limit = f"-first{self.limit}" if self.limit else ""
        return f"{Path(self.dataset).stem}-{content_hash(self.dataset)}/{self.mode}-n{self.n}{sampling}{limit}"

    def examples(self) -> list[MathExample]:
        examples = list(cached_examples(self.dataset))
        return examples[: self.limit] if self.limit else examples


def content_hash(path: str) -> str:
    """The first hex digits of a file's SHA-256: two files with different questions never share an
    evaluation, and the same file under another path or name reuses it."""
    file = Path(path)
    return _content_hash(str(file.resolve()), file.stat().st_mtime_ns, file.stat().st_size)


@lru_cache(maxsize=64)
def _content_hash(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:10]


def check_evaluated_checkpoint(settings: RunSettings, step: int, evaluation: EvalSpec | None) -> None:
    """An evaluation of the cold-start checkpoint (`sft`) scores step -1 of a run that has one."""
    if evaluation is not None and evaluation.sft and (step != -1 or not settings.cold_start.data):
        raise SettingsError(
            "--sft evaluates the cold-start checkpoint: it needs --step -1 and a run with [cold_start] data set"
        )


@lru_cache(maxsize=64)  # asked by every task of an evaluation's graph; the data file is read once
def evaluation_settings(settings: RunSettings, evaluation: EvalSpec | None) -> RunSettings:
    """The settings a rollout runs under: the run's own for a training step (`evaluation` None), or an
    evaluation's: every question of its data set once, `n` samples each; text-only mode declares no tool and
    allows one turn."""
    if evaluation is None:
        return settings
    questions = len(evaluation.examples())
    limit = seed_capacity("question_index")
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
        shards=evaluation_shards(settings.rollout, questions, evaluation.n),
        max_assistant_turns=1 if text_only else settings.rollout.max_assistant_turns,
        temperature=settings.rollout.temperature if evaluation.temperature is None else evaluation.temperature,
        top_p=settings.rollout.top_p if evaluation.top_p is None else evaluation.top_p,
    )
    return replace(
        settings,
        data=replace(settings.data, train=evaluation.dataset, questions_per_step=questions, questions_drawn=0),
        rollout=rollout,
        model=replace(settings.model, use_tools=not text_only),
    )


def evaluation_shards(rollout: RolloutConfig, questions: int, n: int) -> int:
    """The shards of an evaluation: the run's, or enough that none holds over eval_shard_sequences trajectories."""
    wanted = -(-questions * n // rollout.eval_shard_sequences) if rollout.eval_shard_sequences else rollout.shards
    return max(1, min(max(wanted, rollout.shards), questions))
