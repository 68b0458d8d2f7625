"""The pipeline's stages as Luigi tasks: each says what it needs (`requires()`: every file its job reads) and
what it makes (`output()`), and its `run()` passes those paths to its job in `jobs/`, where the work is done.
Each is a RunTask (run_task.py) and a StepTask, which names the step's stages it takes as inputs."""

from __future__ import annotations

from pathlib import Path

import luigi

from jobs.build_datums import shard_datums
from jobs.execute_round import execute_round
from jobs.prompts import prompts
from jobs.sample_round import sample_round
from jobs.score_trajectories import score_shard, score_trajectories
from jobs.train_step import train_step
from pipeline.cold_start import ColdStart
from pipeline.run_task import EvalSpecParameter, RunTask, path
from retool.config.trainer import replayed_steps
from retool.evaluation.viewer import PageFiles
from retool.files.layout import RoundPaths
from retool.run.shared import history_steps
from retool.weights.checkpoint import Checkpoint


class StepTask(RunTask):
    """A stage of a training step, or of the evaluation of its checkpoint: its inputs named through the step's
    stages (its policy, the RL base, its rounds, the trajectory page)."""

    def policy(self) -> dict[str, luigi.Task]:
        """{"policy": the task that makes the checkpoint this task's rollout samples from}, none for the model
        setting: a training step samples from the checkpoint before it, or [rollout] max_staleness steps older
        (before step 0's: the cold start's, if the run has one), an evaluation from its own step's (-1: the model
        setting, or the cold start's with `sft`)."""
        source = self.stage.sampled_by
        if source >= 0:
            return {"policy": TrainStep(step=source), **self.rl_base()}
        wants_sft = self.evaluation.sft if self.evaluation is not None else bool(self.settings.cold_start.data)
        return {"policy": ColdStart()} if wants_sft else {}

    def rl_base(self) -> dict[str, luigi.Task]:
        """{"rl_base": the cold start} when RL starts from its weights, which a LoRA checkpoint applies to."""
        return {"rl_base": ColdStart()} if self.settings.cold_start.data else {}

    def rounds(self, shard: int, count: int) -> list[dict[str, luigi.Task]]:
        """The first `count` rounds of one shard: the stages whose files rebuild its trajectories."""
        return [
            {
                "samples": self.clone(SampleRound, shard=shard, round=r),
                "observations": self.clone(ExecuteRound, shard=shard, round=r),
            }
            for r in range(count)
        ]

    def all_rounds(self) -> list[list[dict[str, luigi.Task]]]:
        """Every round of every shard of the step."""
        rollout = self.rollout
        return [self.rounds(shard, rollout.rounds) for shard in range(rollout.shards)]

    def page(self) -> dict[str, luigi.Task]:
        """The stages whose files draw training step `step`'s trajectory page (see `page_files`)."""
        return {
            "prompts": self.clone(Prompts),
            "shards": self.all_rounds(),
            "trajectories": self.clone(ScoreTrajectories),
            "trained": self.clone(TrainStep),  # its datums.parquet
        }


class RolloutTask(StepTask):
    """A rollout stage of a training step, or (with `evaluation` set) of the evaluation of checkpoint `step`
    in its own folder under runs/<run>/eval/."""

    evaluation = EvalSpecParameter(default=None, description="the evaluation (JSON); empty: a training step")


class Prompts(RolloutTask):
    def requires(self):
        """With [data] draw = frontier, the trajectories of the earlier steps its draw reads."""
        steps = history_steps(self.stage) if self.evaluation is None else range(0)
        return {"history": [ScoreTrajectories(step=step) for step in steps]}

    def output(self):
        return self.target(self.folder.prompts)

    def run(self):
        history = [path(target) for target in self.input()["history"]]
        questions = self.evaluation.examples() if self.evaluation is not None else None  # in order; None: a draw
        self.summary = prompts(path(self.output()), self.stage.settings, self.step, questions, history)


class SampleRound(RolloutTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        return {"prompts": self.clone(Prompts), "rounds": self.rounds(self.shard, self.round), **self.policy()}

    def output(self):
        return self.target(self.folder.samples(self.shard, self.round))

    def run(self):
        inputs = self.input()
        self.summary = sample_round(
            path(inputs["prompts"]), round_paths(inputs["rounds"]), checkpoint_of(inputs),
            checkpoint_of(inputs, "rl_base"), path(self.output()),
            self.settings, self.stage, self.step, self.shard, self.round, self.set_status_message,
        )  # fmt: skip


class ExecuteRound(RolloutTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        rounds = self.rounds(self.shard, self.round)
        return {"prompts": self.clone(Prompts), "rounds": rounds, "samples": self.clone(SampleRound)}

    def output(self):
        return self.target(self.folder.observations(self.shard, self.round))

    def run(self):
        inputs = self.input()
        self.summary = execute_round(
            path(inputs["prompts"]), round_paths(inputs["rounds"]), path(inputs["samples"]), path(self.output()),
            self.stage, self.step, self.shard, self.round, self.set_status_message,
        )  # fmt: skip


class ScoreShard(RolloutTask):
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        return {"prompts": self.clone(Prompts), "rounds": self.rounds(self.shard, self.rollout.rounds)}

    def output(self):
        return self.target(self.folder.scored(self.shard))

    def run(self):
        inputs = self.input()
        self.summary = score_shard(
            path(inputs["prompts"]), round_paths(inputs["rounds"]), path(self.output()), self.stage, self.step,
            self.shard,
        )  # fmt: skip


class ScoreTrajectories(RolloutTask):
    def requires(self):
        return {"shards": [self.clone(ScoreShard, shard=shard) for shard in range(self.rollout.shards)]}

    def output(self):
        return self.target(self.folder.trajectories)

    def run(self):
        shards = [path(target) for target in self.input()["shards"]]
        self.summary = score_trajectories(shards, path(self.output()), self.stage)


class ShardDatums(StepTask):
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        return {
            "prompts": self.clone(Prompts),
            "rounds": self.rounds(self.shard, self.rollout.rounds),
            "trajectories": self.clone(ScoreTrajectories),
        }

    def output(self):
        return self.target(self.folder.shard_datums(self.shard))

    def run(self):
        inputs = self.input()
        self.summary = shard_datums(
            path(inputs["prompts"]), round_paths(inputs["rounds"]), path(inputs["trajectories"]),
            path(self.output()), self.stage, self.step, self.shard,
        )  # fmt: skip


class TrainStep(StepTask):
    """One PPO update from the step's datums (its shards'); its checkpoint is the policy the next step samples.
    Also writes the step's metrics.parquet and prints them as one line, and, while it trains, the step's
    datums.parquet: the shards' joined (the stage BuildDatums of the step's timings)."""

    def requires(self):
        observations = [r["observations"] for rounds in self.all_rounds() for r in rounds]
        step = {"datums": self.shard_datums(self.step), "trajectories": self.clone(ScoreTrajectories)}
        previous = {"previous": TrainStep(step=self.step - 1)} if self.step > 0 else {}  # step 0 starts from rl_base
        # Steps since the newest full save, which a resume replays from their datums (see retool/training/resume.py).
        replayed = [self.shard_datums(s) for s in replayed_steps(self.step, self.settings.trainer.save_every)]
        return {
            **step,
            "observations": observations,
            **previous,
            **self.rl_base(),
            **self.behaviour(),
            "replayed": replayed,
        }

    def shard_datums(self, step: int) -> list[ShardDatums]:
        """What the update of `step` reads: its shards' datums."""
        return [ShardDatums(step=step, shard=shard) for shard in range(self.rollout.shards)]

    def behaviour(self) -> dict[str, luigi.Task]:
        """{"behaviour": the older step that sampled this one} when the step trains [rollout] max_staleness steps
        behind: the sampler-gap check compares with its checkpoint (sampled by the RL base: `rl_base`, or none)."""
        source = self.stage.sampled_by
        return {"behaviour": TrainStep(step=source)} if 0 <= source < self.step - 1 else {}

    def output(self):
        """The checkpoint's marker, the step's metrics and its datums.parquet: a run killed before all three are
        written trains the step again (deterministically) rather than leaving one out."""
        folder = self.folder
        return {
            "checkpoint": self.target(Checkpoint(folder.checkpoint).marker),
            "metrics": self.target(folder.metrics),
            "datums": self.target(folder.datums),
        }

    def run(self):
        self.set_status_message("training one PPO step")
        inputs, outputs = self.input(), self.output()
        self.summary = train_step(
            [path(t) for t in inputs["datums"]], path(outputs["datums"]), path(inputs["trajectories"]),
            [path(t) for t in inputs["observations"]],
            checkpoint_of(inputs, "previous"), checkpoint_of(inputs, "rl_base"), checkpoint_of(inputs, "behaviour"),
            path(outputs["checkpoint"]).parent, path(outputs["metrics"]), self.folder.timings, self.stage, self.step,
        )  # fmt: skip


def round_paths(rounds: list[dict]) -> list[RoundPaths]:
    """The inputs of `StepTask.rounds` as paths."""
    return [RoundPaths(path(r["samples"]), path(r["observations"])) for r in rounds]


def page_files(inputs: dict) -> PageFiles:
    """The inputs of `StepTask.page` as paths."""
    rounds = [paths for shard in inputs["shards"] for paths in round_paths(shard)]
    return PageFiles(path(inputs["prompts"]), rounds, path(inputs["trajectories"]), path(inputs["trained"]["datums"]))


def checkpoint_of(inputs: dict, name: str = "policy") -> Path | None:
    """The checkpoint folder of a task's input `name` (its marker's folder); None: the task has no such input."""
    return path(inputs[name]["checkpoint"]).parent if name in inputs else None
