"""The run folder: every file a run writes, named here once. Hive-style folder names (step=0003, shard=00,
round=01) let one glob read a kind of file across a run, with the folder names as columns:

    runs/<run>/config.json                              the settings that shape results, frozen by the first command
    runs/<run>/sft/examples.parquet, losses.parquet     the cold start: its examples, the loss of every step
    runs/<run>/sft/checkpoint/, progress/               its weights, and its last resume point
    runs/<run>/step=NNNN/prompts.parquet                a training step: its questions
    runs/<run>/step=NNNN/shard=SS/round=RR/samples.parquet, observations.parquet
    runs/<run>/step=NNNN/trajectories.parquet, datums.parquet, metrics.parquet, checkpoint/
    runs/<run>/eval/<data>-<hash>/<mode>-n<N>/step=NNNN|base|sft/...   an evaluation: the same files, summary.parquet
    runs/<run>/report/step=NNNN/                        plots and report.md
    runs/<run>/exported-sft.jsonl                       its correct rollouts as cold-start data (export-sft)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROMPTS_FILE = "prompts.parquet"
SAMPLES_FILE = "samples.parquet"
OBSERVATIONS_FILE = "observations.parquet"
TRAJECTORIES_FILE = "trajectories.parquet"
DATUMS_FILE = "datums.parquet"
SCORED_FILE = "scored.parquet"
METRICS_FILE = "metrics.parquet"
SUMMARY_FILE = "summary.parquet"
SFT_EXAMPLES_FILE = "examples.parquet"
SFT_LOSSES_FILE = "losses.parquet"
CHECKPOINT = "checkpoint"
REPORT = "report.md"  # beside the report's plots
VIEW = "trajectories.html"  # a step's trajectories as one page (python -m retool view), beside what it shows
TIMINGS = "_timings"  # per-stage wall times, one small JSON file per finished task
ROUNDS = "shard=*/round=*"  # every round folder of one step folder
STEPS = "step=*"  # every training step folder of a run


EVALUATED = "checkpoint=*"  # every checkpoint folder of one evaluation (step=* in runs made before)


def checkpoint_label(step: int, sft: bool = False) -> str:
    """An evaluated checkpoint's folder label, the `checkpoint` column of a hive-partitioned read: base, sft (step
    -1: the base model, or the cold start's checkpoint) or stepNNNN."""
    return ("sft" if sft else "base") if step < 0 else f"step{step:04d}"


def _step_of(path: Path) -> int:
    """The training step of a file under a step=NNNN or checkpoint=stepNNNN folder (-1 under base or sft)."""
    part = next(part for part in reversed(path.parts) if part.startswith(("step=", "checkpoint=")))
    label = part.partition("=")[2].removeprefix("step")
    return int(label) if label.isdigit() else -1


@dataclass(frozen=True)
class RoundPaths:
    samples: Path  # a round's samples.parquet
    observations: Path  # its observations.parquet


@dataclass(frozen=True)
class StepFolder:
    """The files of one step: a training step, an evaluation of one checkpoint, or the cold start."""

    path: Path

    def round(self, shard: int, round_index: int) -> Path:
        return self.path / f"shard={shard:02d}" / f"round={round_index:02d}"

    def samples(self, shard: int, round_index: int) -> Path:
        return self.round(shard, round_index) / SAMPLES_FILE

    def observations(self, shard: int, round_index: int) -> Path:
        return self.round(shard, round_index) / OBSERVATIONS_FILE

    def scored(self, shard: int) -> Path:
        """One shard's trajectories scored, every group kept (which groups train is the step's trajectories')."""
        return self.path / f"shard={shard:02d}" / SCORED_FILE

    def shard_datums(self, shard: int) -> Path:
        """One shard's rows of the step's datums."""
        return self.path / f"shard={shard:02d}" / DATUMS_FILE

    def rounds(self, shard: int, count: int) -> list[RoundPaths]:
        """The first `count` rounds of one shard."""
        return [RoundPaths(self.samples(shard, r), self.observations(shard, r)) for r in range(count)]

    def round_folders(self) -> list[Path]:
        """Every round folder of every shard found on disk, in order."""
        return sorted(self.path.glob(ROUNDS))

    def all_observations(self) -> list[Path]:
        return sorted(self.path.glob(f"{ROUNDS}/{OBSERVATIONS_FILE}"))

    @property
    def prompts(self) -> Path:
        return self.path / PROMPTS_FILE

    @property
    def trajectories(self) -> Path:
        return self.path / TRAJECTORIES_FILE

    @property
    def datums(self) -> Path:
        return self.path / DATUMS_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def timings(self) -> Path:
        return self.path / TIMINGS

    @property
    def sft_examples(self) -> Path:
        return self.path / SFT_EXAMPLES_FILE

    @property
    def sft_losses(self) -> Path:
        return self.path / SFT_LOSSES_FILE

    @property
    def sft_progress(self) -> Path:
        """The cold start's last resume point, a checkpoint of its own."""
        return self.path / "progress"


@dataclass(frozen=True)
class RunFolder:
    """runs/<run>: the run's settings, its steps, the cold start, evaluations and reports."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def server_record(self) -> Path:
        """The address of the run's vLLM server, for every command that samples through it."""
        return self.path / "sampler-server.json"

    @property
    def trainer_group(self) -> Path:
        """The resident training group's record, log and the step it is handed (retool/training/group.py)."""
        return self.path / "trainer"

    @property
    def server_log(self) -> Path:
        return self.path / "sampler-server.log"

    @property
    def engine_log(self) -> Path:
        """vLLM's own log lines, of every command of the run that samples in-process (RETOOL_DEBUG=1: the terminal)."""
        return self.path / "sampler-engine.log"

    @property
    def warnings_log(self) -> Path:
        """The libraries' Python warnings (FutureWarning and the like) of every command (RETOOL_DEBUG=1: on screen)."""
        return self.path / "warnings.log"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def tracking_record(self) -> Path:
        """The id of the run's experiment-tracker run, drawn by its first command ([run] tracker)."""
        return self.path / "tracking.json"

    def step(self, step: int) -> StepFolder:
        return StepFolder(self.path / f"step={step:04d}")

    @property
    def sft(self) -> StepFolder:
        return StepFolder(self.path / "sft")

    def evaluations(self, name: str) -> Path:
        """The folder of one evaluation (data set and sampling): one step folder per checkpoint it scored."""
        return self.path / "eval" / name

    def evaluation(self, name: str, step: int, sft: bool = False) -> StepFolder:
        """Evaluation `name` of checkpoint `step`; step -1: the base model, or (sft) the cold start's. Folders named
        checkpoint=<label>, so that one glob with hive partitioning reads every checkpoint's files apart."""
        return StepFolder(self.evaluations(name) / f"checkpoint={checkpoint_label(step, sft)}")

    def before_after(self, name: str, step: int) -> Path:
        return self.evaluations(name) / f"before_after-step={step:04d}.md"

    def before_after_tables(self) -> list[tuple[int, Path]]:
        """Every before/after table of the run, with the RL step it compares."""
        return [(int(path.stem.rpartition("=")[2]), path) for path in self.glob("eval/*/*/before_after-step=*.md")]

    def report(self, step: int | None = None) -> Path:
        """The folder of the report made after training step `step`; None: the one `python -m retool report`
        makes."""
        return self.path / "report" / (f"step={step:04d}" if step is not None else "")

    def glob(self, pattern: str) -> list[Path]:
        return sorted(self.path.glob(pattern))

    def step_files(self, name: str) -> list[Path]:
        """One kind of file of every training step: step_files(TRAJECTORIES_FILE)."""
        return self.glob(f"{STEPS}/{name}")

    def changed_since(self, made: Path, step: int) -> list[Path]:
        """The files a report of steps up to `step` draws (step metrics and trajectories, rounds, evaluation
        summaries) that were written after `made`."""
        since = made.stat().st_mtime_ns
        files = [
            *self.step_files(METRICS_FILE),
            *self.step_files(TRAJECTORIES_FILE),
            *self.round_files(OBSERVATIONS_FILE),
        ]
        files += self.evaluation_files(SUMMARY_FILE)
        return [path for path in files if _step_of(path) <= step and path.stat().st_mtime_ns > since]

    def steps_with(self, name: str) -> list[int]:
        """The training steps that have written one kind of file: steps_with(TRAJECTORIES_FILE)."""
        return [_step_of(path) for path in self.step_files(name)]

    @property
    def exported_sft(self) -> Path:
        """Where `python -m retool export-sft` writes the run's correct rollouts by default."""
        return self.path / "exported-sft.jsonl"

    def round_files(self, name: str) -> list[Path]:
        """One kind of round file of every training step: round_files(OBSERVATIONS_FILE)."""
        return self.glob(f"{STEPS}/{ROUNDS}/{name}")

    def evaluation_files(self, name: str) -> list[Path]:
        """One kind of file of every evaluation of every checkpoint: evaluation_files(SUMMARY_FILE)."""
        return self.glob(f"eval/*/*/{EVALUATED}/{name}") + self.glob(f"eval/*/*/step=*/{name}")  # and runs before
