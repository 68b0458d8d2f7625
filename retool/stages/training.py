"""The training stages: the cold start (SFT examples, then supervised fine-tuning), and TrainStep (one
PPO step from a step's datums, in-process or under torchrun, then the checkpoint retention policy)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from retool.config.settings import RunSettings, SettingsError
from retool.data.conversations import read_conversations
from retool.files.layout import RunFolder
from retool.files.tables import DATUMS, SFT_EXAMPLES, TRAJECTORIES, read_table
from retool.protocol.chat import ChatProtocol
from retool.rollout.datums import datums_from_table
from retool.rollout.state import zero_variance_groups
from retool.run.context import rl_base_model
from retool.training.cold_start import sft_datums, sft_examples_table, train_cold_start
from retool.training.record import StepMetrics
from retool.weights.checkpoint import Checkpoint
from retool.weights.models import resolve_model


def sft_examples_stage(settings: RunSettings, protocol: ChatProtocol) -> tuple[pa.Table, int]:
    """The cold-start conversations rendered as SFT examples; how many did not fit the budgets."""
    path = settings.cold_start.data
    table, skipped = sft_examples_table(read_conversations(path), protocol, settings.rollout)
    if not table.num_rows:
        raise SettingsError(f"setting [cold_start] data = {path!r}: no conversation fits the run's budgets")
    return table, skipped


def cold_start_stage(settings: RunSettings, examples: Path, out: Path, progress: Path, on_step=None) -> list[dict]:
    """Supervised fine-tuning of the model setting on the SFT examples into checkpoint `out`; resumes from
    the resume point `progress` where it was stopped."""
    return train_cold_start(
        resolve_model(settings.model.name),
        sft_datums(read_table(examples, SFT_EXAMPLES)),
        settings.sft_trainer(),
        settings.cold_start,
        out,
        progress,
        settings.run.device,
        on_step,
    )


def train_stage(
    settings: RunSettings, step: int, datums: Path, trajectories: Path, previous: Path | None, out: Path
) -> StepMetrics:
    """One PPO step from the step's datums, over the checkpoint `previous` (None: the RL base model), into
    checkpoint `out`; then the retention policy over the run's checkpoints up to `step`."""
    from retool.training.checkpoints import prune_checkpoints  # torch: only once a step trains
    from retool.training.step import train_from_files

    kept = [row for row in read_table(trajectories, TRAJECTORIES).to_pylist() if row["kept"]]
    num_trajectories = len(kept)  # of the groups that train
    zero_variance = zero_variance_groups((row["question_index"], row["reward"]) for row in kept)
    base_model = rl_base_model(settings)
    if settings.run.train_processes == 1:
        metrics = train_from_files(
            base_model,
            datums_from_table(read_table(datums, DATUMS)),
            num_trajectories,
            previous,
            out,
            settings.trainer_on_device(),
            settings.run.device,
            zero_variance,
        )
    else:
        metrics = _train_under_torchrun(settings, base_model, datums, num_trajectories, zero_variance, previous, out)
    run = RunFolder(settings.run_dir)
    checkpoints = [(s, run.step(s).checkpoint) for s in range(step + 1)]
    prune_checkpoints(checkpoints, settings.run.keep_last, settings.run.keep_every)
    return metrics


def _train_under_torchrun(
    settings: RunSettings,
    base_model: Path,
    datums: Path,
    num_trajectories: int,
    zero_variance: int,
    previous: Path | None,
    out: Path,
) -> StepMetrics:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as config_file:
        json.dump(asdict(settings.trainer_on_device()), config_file)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(settings.run.train_processes),
        "-m",
        "retool.cli.train",
        "--base-model",
        str(base_model),
        "--datums",
        str(datums),
        "--trajectories",
        str(num_trajectories),
        "--zero-variance-groups",
        str(zero_variance),
        "--out",
        str(out),
        "--config",
        config_file.name,
        *(["--previous", str(previous)] if previous else []),
    ]
    try:
        subprocess.run(command, check=True)
    finally:
        Path(config_file.name).unlink()
    return StepMetrics(**json.loads(Checkpoint(out).metrics.read_text()))


def describe_metrics(metrics: StepMetrics) -> str:
    if metrics.skipped:
        return f"no datums ({metrics.zero_variance_groups} groups, all with equal rewards): update skipped"
    return (
        f"{metrics.datums} datums ({metrics.zero_variance_groups} zero-variance groups), {metrics.loss_tokens} loss "
        f"tokens, {metrics.micro_batches} micro-batches "
        f"({metrics.padded_tokens / max(metrics.tokens, 1):.2f} padded/real), loss {metrics.loss:+.4f}, grad norm "
        f"{metrics.grad_norm:.3f}, "
        f"clip {metrics.clip_fraction:.3f}, sampler gap {metrics.logprob_gap:.2e}, {metrics.tokens_per_second:.0f} "
        "tokens/s"
    )
