"""The TrainStep stage: one PPO step from a step's datums, in-process or under torchrun, then the
checkpoint retention policy."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from jobs.settings import RunSettings, resolve_model
from jobs.stages import datums_from_table
from jobs.tables import DATUMS, TRAJECTORIES, read_table
from jobs.trainer import StepMetrics, prune_checkpoints, train_from_files


def checkpoint_dir(settings: RunSettings, step: int) -> Path:
    return settings.run_dir / f"step={step:04d}" / "checkpoint"


def train_stage(settings: RunSettings, step: int, device: str) -> StepMetrics:
    folder = settings.run_dir / f"step={step:04d}"
    previous = checkpoint_dir(settings, step - 1) if step > 0 else None
    num_trajectories = read_table(folder / "trajectories.parquet", TRAJECTORIES).num_rows
    out = checkpoint_dir(settings, step)
    base_model = resolve_model(settings.model)
    if settings.train_processes == 1:
        datums = datums_from_table(read_table(folder / "datums.parquet", DATUMS))
        metrics = train_from_files(base_model, datums, num_trajectories, previous, out, settings.trainer_config(), device)
    else:
        metrics = _train_under_torchrun(settings, base_model, folder / "datums.parquet", num_trajectories, previous, out)
    prune_checkpoints([(s, checkpoint_dir(settings, s)) for s in range(step + 1)], settings.keep_last, settings.keep_every)
    return metrics


def _train_under_torchrun(settings: RunSettings, base_model: Path, datums: Path, num_trajectories: int, previous: Path | None, out: Path) -> StepMetrics:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as config_file:
        json.dump(asdict(settings.trainer_config()), config_file)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(settings.train_processes),
        "-m", "jobs.trainer", "--base-model", str(base_model), "--datums", str(datums), "--trajectories", str(num_trajectories),
        "--out", str(out), "--config", config_file.name, *(["--previous", str(previous)] if previous else []),
    ]
    try:
        subprocess.run(command, check=True)
    finally:
        Path(config_file.name).unlink()
    return StepMetrics(**json.loads((out / "metrics.json").read_text()))


def describe_metrics(metrics: StepMetrics) -> str:
    if metrics.skipped:
        return f"no datums (every group had equal rewards): update skipped, {metrics.trajectories} trajectories"
    return (
        f"{metrics.datums} datums, {metrics.loss_tokens} loss tokens, {metrics.micro_batches} micro-batches "
        f"({metrics.padded_tokens / max(metrics.tokens, 1):.2f} padded/real), loss {metrics.loss:+.4f}, grad norm {metrics.grad_norm:.3f}, "
        f"clip {metrics.clip_fraction:.3f}, sampler gap {metrics.logprob_gap:.2e}, {metrics.tokens_per_second:.0f} tokens/s"
    )
