"""RunTask, the base of every task: its settings, stage and folder, when it counts as complete, its priority and
label, and the notes and the line each task leaves as it starts and ends; with the parameter types the tasks take.
It names no stage, so the modules of stages build on it in one direction: run_task.py, then cold_start.py (the
cold start's tasks), then tasks.py (a step's stages, and StepTask: the inputs a stage of a step names through
them, the cold start's checkpoint among them), then evaluation.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import cached_property
from pathlib import Path

import luigi

from pipeline.config import current_settings
from pipeline.outcome import note_end, note_failure, note_start, watch_if_named_on_the_command_line
from retool.config.rollout import RolloutConfig
from retool.config.settings import RunSettings, SettingsError, StageSettings, training_stage
from retool.evaluation.metrics import record_stage_seconds
from retool.evaluation.spec import EvalSpec, check_evaluated_checkpoint, evaluation_settings
from retool.files.layout import RunFolder, StepFolder
from retool.files.tables import parquet_seconds
from retool.recoveries import added_since, recovery_counts
from retool.run.setup import open_run


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


def path(target: luigi.LocalTarget) -> Path:
    return Path(target.path)


class Choice(luigi.ChoiceParameter):
    """A task option of a few values; a value that is none of them is an input error of one line naming them all."""

    def __init__(self, option: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.option = option  # as the command line spells it, --eval-mode

    def normalize(self, value):
        if value not in self._choices:
            raise SettingsError(f"{self.option} {value!r}: must be one of {', '.join(sorted(self._choices))}")
        return value


class EvalSpecParameter(luigi.Parameter):
    """An evaluation as one parameter: the JSON of its fields; empty for a training step."""

    def parse(self, text: str) -> EvalSpec | None:
        return EvalSpec(**json.loads(text)) if text else None

    def serialize(self, spec: EvalSpec | None) -> str:
        return json.dumps(asdict(spec), sort_keys=True) if spec is not None else ""

    def normalize(self, value):
        return self.parse(value) if isinstance(value, str) else value
