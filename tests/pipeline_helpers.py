"""Helpers of the pipeline tests: the step's questions, a tool-calling policy, and builds of a step."""

from __future__ import annotations

import luigi

import pipeline.tasks
import retool.sampling.engines
from pipeline import ScoreTrajectories
from tests.policies import branching_tools, drawn_examples


def batch(settings, step):
    """The questions of training step `step`, read from its prompts.parquet."""
    return drawn_examples(settings, step)


def tool_policy(settings, _step=None):
    """Branch (q + g) % 3 calls the tool that many times, then answers; even branches correctly."""
    return branching_tools(settings)


def build(settings, step, sampler=None, monkeypatch=None):
    if sampler is not None:
        monkeypatch.setattr(retool.sampling.engines, "sampler_for", lambda *_: sampler)
    return luigi.build([ScoreTrajectories(step=step)], local_scheduler=True, workers=1, log_level="WARNING")


def step_dir(settings, step):
    return settings.run_dir / f"step={step:04d}"


# The [trainer] section of pipeline tests that train: a small LoRA, a large step.
TRAIN = {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3, "micro_batch_items": 2, "micro_batch_tokens": 4096}


def build_train(settings, step, sampler, monkeypatch):
    monkeypatch.setattr(retool.sampling.engines, "sampler_for", lambda *_: sampler)
    return luigi.build([pipeline.tasks.TrainStep(step=step)], local_scheduler=True, workers=1, log_level="WARNING")
