"""The pipeline's stages as Luigi tasks: each says what it needs (`requires()`: every file its job reads) and
what it makes (`output()`), and its `run()` passes those paths to its job in `jobs/`, where the work is done."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import luigi

from jobs.build_datums import shard_datums
from jobs.execute_round import execute_round
from jobs.prompts import prompts
from jobs.sample_round import sample_round
from jobs.score_trajectories import score_shard, score_trajectories
from jobs.train_step import train_step
from pipeline.config import EvalSpecParameter, current_settings
from pipeline.outcome import note_end, note_failure, note_start, watch_if_named_on_the_command_line
from retool.config.rollout import RolloutConfig
from retool.config.settings import RunSettings, StageSettings, training_stage
from retool.config.trainer import replayed_steps
from retool.evaluation.metrics import record_stage_seconds
from retool.evaluation.spec import EvalSpec, check_evaluated_checkpoint, evaluation_settings
from retool.evaluation.viewer import PageFiles
from retool.files.layout import RoundPaths, RunFolder, StepFolder
from retool.files.tables import parquet_seconds
from retool.recoveries import added_since, recovery_counts
from retool.run.setup import open_run
from retool.run.shared import history_steps
from retool.weights.checkpoint import Checkpoint


class RunTask(luigi.Task):
    """A stage of one step of one run. Making one has no effect; the run is set up (`open_run`, once per process)
    when Luigi first asks whether a task is complete, before it schedules anything or forks worker processes
    (the command line asks of the task it names as soon as it is made)."""

    step = luigi.IntParameter(description="training step (an evaluation: the checkpoint; -1 the base model)")
    evaluation: EvalSpec | None = None  # None: a stage of a training step

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings: RunSettings = current_settings()  # as the config files and the command line give them
        watch_if_named_on_the_command_line(self)

    @cached_property
    def stage(self) -> StageSettings:
        """What this task's stage runs under, resolved here once: a training step's own settings, or its
        evaluation's (its questions, n samples each, its shards and mode) sampled by its own step's checkpoint."""
        if self.evaluation is None:
            return training_stage(self.settings, self.step)
        return StageSettings(evaluation_settings(self.settings, self.evaluation), self.step)

    @property
    def rollout(self) -> RolloutConfig:
        return self.stage.settings.rollout

    @property
    def run_folder(self) -> RunFolder:
        return RunFolder(self.settings.run_dir)

    @cached_property
    def folder(self) -> StepFolder:
        """Where the task writes: its step's folder, or its evaluation's (made once: every check of a task downstream
        asks for it)."""
        if self.evaluation is None:
            return self.run_folder.step(self.step)
        return self.run_folder.evaluation(self.evaluation.name, self.step, self.evaluation.sft)

    @property
    def priority(self) -> int:
        """Luigi runs higher priorities first, and a task's inputs inherit its priority: shard s's rounds
        before shard s+1's, the rest after them. One worker then finishes a shard's round chain while its
        prompts are still in the sampler's prefix cache, rather than sampling every shard's round r first.
        An evaluation's tasks come after every training task's, the newest checkpoint's first, so that the sampler
        takes each checkpoint once rather than at every switch between them (a CPU engine starts anew each time)."""
        shard = getattr(self, "shard", None)
        within = -shard if shard is not None else -(2**16)
        if self.evaluation is None:
            return within
        # A band per checkpoint below every training task's: RL step N's is N + 2, the cold start's 1, the base's 0.
        band = self.step + 2 if self.step >= 0 else int(self.evaluation.sft)
        return within - 2**20 * (2**20 - band)

    def complete(self) -> bool:
        """Complete only when the output exists and so does every input's of the same step and namespace, however
        far upstream, so deleting one stage's output re-runs it and everything downstream. Other steps (the
        policy) count by their own output: no walk back through every earlier step. Each task is visited once."""
        if "_opened" not in self.__dict__:  # Luigi asks several times; its command's settings cost a millisecond
            open_run(self.settings, luigi.interface.core().workers)
            check_evaluated_checkpoint(self.settings, self.step, self.evaluation)
            self._opened = True
        if not super().complete():
            return False
        folder, seen, waiting = self.folder, set(), list(self.inputs())
        while waiting:
            task = waiting.pop()
            if task.task_id in seen:
                continue
            seen.add(task.task_id)
            if not all(output.exists() for output in task.outputs()):
                return False
            if task.folder == folder:
                waiting += task.inputs()
        return True

    def inputs(self) -> list[RunTask]:
        """requires(), flattened, made once per task: Luigi checks every task's inputs before running it, and each
        check walks back through the round chain (tasks are made once per parameters, so this is kept with it)."""
        if "_inputs" not in self.__dict__:
            self._inputs = luigi.task.flatten(self.requires())
        return self._inputs

    def deps(self) -> list[RunTask]:
        """Luigi's dependencies: inputs(), made once (it asks when it schedules the task and again before it runs)."""
        return self.inputs()

    def outputs(self) -> list[luigi.LocalTarget]:
        """output(), flattened, made once per task, for the same checks."""
        if "_outputs" not in self.__dict__:
            self._outputs = luigi.task.flatten(self.output())
        return self._outputs

    def label(self) -> str:
        """The task as users name it: its parameters, an evaluation by its folder, unset ones left out."""
        params = self.to_str_params(only_significant=True)
        if params.get("evaluation"):
            params["evaluation"] = self.evaluation.name  # its folder under runs/<run>/eval/
        unset = {"evaluation": "", "limit": "0", "temperature": "", "top_p": ""}  # the run's own: not shown
        params = {k: v for k, v in params.items() if unset.get(k) != v}
        return f"{self.task_family}({', '.join(f'{k}={v}' for k, v in params.items())})"

    def target(self, path) -> luigi.LocalTarget:
        return luigi.LocalTarget(str(path))

    def policy(self) -> dict[str, luigi.Task]:
        """{"policy": the task that makes the checkpoint this task's rollout samples from}, none for the model
        setting: a training step samples from the checkpoint before it, or [rollout] max_staleness steps older
        (before step 0's: the cold start's, if the run has one), an evaluation from its own step's (-1: the model
        setting, or the cold start's with `sft`)."""
        from pipeline.cold_start import ColdStart  # its tasks subclass RunTask: imported here, not above

        source = self.stage.sampled_by
        if source >= 0:
            return {"policy": TrainStep(step=source), **self.rl_base()}
        wants_sft = self.evaluation.sft if self.evaluation is not None else bool(self.settings.cold_start.data)
        return {"policy": ColdStart()} if wants_sft else {}

    def rl_base(self) -> dict[str, luigi.Task]:
        """{"rl_base": the cold start} when RL starts from its weights, which a LoRA checkpoint applies to."""
        from pipeline.cold_start import ColdStart

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


@RunTask.event_handler(luigi.Event.START)
def _note_start(task: RunTask) -> None:
    task.parquet_seconds_at_start, task.recoveries_at_start = parquet_seconds(), recovery_counts()
    note_start(task)


@RunTask.event_handler(luigi.Event.SUCCESS)
def _note_success(task: RunTask) -> None:
    note_end(task, finished=True)


@RunTask.event_handler(luigi.Event.FAILURE)
def _note_failure(task: RunTask, error: Exception) -> None:
    note_end(task, finished=False)
    note_failure(task, error)


@RunTask.event_handler(luigi.Event.PROCESSING_TIME)
def _report_stage(task: RunTask, seconds: float) -> None:
    """One line per finished stage: what it wrote, how long it took, and where."""
    timings = task.folder.timings
    record_stage_seconds(
        timings, task.task_id, task.task_family, seconds, parquet_seconds() - task.parquet_seconds_at_start,
        added_since(task.recoveries_at_start),
    )  # fmt: skip
    where = luigi.task.flatten(task.output())[0].path
    print(f"{task.label()}: {getattr(task, 'summary', '')}, {seconds:.1f} s -> {where}", flush=True)


class RolloutTask(RunTask):
    """A rollout stage of a training step, or (with `evaluation` set) of the evaluation of checkpoint `step`
    in its own folder under runs/<run>/eval/."""

    evaluation = EvalSpecParameter(default=None, description="the evaluation (JSON); empty: a training step")


class Prompts(RolloutTask):
    def requires(self):
        """With [data] draw = frontier, the trajectories of the earlier steps its draw reads."""
        steps = history_steps(self.settings, self.step) if self.evaluation is None else range(0)
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


class ShardDatums(RunTask):
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


class TrainStep(RunTask):
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


def path(target: luigi.LocalTarget) -> Path:
    return Path(target.path)


def round_paths(rounds: list[dict]) -> list[RoundPaths]:
    """The inputs of `RunTask.rounds` as paths."""
    return [RoundPaths(path(r["samples"]), path(r["observations"])) for r in rounds]


def page_files(inputs: dict) -> PageFiles:
    """The inputs of `RunTask.page` as paths."""
    rounds = [paths for shard in inputs["shards"] for paths in round_paths(shard)]
    return PageFiles(path(inputs["prompts"]), rounds, path(inputs["trajectories"]), path(inputs["trained"]["datums"]))


def checkpoint_of(inputs: dict, name: str = "policy") -> Path | None:
    """The checkpoint folder of a task's input `name` (its marker's folder); None: the task has no such input."""
    return path(inputs[name]["checkpoint"]).parent if name in inputs else None
