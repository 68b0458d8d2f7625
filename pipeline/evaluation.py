"""The evaluation's tasks: a checkpoint scored on an eval set, the before/after table, and the run's report."""

from __future__ import annotations

from pathlib import Path

import luigi

from jobs.before_after import before_after
from jobs.evaluate import evaluate
from jobs.report import report
from pipeline.run_task import Choice, path
from pipeline.tasks import ScoreTrajectories, StepTask, TrainStep, page_files
from retool.evaluation.scores import EVAL_MODES
from retool.evaluation.spec import EvalSpec
from retool.files.layout import REPORT


class EvaluationTask(StepTask):
    """The parameters of an evaluation of checkpoint `step`: its data, samples per question, mode and sampling."""

    dataset = luigi.Parameter(default="data/synthetic_eval.jsonl", description="evaluation data file")
    n = luigi.IntParameter(default=4, description="samples per question")
    # Not `mode`: Luigi's first pass over the command line would read --mode as an abbreviation of --model-*.
    eval_mode = Choice("--eval-mode", choices=EVAL_MODES, default="retool", description="retool, or text-only: no tool")
    sft = luigi.BoolParameter(
        default=False, description="with --step -1: evaluate the cold-start checkpoint, not the base model"
    )
    limit = luigi.IntParameter(default=0, description="evaluate the data set's first N questions only (0: all)")
    temperature = luigi.OptionalFloatParameter(default=None, description="evaluation temperature (default: the run's)")
    top_p = luigi.OptionalFloatParameter(default=None, description="evaluation top_p (default: the run's)")

    def spec(self, sft: bool | None = None) -> EvalSpec:
        sft = self.sft if sft is None else sft
        return EvalSpec(self.dataset, self.n, self.eval_mode, sft, self.limit, self.temperature, self.top_p)

    @property
    def evaluation(self) -> EvalSpec:
        return self.spec()


class Evaluate(EvaluationTask):
    """Average@N / Pass@N of checkpoint `step` (-1: the base model) on an eval set, in retool or
    text-only mode: summary.parquet in the evaluation's folder, and one printed line."""

    def requires(self):
        return ScoreTrajectories(step=self.step, evaluation=self.spec())

    def output(self):
        return self.target(self.folder.summary)

    def run(self):
        self.summary = evaluate(path(self.input()), path(self.output()), self.settings, self.spec(), self.step)


class Report(StepTask):
    """Once training step `step` is done: plots and a Markdown summary of steps 0..step and the evaluations of
    their checkpoints, under runs/<run>/report/step=NNNN/ (`python -m retool report runs/NAME` by hand, of all)."""

    def requires(self):
        return {"steps": [TrainStep(step=step) for step in range(self.step + 1)], "page": self.page()}

    def output(self):
        return self.target(self.run_folder.report(self.step) / REPORT)

    def complete(self):
        """Built, and newer than every file it draws: a new evaluation of a checkpoint it shows rebuilds it."""
        report = Path(self.output().path)
        return report.exists() and not self.run_folder.changed_since(report, self.step)

    def run(self):
        page = page_files(self.input()["page"])
        self.summary = report(path(self.output()).parent, self.settings, self.step, page)


class BeforeAfter(EvaluationTask):
    """Training through step `step`, then the cold-start checkpoint (the base model in a run without one, or
    with --base) and checkpoint `step` evaluated on the same held-out questions: a before/after table in the
    evaluations' folder, printed, and the run's report with the evaluations."""

    # Not by default where there is a cold start: the base model has not learnt the answer's format and scores 0.
    base = luigi.BoolParameter(default=False, description="also evaluate the base model (always without a cold start)")

    def evaluations(self) -> list[tuple[str, Evaluate]]:
        cold_start = bool(self.settings.cold_start.data)
        policies = (
            ([("base", -1, False)] if self.base or not cold_start else [])
            + ([("SFT", -1, True)] if cold_start else [])
            + [(f"RL step {self.step}", self.step, False)]
        )
        return [(label, self.clone(Evaluate, step=step, sft=sft)) for label, step, sft in policies]

    @property
    def priority(self) -> int:
        """Below every evaluation it gathers, which would otherwise inherit its priority (see RunTask.priority)."""
        return -(2**62)

    def complete(self):
        """The table, with a row of every policy asked for (a table made without --base lacks the base model's)."""
        if not super().complete():
            return False
        table = Path(self.output().path).read_text()
        return all(f"| {label} |" in table for label, _ in self.evaluations())

    def requires(self):
        evaluations = [task for _, task in self.evaluations()]
        trajectories = [task.clone(ScoreTrajectories, evaluation=task.spec()) for task in evaluations]
        steps = [TrainStep(step=step) for step in range(self.step + 1)]  # the report's
        return {"evaluations": evaluations, "trajectories": trajectories, "steps": steps, "page": self.page()}

    def output(self):
        return self.target(self.run_folder.before_after(self.spec().name, self.step))

    def run(self):
        labels = [label for label, _ in self.evaluations()]
        evaluations = list(zip(labels, map(path, self.input()["trajectories"]), strict=True))
        out, report_folder = path(self.output()), self.run_folder.report(self.step)
        page = page_files(self.input()["page"])
        self.summary = before_after(evaluations, self.n, out, report_folder, self.settings, self.step, page)
