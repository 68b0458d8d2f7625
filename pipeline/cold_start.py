"""The cold start's tasks: the SFT examples and the supervised fine-tuning RL starts from, in runs/<run>/sft/."""

from __future__ import annotations

import luigi

from jobs.cold_start import cold_start
from jobs.sft_examples import sft_examples
from pipeline.run_task import RunTask, path
from retool.files.layout import StepFolder
from retool.weights.checkpoint import Checkpoint


class ColdStartTask(RunTask):
    """A stage of the run's cold start, before step 0, in runs/<run>/sft/."""

    step = luigi.IntParameter(default=-1, significant=False, description="not used: the cold start precedes step 0")

    @property
    def folder(self) -> StepFolder:
        return self.run_folder.sft


class SFTExamples(ColdStartTask):
    """The cold-start conversations rendered through the rollout's protocol: sft/examples.parquet."""

    def output(self):
        return self.target(self.folder.sft_examples)

    def run(self):
        self.summary = sft_examples(path(self.output()), self.settings)


class ColdStart(ColdStartTask):
    """Supervised fine-tuning on the SFT examples: sft/checkpoint/ (full weights; the policy RL
    starts from) and the loss of every step in sft/losses.parquet. Resumes from sft/progress/."""

    def requires(self):
        return {"examples": SFTExamples()}

    def output(self):
        folder = self.folder
        return {
            "checkpoint": self.target(Checkpoint(folder.checkpoint).marker),
            "losses": self.target(folder.sft_losses),
        }

    def run(self):
        outputs, progress = self.output(), self.folder.sft_progress  # progress: its own resume point
        self.summary = cold_start(
            path(self.input()["examples"]), path(outputs["checkpoint"]).parent, path(outputs["losses"]), progress,
            self.settings, self.report_progress,
        )  # fmt: skip

    def report_progress(self, row: dict) -> None:
        steps = self.settings.cold_start.steps
        line = f"cold start step {row['step'] + 1}/{steps}: loss {row['loss']:.3f}, {row['seconds']:.1f} s"
        self.set_status_message(line)
        print(line, flush=True)
