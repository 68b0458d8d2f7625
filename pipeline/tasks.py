"""Rollout, training and evaluation stages as Luigi tasks. Each run() reads its inputs, calls one
function of jobs/ and writes its output atomically; the rules live in jobs/."""

from __future__ import annotations

import functools

import luigi

from pipeline.config import current_settings
from pipeline.outcome import note_failure, watch_if_named_on_the_command_line
from retool.evaluation.metrics import record_stage_seconds
from retool.evaluation.report import make_report
from retool.evaluation.scores import EVAL_MODES, describe_eval
from retool.evaluation.spec import EvalSpec
from retool.files.layout import sft_folder
from retool.files.tables import SAMPLES, TRAJECTORIES, parquet_seconds, read_table, write_table_atomically
from retool.run.context import RunContext, context_for, open_run
from retool.sampling.engines import reclaim_sampler_memory, release_sampler_memory
from retool.stages.rollout import datums_table, describe, execute_round, prompts_table, sample_round, score_step
from retool.stages.summary import before_after_stage, evaluate_stage, metrics_stage, training_sources
from retool.stages.training import cold_start_stage, describe_metrics, sft_examples_stage, train_stage
from retool.training.cold_start import describe_cold_start, losses_table


class RunTask(luigi.Task):
    """A stage of one step of one run: a training step, or (with `dataset` set) the evaluation of
    checkpoint `step` (-1: the base model) in its own folder under runs/<run>/eval/."""

    step = luigi.IntParameter(description="training step (an evaluation: the checkpoint; -1 the base model)")
    dataset = luigi.Parameter(default="", description="evaluation data file; empty for training")
    n = luigi.IntParameter(default=0, description="evaluation samples per question")
    mode = luigi.ChoiceParameter(choices=EVAL_MODES, default="retool", description="evaluation mode")
    sft = luigi.BoolParameter(
        default=False, description="with --step -1: evaluate the cold-start checkpoint, not the base model"
    )
    limit = luigi.IntParameter(default=0, description="evaluate the data set's first N questions only (0: all)")
    temperature = luigi.OptionalFloatParameter(default=None, description="evaluation temperature (default: the run's)")
    top_p = luigi.OptionalFloatParameter(default=None, description="evaluation top_p (default: the run's)")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The run's set-up, once: the command line builds its task here, before Luigi schedules anything or
        # forks worker processes. An evaluation's data file is read here too.
        open_run(current_settings(), luigi.interface.core().workers)
        self.context.settings
        watch_if_named_on_the_command_line(self)

    @property
    def context(self) -> RunContext:
        evaluation = (
            EvalSpec(self.dataset, self.n, self.mode, self.sft, self.limit, self.temperature, self.top_p)
            if self.dataset
            else None
        )
        return context_for(current_settings(), self.step, evaluation)

    @property
    def priority(self) -> int:
        """Luigi runs higher priorities first, and a task's inputs inherit its priority: shard s's rounds
        before shard s+1's, the rest after them. One worker then finishes a shard's round chain while its
        prompts are still in the sampler's prefix cache, rather than sampling every shard's round r first."""
        shard = getattr(self, "shard", None)
        return -shard if shard is not None else -(2**16)

    def target(self, relative: str) -> luigi.LocalTarget:
        return luigi.LocalTarget(str(self.context.folder / relative))

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
        """The task as users name it: training tasks without the (empty) evaluation parameters."""
        params = self.to_str_params(only_significant=True)
        if not self.dataset:
            evaluation = ("dataset", "n", "mode", "sft", "limit", "temperature", "top_p")
            params = {k: v for k, v in params.items() if k not in evaluation}
        unset = {"limit": "0", "temperature": "", "top_p": ""}  # an evaluation's sampling as the run's: not shown
        params = {k: v for k, v in params.items() if unset.get(k) != v}
        return f"{self.task_family}({', '.join(f'{k}={v}' for k, v in params.items())})"

    def write(self, table) -> None:
        write_table_atomically(table, self.output().path)  # replaces a stale output in one rename
        self.summary = describe(table)

    def policy_task(self) -> list[luigi.Task]:
        """The task that makes the policy this rollout samples from (none for the base model)."""
        policy = self.context.policy
        if policy is None:
            return []
        if policy.parent == sft_folder(self.context.run):
            return [ColdStart()]
        return [TrainStep(step=self.step if self.dataset else self.step - 1)]


@RunTask.event_handler(luigi.Event.START)
def _note_start(task: RunTask) -> None:
    task.parquet_seconds_at_start = parquet_seconds()


@RunTask.event_handler(luigi.Event.FAILURE)
def _note_failure(task: RunTask, error: Exception) -> None:
    note_failure(task, error)


@RunTask.event_handler(luigi.Event.PROCESSING_TIME)
def _report_stage(task: RunTask, seconds: float) -> None:
    """One line per finished stage: what it wrote, how long it took, and where."""
    record_stage_seconds(
        task.context.folder,
        task.task_id,
        task.task_family,
        seconds,
        parquet_seconds() - task.parquet_seconds_at_start,
    )
    where = luigi.task.flatten(task.output())[0].path
    print(f"{task.label()}: {getattr(task, 'summary', '')}, {seconds:.1f} s -> {where}", flush=True)


class Prompts(RunTask):
    def output(self):
        return self.target("prompts.parquet")

    def run(self):
        self.write(prompts_table(self.context.examples(), self.context.protocol, self.step))


class SampleRound(RunTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        state = self.clone(Prompts) if self.round == 0 else self.clone(ExecuteRound, round=self.round - 1)
        return [state] + self.policy_task()

    def output(self):
        return self.target(f"shard={self.shard:02d}/round={self.round:02d}/samples.parquet")

    def run(self):
        context = self.context
        trajectories = context.trajectories(self.shard, self.round)
        self.set_status_message(f"sampling for {sum(not t.done for t in trajectories)} live trajectories")
        rollout = context.settings.rollout
        sampler = functools.partial(context.sampler, self.shard)  # loaded only when there is something to sample
        self.write(sample_round(trajectories, sampler, context.protocol, rollout, self.step, self.round))


class ExecuteRound(RunTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        return self.clone(SampleRound)

    def output(self):
        return self.target(f"shard={self.shard:02d}/round={self.round:02d}/observations.parquet")

    def run(self):
        context = self.context
        trajectories = context.trajectories(self.shard, self.round)
        samples = read_table(self.input().path, SAMPLES)
        self.set_status_message(f"running the tool calls of {samples.num_rows} turns")
        rollout = context.settings.rollout
        self.write(
            execute_round(trajectories, samples, context.sandbox, context.protocol, rollout, self.step, self.round)
        )


class ScoreTrajectories(RunTask):
    def requires(self):
        rollout = self.context.settings.rollout
        last_round = rollout.max_assistant_turns - 1
        return [self.clone(ExecuteRound, round=last_round, shard=shard) for shard in range(rollout.shards)]

    def output(self):
        return self.target("trajectories.parquet")

    def run(self):
        context = self.context
        self.write(score_step(context.all_trajectories(), self.step, context.settings.data.keep_limit))


class BuildDatums(RunTask):
    def requires(self):
        return self.clone(ScoreTrajectories)

    def output(self):
        return self.target("datums.parquet")

    def run(self):
        scored = read_table(self.input().path, TRAJECTORIES)
        context = self.context
        self.write(
            datums_table(context.all_trajectories(), scored, self.step, context.settings.rollout.trainer_max_tokens)
        )


class TrainStep(RunTask):
    """One PPO update from the step's datums; its checkpoint is the policy the next step samples.
    Also writes the step's metrics.parquet and prints them as one line."""

    def requires(self):
        return [self.clone(BuildDatums)] + self.policy_task()

    def output(self):
        """The checkpoint's marker and the step's metrics: a run killed between the two trains the
        step again (deterministically) rather than leaving the metrics out."""
        return [self.target("checkpoint/_SUCCESS"), self.target("metrics.parquet")]

    def run(self):
        self.set_status_message("training one PPO step")
        context = self.context
        release_sampler_memory(context.run)  # the sampler sleeps while the step trains on the GPU
        training = train_stage(context.run, self.step)
        reclaim_sampler_memory(context.run)
        metrics = metrics_stage(context.folder, context.run.run_dir, self.step, training, context.sandbox)
        self.summary = f"{describe_metrics(training)}\n  {metrics}"


class ColdStartTask(RunTask):
    """A stage of the run's cold start, before step 0, in runs/<run>/sft/."""

    step = luigi.IntParameter(default=-1, significant=False, description="not used: the cold start precedes step 0")

    @property
    def context(self) -> RunContext:
        return context_for(current_settings(), -1, cold_start=True)


class SFTExamples(ColdStartTask):
    """The cold-start conversations rendered through the rollout's protocol: sft/examples.parquet."""

    def output(self):
        return self.target("examples.parquet")

    def run(self):
        table, skipped = sft_examples_stage(self.context.run, self.context.protocol)
        self.write(table)
        self.summary += f" ({skipped} conversations over the budgets or turn limits, left out)" if skipped else ""


class ColdStart(ColdStartTask):
    """Supervised fine-tuning on the SFT examples: sft/checkpoint/ (full weights; the policy RL
    starts from) and the loss of every step in sft/losses.parquet. Resumes from sft/progress/."""

    def requires(self):
        return SFTExamples()

    def output(self):
        return [self.target("checkpoint/_SUCCESS"), self.target("losses.parquet")]

    def run(self):
        losses = cold_start_stage(self.context.run, self.report_progress)
        write_table_atomically(losses_table(losses), self.output()[1].path)
        self.summary = describe_cold_start(losses)

    def report_progress(self, row: dict) -> None:
        steps = self.context.run.cold_start.steps
        line = f"cold start step {row['step'] + 1}/{steps}: loss {row['loss']:.3f}, {row['seconds']:.1f} s"
        self.set_status_message(line)
        print(line, flush=True)


class Evaluate(RunTask):
    """Average@N / Pass@N of checkpoint `step` (-1: the base model) on an eval set, in retool or
    text-only mode: summary.parquet in the evaluation's folder, and one printed line."""

    dataset = luigi.Parameter(default="data/synthetic_eval.jsonl", description="evaluation data file")
    n = luigi.IntParameter(default=4, description="samples per question")

    def requires(self):
        return self.clone(ScoreTrajectories)

    def output(self):
        return self.target("summary.parquet")

    def run(self):
        trajectories = read_table(self.input().path, TRAJECTORIES)
        summary = evaluate_stage(trajectories, self.context.evaluation, self.step, self.output().path)
        self.summary = f"{self.mode} on {self.dataset}: {describe_eval(summary)}"


class Report(RunTask):
    """Once training step `step` is done: plots and a Markdown summary of everything the run folder holds
    (later steps too, if any), under runs/<run>/report/step=NNNN/ (`python -m retool report runs/NAME` by hand)."""

    def requires(self):
        return TrainStep(step=self.step)

    def output(self):
        return luigi.LocalTarget(str(self.context.run.run_dir / "report" / f"step={self.step:04d}" / "report.md"))

    def run(self):
        self.summary = f"plots and summary of {self.step + 1} steps"
        make_report(self.context.run.run_dir, self.output().path.rsplit("/", 1)[0])


class BeforeAfter(RunTask):
    """Training through step `step`, then the base model, the cold-start checkpoint (if the run has
    one) and checkpoint `step` evaluated on the same held-out questions: a before/after table in the
    evaluations' folder, printed, and the run's report with the evaluations."""

    dataset = luigi.Parameter(default="data/synthetic_eval.jsonl", description="evaluation data file")
    n = luigi.IntParameter(default=4, description="samples per question")

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
        folder = self.evaluations()[-1][1].context.folder.parent
        return luigi.LocalTarget(str(folder / f"before_after-step={self.step:04d}.md"))

    def run(self):
        evaluations = [(label, task.context.folder) for label, task in self.evaluations()]
        run_dir = self.context.run.run_dir
        report = run_dir / "report" / f"step={self.step:04d}"
        trained = training_sources(self.context.run)
        self.summary = "\n" + before_after_stage(run_dir, evaluations, trained, self.output().path, report)
