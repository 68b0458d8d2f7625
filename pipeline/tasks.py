"""Rollout stages as Luigi tasks. Each run() reads its inputs, calls one function of jobs.stages and
writes its output atomically; the rules live in jobs/."""

from __future__ import annotations

import luigi

from jobs.data import read_examples, shuffled, take_batch
from jobs.runtime import prepare_run, protocol_for, read_round_files, sandbox_for
from jobs.engines import get_sampler
from jobs.stages import datums_table, describe, execute_round, prompts_table, replay, sample_round, score_step
from jobs.training import checkpoint_dir, describe_metrics, train_stage
from jobs.tables import PROMPTS, SAMPLES, TRAJECTORIES, read_table, write_table_atomically
from pipeline.config import current_settings


class RunTask(luigi.Task):
    """A stage of one training step of one run: knows the run folder and refuses mixed settings."""

    step = luigi.IntParameter()

    @property
    def settings(self):
        return current_settings()

    def step_target(self, relative: str) -> luigi.LocalTarget:
        return luigi.LocalTarget(str(self.settings.run_dir / f"step={self.step:04d}" / relative))

    def complete(self) -> bool:
        """Complete only when the output exists and every input of the same step is complete too, so
        deleting one stage's output re-runs that stage and everything downstream of it. The policy
        of the step before counts by its own marker (no walk back through every earlier step)."""
        prepare_run(self.settings)  # validates the machine and freezes or checks config.json
        inputs = luigi.task.flatten(self.requires())
        return super().complete() and all(t.complete() if t.step == self.step else t.output().exists() for t in inputs)

    def write(self, table) -> None:
        write_table_atomically(table, self.output().path)  # replaces a stale output in one rename
        self.summary = describe(table)

    def state(self, shard: int, rounds: int):
        """The shard's trajectories after `rounds` complete rounds, rebuilt from the files."""
        prompts = read_table(Prompts(step=self.step).output().path, PROMPTS)
        files = read_round_files(self.settings, self.step, shard, rounds)
        settings = self.settings
        return replay(prompts, files, protocol_for(settings), settings.rollout_config(), shard, settings.shards)


@RunTask.event_handler(luigi.Event.PROCESSING_TIME)
def _print_summary(task: RunTask, seconds: float) -> None:
    """One line per finished stage: what it wrote, how long it took, and where."""
    print(f"{task}: {getattr(task, 'summary', '')}, {seconds:.1f} s -> {task.output().path}", flush=True)


class Prompts(RunTask):
    def output(self):
        return self.step_target("prompts.parquet")

    def run(self):
        settings = self.settings
        examples = take_batch(shuffled(read_examples(settings.train_data), settings.data_seed), self.step, settings.questions_per_step)
        self.write(prompts_table(examples, protocol_for(settings), self.step))


class SampleRound(RunTask):
    round = luigi.IntParameter()
    shard = luigi.IntParameter(default=0)

    def requires(self):
        state = Prompts(step=self.step) if self.round == 0 else ExecuteRound(step=self.step, round=self.round - 1, shard=self.shard)
        return [state, TrainStep(step=self.step - 1)] if self.step > 0 else [state]

    def output(self):
        return self.step_target(f"shard={self.shard:02d}/round={self.round:02d}/samples.parquet")

    def run(self):
        settings = self.settings
        trajectories = self.state(self.shard, self.round)
        policy = checkpoint_dir(settings, self.step - 1) if self.step > 0 else None
        self.write(sample_round(trajectories, lambda: get_sampler(settings, policy), protocol_for(settings), settings.rollout_config(), self.step, self.round))


class ExecuteRound(RunTask):
    round = luigi.IntParameter()
    shard = luigi.IntParameter(default=0)

    def requires(self):
        return SampleRound(step=self.step, round=self.round, shard=self.shard)

    def output(self):
        return self.step_target(f"shard={self.shard:02d}/round={self.round:02d}/observations.parquet")

    def run(self):
        settings = self.settings
        trajectories = self.state(self.shard, self.round)
        samples = read_table(self.input().path, SAMPLES)
        self.write(execute_round(trajectories, samples, sandbox_for(settings), protocol_for(settings), settings.rollout_config(), self.step, self.round))


class ScoreTrajectories(RunTask):
    def requires(self):
        last_round = self.settings.max_assistant_turns - 1
        return [ExecuteRound(step=self.step, round=last_round, shard=shard) for shard in range(self.settings.shards)]

    def output(self):
        return self.step_target("trajectories.parquet")

    def run(self):
        settings = self.settings
        trajectories = [t for shard in range(settings.shards) for t in self.state(shard, settings.max_assistant_turns)]
        self.write(score_step(trajectories, self.step))


class BuildDatums(RunTask):
    def requires(self):
        return ScoreTrajectories(step=self.step)

    def output(self):
        return self.step_target("datums.parquet")

    def run(self):
        settings = self.settings
        trajectories = [t for shard in range(settings.shards) for t in self.state(shard, settings.max_assistant_turns)]
        scored = read_table(self.input().path, TRAJECTORIES)
        self.write(datums_table(trajectories, scored, self.step, settings.trainer_max_tokens))


class TrainStep(RunTask):
    """One PPO update from the step's datums; its checkpoint is the policy the next step samples."""

    def requires(self):
        return [BuildDatums(step=self.step)] + ([TrainStep(step=self.step - 1)] if self.step > 0 else [])

    def output(self):
        return self.step_target("checkpoint/_SUCCESS")

    def run(self):
        metrics = train_stage(self.settings, self.step, self.settings.device)
        self.summary = describe_metrics(metrics)
