"""The pipeline's stages as Luigi tasks: each says what it needs (`requires()`: every file its job reads) and
what it makes (`output()`), and its `run()` passes those paths to its job in `jobs/`, where the work is done."""

from __future__ import annotations

from pathlib import Path

import luigi

from jobs.before_after import before_after
from jobs.build_datums import build_datums
from jobs.cold_start import cold_start
from jobs.evaluate import evaluate
from jobs.execute_round import execute_round
from jobs.prompts import prompts
from jobs.report import report
from jobs.sample_round import sample_round
from jobs.score_trajectories import score_trajectories
from jobs.sft_examples import sft_examples
from jobs.train_step import train_step
from pipeline.config import EvalSpecParameter, current_settings
from pipeline.inputs import checkpoint_of, path, round_paths
from pipeline.outcome import note_end, note_failure, note_start, watch_if_named_on_the_command_line
from retool.evaluation.metrics import record_stage_seconds
from retool.evaluation.scores import EVAL_MODES
from retool.evaluation.spec import EvalSpec
from retool.files.layout import REPORT
from retool.files.tables import parquet_seconds
from retool.run.context import RunContext, context_for, open_run
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
        """Complete only when the output exists and so does every input's of the same step and namespace, however
        far upstream, so deleting one stage's output re-runs it and everything downstream. Other steps (the
        policy) count by their own output: no walk back through every earlier step. Each task is visited once."""
        if not super().complete():
            return False
        folder, seen, waiting = self.context.folder, set(), luigi.task.flatten(self.requires())
        while waiting:
            task = waiting.pop()
            if task.task_id in seen:
                continue
            seen.add(task.task_id)
            if not all(output.exists() for output in luigi.task.flatten(task.output())):
                return False
            if task.context.folder == folder:
                waiting += luigi.task.flatten(task.requires())
        return True

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

    def policy(self) -> dict[str, luigi.Task]:
        """{"policy": the task that makes the checkpoint this task's rollout samples from}; {} for the model
        setting."""
        checkpoint = self.context.policy_checkpoint
        if checkpoint is None:
            return {}
        if checkpoint.path == self.context.run_folder.sft.checkpoint:
            return {"policy": ColdStart()}
        evaluating = self.context.evaluation is not None  # an evaluation scores checkpoint `step` itself
        return {"policy": TrainStep(step=self.step if evaluating else self.step - 1), **self.rl_base()}

    def rl_base(self) -> dict[str, luigi.Task]:
        """{"rl_base": the cold start} when RL starts from its weights, which a LoRA checkpoint applies to."""
        return {"rl_base": ColdStart()} if self.context.settings.cold_start.data else {}

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
        rollout = self.context.rollout
        return [self.rounds(shard, rollout.max_assistant_turns) for shard in range(rollout.shards)]


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
        self.summary = prompts(path(self.output()), self.context.settings, self.step, self.evaluation)


class SampleRound(RolloutTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        return {"prompts": self.clone(Prompts), "rounds": self.rounds(self.shard, self.round), **self.policy()}

    def output(self):
        return self.target(self.context.folder.samples(self.shard, self.round))

    def run(self):
        inputs, run = self.input(), self.context.settings
        self.summary = sample_round(
            path(inputs["prompts"]), round_paths(inputs["rounds"]), checkpoint_of(inputs), path(self.output()),
            run, self.step, self.shard, self.round, self.evaluation, self.set_status_message,
        )  # fmt: skip


class ExecuteRound(RolloutTask):
    round = luigi.IntParameter(description="round of the rollout: the assistant turn, from 0")
    shard = luigi.IntParameter(default=0, description="shard of the questions, from 0 ([rollout] shards)")

    def requires(self):
        rounds = self.rounds(self.shard, self.round)
        return {"prompts": self.clone(Prompts), "rounds": rounds, "samples": self.clone(SampleRound)}

    def output(self):
        return self.target(self.context.folder.observations(self.shard, self.round))

    def run(self):
        inputs, run = self.input(), self.context.settings
        self.summary = execute_round(
            path(inputs["prompts"]), round_paths(inputs["rounds"]), path(inputs["samples"]), path(self.output()),
            run, self.step, self.shard, self.round, self.evaluation, self.set_status_message,
        )  # fmt: skip


class ScoreTrajectories(RolloutTask):
    def requires(self):
        return {"prompts": self.clone(Prompts), "shards": self.all_rounds()}

    def output(self):
        return self.target(self.context.folder.trajectories)

    def run(self):
        inputs = self.input()
        shards = [round_paths(rounds) for rounds in inputs["shards"]]
        self.summary = score_trajectories(
            path(inputs["prompts"]), shards, path(self.output()), self.context.settings, self.step, self.evaluation
        )


class BuildDatums(RunTask):
    def requires(self):
        return {
            "prompts": self.clone(Prompts),
            "shards": self.all_rounds(),
            "trajectories": self.clone(ScoreTrajectories),
        }

    def output(self):
        return self.target(self.context.folder.datums)

    def run(self):
        inputs = self.input()
        shards = [round_paths(rounds) for rounds in inputs["shards"]]
        self.summary = build_datums(
            path(inputs["prompts"]),
            shards,
            path(inputs["trajectories"]),
            path(self.output()),
            self.context.settings,
            self.step,
        )


class TrainStep(RunTask):
    """One PPO update from the step's datums; its checkpoint is the policy the next step samples.
    Also writes the step's metrics.parquet and prints them as one line."""

    def requires(self):
        observations = [r["observations"] for rounds in self.all_rounds() for r in rounds]
        step = {"datums": self.clone(BuildDatums), "trajectories": self.clone(ScoreTrajectories)}
        return {**step, "observations": observations, **self.policy()}

    def output(self):
        """The checkpoint's marker and the step's metrics: a run killed between the two trains the
        step again (deterministically) rather than leaving the metrics out."""
        folder = self.context.folder
        return {"checkpoint": self.target(Checkpoint(folder.checkpoint).marker), "metrics": self.target(folder.metrics)}

    def run(self):
        self.set_status_message("training one PPO step")
        inputs, outputs = self.input(), self.output()
        self.summary = train_step(
            path(inputs["datums"]), path(inputs["trajectories"]), [path(t) for t in inputs["observations"]],
            checkpoint_of(inputs), path(outputs["checkpoint"]).parent, path(outputs["metrics"]),
            self.context.folder.timings, self.context.settings, self.step,
        )  # fmt: skip


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
        self.summary = sft_examples(path(self.output()), self.context.settings)


class ColdStart(ColdStartTask):
    """Supervised fine-tuning on the SFT examples: sft/checkpoint/ (full weights; the policy RL
    starts from) and the loss of every step in sft/losses.parquet. Resumes from sft/progress/."""

    def requires(self):
        return {"examples": SFTExamples()}

    def output(self):
        folder = self.context.folder
        return {
            "checkpoint": self.target(Checkpoint(folder.checkpoint).marker),
            "losses": self.target(folder.sft_losses),
        }

    def run(self):
        outputs, progress = self.output(), self.context.folder.sft_progress  # progress: its own resume point
        self.summary = cold_start(
            path(self.input()["examples"]), path(outputs["checkpoint"]).parent, path(outputs["losses"]), progress,
            self.context.settings, self.report_progress,
        )  # fmt: skip

    def report_progress(self, row: dict) -> None:
        steps = self.context.settings.cold_start.steps
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
        self.summary = evaluate(path(self.input()), path(self.output()), self.context.settings, self.spec(), self.step)


class Report(RunTask):
    """Once training step `step` is done: plots and a Markdown summary of steps 0..step and the evaluations of
    their checkpoints, under runs/<run>/report/step=NNNN/ (`python -m retool report runs/NAME` by hand, of all)."""

    def requires(self):
        return {"steps": [TrainStep(step=step) for step in range(self.step + 1)]}

    def output(self):
        return self.target(self.context.run_folder.report(self.step) / REPORT)

    def complete(self):
        """Built, and newer than every file it draws: a new evaluation of a checkpoint it shows rebuilds it."""
        report = Path(self.output().path)
        return report.exists() and not self.context.run_folder.changed_since(report, self.step)

    def run(self):
        self.summary = report(path(self.output()).parent, self.context.settings, self.step)


class BeforeAfter(EvaluationTask):
    """Training through step `step`, then the base model, the cold-start checkpoint (if the run has
    one) and checkpoint `step` evaluated on the same held-out questions: a before/after table in the
    evaluations' folder, printed, and the run's report with the evaluations."""

    def evaluations(self) -> list[tuple[str, Evaluate]]:
        policies = (
            [("base", -1, False)]
            + ([("SFT", -1, True)] if self.context.settings.cold_start.data else [])
            + [(f"RL step {self.step}", self.step, False)]
        )
        return [(label, self.clone(Evaluate, step=step, sft=sft)) for label, step, sft in policies]

    def requires(self):
        evaluations = [task for _, task in self.evaluations()]
        trajectories = [task.clone(ScoreTrajectories, evaluation=task.spec()) for task in evaluations]
        steps = [TrainStep(step=step) for step in range(self.step + 1)]  # the report's
        return {"evaluations": evaluations, "trajectories": trajectories, "steps": steps}

    def output(self):
        return self.target(self.context.run_folder.before_after(self.spec().name, self.step))

    def run(self):
        labels = [label for label, _ in self.evaluations()]
        evaluations = list(zip(labels, map(path, self.input()["trajectories"]), strict=True))
        out, report_folder = path(self.output()), self.context.run_folder.report(self.step)
        self.summary = before_after(evaluations, self.n, out, report_folder, self.context.settings, self.step)
