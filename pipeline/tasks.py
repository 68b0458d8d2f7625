"""Rollout, training and evaluation stages as Luigi tasks. Each run() reads its inputs, calls one stage
function of retool.stages and writes its output atomically; the rules live in retool/."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path

import luigi

from pipeline.config import current_settings
from pipeline.outcome import note_end, note_failure, note_start, watch_if_named_on_the_command_line
from retool.evaluation.metrics import record_stage_seconds
from retool.evaluation.report import make_report
from retool.evaluation.scores import EVAL_MODES, describe_eval
from retool.evaluation.spec import EvalSpec
from retool.files.layout import REPORT
from retool.files.tables import SAMPLES, TRAJECTORIES, parquet_seconds, read_table, write_table_atomically
from retool.run.context import RunContext, context_for, open_run
from retool.sampling.engines import reclaim_sampler_memory, release_sampler_memory
from retool.stages.rollout import (
    datums_table,
    describe_datums,
    describe_observations,
    describe_prompts,
    describe_samples,
    describe_trajectories,
    execute_round,
    prompts_table,
    sample_round,
    score_step,
)
from retool.stages.summary import before_after_stage, evaluate_stage, metrics_stage, training_sources
from retool.stages.training import cold_start_stage, describe_metrics, sft_examples_stage, train_stage
from retool.training.cold_start import describe_cold_start, losses_table
from retool.weights.checkpoint import Checkpoint


class RunTask(luigi.Task):
    """A stage of one step of one run. Making one sets the run up (once per process): the command line
    builds its task before Luigi schedules anything or forks worker processes."""

    step = luigi.IntParameter(description="training step (an evaluation: the checkpoint; -1 the base model)")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        open_run(current_settings(), luigi.interface.core().workers)
        self.context = self.make_context()  # an evaluation's data file is read here too
        watch_if_named_on_the_command_line(self)

    def make_context(self) -> RunContext:
        return context_for(current_settings(), self.step)

    @property
    def priority(self) -> int:
        """Luigi runs higher priorities first, and a task's inputs inherit its priority: shard s's rounds
        before shard s+1's, the rest after them. One worker then finishes a shard's round chain while its
        prompts are still in the sampler's prefix cache, rather than sampling every shard's round r first."""
        shard = getattr(self, "shard", None)
        return -shard if shard is not None else -(2**16)

    def complete(self) -> bool:
        """Complete only when the output exists and every input of the same step and namespace is
        complete too, so deleting one stage's output re-runs it and everything downstream. Other
        steps (the policy) count by their own output: no walk back through every earlier step."""
        folder = self.context.folder
        return super().complete() and all(
            t.complete() if t.context.folder == folder else all(o.exists() for o in luigi.task.flatten(t.output()))
            for t in luigi.task.flatten(self.requires())
        )

    def label(self) -> str:
        """The task as users name it: its parameters, an evaluation by its folder, unset ones left out."""
        params = self.to_str_params(only_significant=True)
        if getattr(self, "evaluation", None) is not None:
            params["evaluation"] = self.evaluation.name  # its folder under runs/<run>/eval/
        unset = {"evaluation": "", "limit": "0", "temperature": "", "top_p": ""}  # the run's own: not shown
        params = {k: v for k, v in params.items() if unset.get(k) != v}
        return f"{self.task_family}({', '.join(f'{k}={v}' for k, v in params.items())})"

    def target(self, path) -> luigi.LocalTarget:
        return luigi.LocalTarget(str(path))

    def policy_task(self) -> list[luigi.Task]:
        """The task that makes the checkpoint this task's rollout samples from (none for the model setting)."""
        checkpoint = self.context.policy_checkpoint
        if checkpoint is None:
            return []
        if checkpoint.path == self.context.run_folder.sft.checkpoint:
            return [ColdStart()]
        evaluating = self.context.evaluation is not None  # an evaluation scores checkpoint `step` itself
        return [TrainStep(step=self.step if evaluating else self.step - 1)]

    def write(self, table, describe) -> None:
        write_table_atomically(table, self.output().path)  # replaces a stale output in one rename
        self.summary = describe(table)


@RunTask.event_handler(luigi.Event.START)
def _note_start(task: RunTask) -> None:
    task.parquet_seconds_at_start = parquet_seconds()
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
    timings = task.context.folder.timings
    record_stage_seconds(
        timings, task.task_id, task.task_family, seconds, parquet_seconds() - task.parquet_seconds_at_start
    )
    where = luigi.task.flatten(task.output())[0].path
    print(f"{task.label()}: {getattr(task, 'summary', '')}, {seconds:.1f} s -> {where}", flush=True)


class EvalSpecParameter(luigi.Parameter):
    """An evaluation as one parameter: the JSON of its fields; empty for a training step."""

    def parse(self, text: str) -> EvalSpec | None:
        return EvalSpec(**json.loads(text)) if text else None

    def serialize(self, spec: EvalSpec | None) -> str:
        return json.dumps(asdict(spec), sort_keys=True) if spec is not None else ""

    def normalize(self, value):
        return self.parse(value) if isinstance(value, str) else value


class RolloutTask(RunTask):
    """A rollout stage of a training step, or (with `evaluation` set) of the evaluation of checkpoint `step`
    in its own folder under runs/<run>/eval/."""

    evaluation = EvalSpecParameter(default=None, description="the evaluation (JSON); empty: a training step")

    def make_context(self) -> RunContext:
        return context_for(current_settings(), self.step, self.evaluation)


class Prompts(RolloutTask):
    def output(self):
        return self.target(self.context.folder.prompts)

    def run(self):
        self.write(prompts_table(self.context.examples(), self.context.protocol, self.step), describe_prompts)


class SampleRound(RolloutTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        state = self.clone(Prompts) if self.round == 0 else self.clone(ExecuteRound, round=self.round - 1)
        return [state] + self.policy_task()

    def output(self):
        return self.target(self.context.folder.samples(self.shard, self.round))

    def run(self):
        context = self.context
        trajectories = context.trajectories(self.shard, self.round)
        self.set_status_message(f"sampling for {sum(not t.done for t in trajectories)} live trajectories")
        rollout = context.settings.rollout
        sampler = functools.partial(context.sampler, self.shard)  # loaded only when there is something to sample
        self.write(
            sample_round(trajectories, sampler, context.protocol, rollout, self.step, self.round), describe_samples
        )


class ExecuteRound(RolloutTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        return self.clone(SampleRound)

    def output(self):
        return self.target(self.context.folder.observations(self.shard, self.round))

    def run(self):
        context = self.context
        trajectories = context.trajectories(self.shard, self.round)
        samples = read_table(self.input().path, SAMPLES)
        self.set_status_message(f"running the tool calls of {samples.num_rows} turns")
        rollout = context.settings.rollout
        observations = execute_round(
            trajectories, samples, context.sandbox, context.protocol, rollout, self.step, self.round
        )
        self.write(observations, describe_observations)


class ScoreTrajectories(RolloutTask):
    def requires(self):
        rollout = self.context.settings.rollout
        last_round = rollout.max_assistant_turns - 1
        return [self.clone(ExecuteRound, round=last_round, shard=shard) for shard in range(rollout.shards)]

    def output(self):
        return self.target(self.context.folder.trajectories)

    def run(self):
        context = self.context
        scored = score_step(context.all_trajectories(), self.step, context.settings.data.keep_limit)
        self.write(scored, describe_trajectories)


class BuildDatums(RunTask):
    def requires(self):
        return self.clone(ScoreTrajectories)

    def output(self):
        return self.target(self.context.folder.datums)

    def run(self):
        scored = read_table(self.input().path, TRAJECTORIES)
        context = self.context
        trainer_max_tokens = context.settings.rollout.trainer_max_tokens
        self.write(datums_table(context.all_trajectories(), scored, self.step, trainer_max_tokens), describe_datums)


ROLLOUT_STAGES = (Prompts, SampleRound, ExecuteRound, ScoreTrajectories, BuildDatums)  # timed in a step's metrics


class TrainStep(RunTask):
    """One PPO update from the step's datums; its checkpoint is the policy the next step samples.
    Also writes the step's metrics.parquet and prints them as one line."""

    def requires(self):
        policy = {"policy": task for task in self.policy_task()}
        return {"datums": self.clone(BuildDatums), "trajectories": self.clone(ScoreTrajectories), **policy}

    def output(self):
        """The checkpoint's marker and the step's metrics: a run killed between the two trains the
        step again (deterministically) rather than leaving the metrics out."""
        folder = self.context.folder
        return {"checkpoint": self.target(Checkpoint(folder.checkpoint).marker), "metrics": self.target(folder.metrics)}

    def run(self):
        self.set_status_message("training one PPO step")
        context, inputs = self.context, self.input()
        previous = Path(inputs["policy"]["checkpoint"].path).parent if self.step > 0 else None  # step 0: the RL base
        release_sampler_memory(context.run)  # the sampler sleeps while the step trains on the GPU
        datums, trajectories = inputs["datums"].path, inputs["trajectories"].path
        training = train_stage(context.run, self.step, datums, trajectories, previous, context.folder.checkpoint)
        reclaim_sampler_memory(context.run)
        stages = [stage.__name__ for stage in ROLLOUT_STAGES]
        metrics = metrics_stage(
            context.folder, context.tracker, self.step, training, context.sandbox, stages, self.task_family
        )
        self.summary = f"{describe_metrics(training)}\n  {metrics}"


class ColdStartTask(RunTask):
    """A stage of the run's cold start, before step 0, in runs/<run>/sft/."""

    step = luigi.IntParameter(default=-1, significant=False, description="not used: the cold start precedes step 0")

    def make_context(self) -> RunContext:
        return context_for(current_settings(), -1, cold_start=True)


class SFTExamples(ColdStartTask):
    """The cold-start conversations rendered through the rollout's protocol: sft/examples.parquet."""

    def output(self):
        return self.target(self.context.folder.sft_examples)

    def run(self):
        table, skipped = sft_examples_stage(self.context.run, self.context.protocol)
        self.write(table, functools.partial(describe_datums, kind="SFT examples"))
        self.summary += f" ({skipped} conversations over the budgets or turn limits, left out)" if skipped else ""


class ColdStart(ColdStartTask):
    """Supervised fine-tuning on the SFT examples: sft/checkpoint/ (full weights; the policy RL
    starts from) and the loss of every step in sft/losses.parquet. Resumes from sft/progress/."""

    def requires(self):
        return SFTExamples()

    def output(self):
        folder = self.context.folder
        return {
            "checkpoint": self.target(Checkpoint(folder.checkpoint).marker),
            "losses": self.target(folder.sft_losses),
        }

    def run(self):
        folder, run = self.context.folder, self.context.run
        release_sampler_memory(run)  # an engine left awake (the base model's evaluation) sleeps while SFT trains
        losses = cold_start_stage(run, self.input().path, folder.checkpoint, folder.sft_progress, self.report_progress)
        reclaim_sampler_memory(run)
        write_table_atomically(losses_table(losses), self.output()["losses"].path)
        self.summary = describe_cold_start(losses)

    def report_progress(self, row: dict) -> None:
        steps = self.context.run.cold_start.steps
        line = f"cold start step {row['step'] + 1}/{steps}: loss {row['loss']:.3f}, {row['seconds']:.1f} s"
        self.set_status_message(line)
        print(line, flush=True)


class EvaluationTask(RunTask):
    """The parameters of an evaluation of checkpoint `step`: its data, samples per question, mode and sampling."""

    dataset = luigi.Parameter(default="data/synthetic_eval.jsonl", description="evaluation data file")
    n = luigi.IntParameter(default=4, description="samples per question")
    # Not `mode`: Luigi's first pass over the command line would read --mode as an abbreviation of --model-*.
    eval_mode = luigi.ChoiceParameter(choices=EVAL_MODES, default="retool", description="retool, or text-only: no tool")
    sft = luigi.BoolParameter(
        default=False, description="with --step -1: evaluate the cold-start checkpoint, not the base model"
    )
    limit = luigi.IntParameter(default=0, description="evaluate the data set's first N questions only (0: all)")
    temperature = luigi.OptionalFloatParameter(default=None, description="evaluation temperature (default: the run's)")
    top_p = luigi.OptionalFloatParameter(default=None, description="evaluation top_p (default: the run's)")

    def spec(self, sft: bool | None = None) -> EvalSpec:
        sft = self.sft if sft is None else sft
        return EvalSpec(self.dataset, self.n, self.eval_mode, sft, self.limit, self.temperature, self.top_p)

    def make_context(self) -> RunContext:
        return context_for(current_settings(), self.step, self.spec())


class Evaluate(EvaluationTask):
    """Average@N / Pass@N of checkpoint `step` (-1: the base model) on an eval set, in retool or
    text-only mode: summary.parquet in the evaluation's folder, and one printed line."""

    def requires(self):
        return ScoreTrajectories(step=self.step, evaluation=self.spec())

    def output(self):
        return self.target(self.context.folder.summary)

    def run(self):
        trajectories = read_table(self.input().path, TRAJECTORIES)
        context = self.context
        summary = evaluate_stage(trajectories, context.evaluation, self.step, self.output().path, context.tracker)
        self.summary = f"{self.eval_mode} on {self.dataset}: {describe_eval(summary)}"


class Report(RunTask):
    """Once training step `step` is done: plots and a Markdown summary of steps 0..step and the evaluations of
    their checkpoints, under runs/<run>/report/step=NNNN/ (`python -m retool report runs/NAME` by hand, of all)."""

    def requires(self):
        return TrainStep(step=self.step)

    def output(self):
        return self.target(self.context.run_folder.report(self.step) / REPORT)

    def complete(self):
        """Built, and newer than every file it draws: a new evaluation of a checkpoint it shows rebuilds it."""
        report = Path(self.output().path)
        return report.exists() and not self.context.run_folder.changed_since(report, self.step)

    def run(self):
        self.summary = f"plots and summary of {self.step + 1} steps"
        make_report(self.context.run.run_dir, self.context.run_folder.report(self.step), self.step)


class BeforeAfter(EvaluationTask):
    """Training through step `step`, then the base model, the cold-start checkpoint (if the run has
    one) and checkpoint `step` evaluated on the same held-out questions: a before/after table in the
    evaluations' folder, printed, and the run's report with the evaluations."""

    def evaluations(self) -> list[tuple[str, Evaluate]]:
        policies = (
            [("base", -1, False)]
            + ([("SFT", -1, True)] if self.context.run.cold_start.data else [])
            + [(f"RL step {self.step}", self.step, False)]
        )
        return [(label, self.clone(Evaluate, step=step, sft=sft)) for label, step, sft in policies]

    def requires(self):
        return [task for _, task in self.evaluations()]

    def output(self):
        return self.target(self.context.run_folder.before_after(self.spec().name, self.step))

    def run(self):
        evaluations = [(label, task.context.folder) for label, task in self.evaluations()]
        run_folder = self.context.run_folder
        trained = training_sources(self.context.run)
        self.summary = "\n" + before_after_stage(
            run_folder.path, evaluations, trained, self.output().path, run_folder.report(self.step), self.step
        )
