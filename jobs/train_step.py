"""TrainStep: one PPO update from the step's datums -> checkpoint/ (the policy the next step samples), then the
step's metrics -> metrics.parquet. Also the torchrun worker: `torchrun --nproc-per-node K -m jobs.train_step
--inputs FILE` trains the step on K processes (one per GPU), each reading the same StepInputs."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from retool.config.sampler import engine_dtype
from retool.config.settings import RunSettings
from retool.config.trainer import saves_in_full
from retool.evaluation.metrics import ROLLOUT_STAGES, TRAINING_STAGE, describe_step, stage_seconds, step_metrics
from retool.evaluation.tracking import Tracker, scalars
from retool.files.layout import RunFolder
from retool.files.tables import OBSERVATIONS, TRAJECTORIES, read_table, write_table_atomically
from retool.rollout.scoring import zero_variance_groups
from retool.run.shared import sandbox_for
from retool.sampling.engines import reclaim_sampler_memory, release_sampler_memory, sampler_kind
from retool.training.record import StepMetrics, describe_metrics
from retool.weights.checkpoint import Checkpoint
from retool.weights.models import rl_base


def train_step(
    datums: Path,
    trajectories: Path,
    observations: Sequence[Path],
    previous: Path | None,
    cold_start: Path | None,
    checkpoint: Path,
    metrics: Path,
    timings: Path,
    run: RunSettings,
    step: int,
) -> str:
    """`previous`: the step before's checkpoint, which the update starts from (None: step 0, from the RL base:
    the cold start's checkpoint `cold_start`, or the model setting); `observations`: every round's, and
    `timings`: the rollout stages' wall times, for the metrics."""
    from retool.training.checkpoints import prune_checkpoints  # torch: only once a step trains
    from retool.training.resume import StepInputs

    # The trainer stays in this process between steps when Luigi runs the tasks here (one worker) and one process
    # trains; only then may a step skip the full save, which the held state makes at the end of the command.
    resident = run.run.train_processes == 1 and multiprocessing.parent_process() is None
    full_save = not resident or saves_in_full(step, run.trainer.save_every)
    kept = [row for row in read_table(trajectories, TRAJECTORIES).to_pylist() if row["kept"]]
    inputs = StepInputs(
        base_model=rl_base(cold_start, run.model.name),
        datums=datums,
        num_trajectories=len(kept),  # of the groups that train
        zero_variance_groups=zero_variance_groups((row["question_index"], row["reward"]) for row in kept),
        previous=previous,
        out=checkpoint,
        config=run.trainer_on_device(),
        served_in="" if full_save else engine_dtype(run.sampler, run.run.device),
    )
    release_sampler_memory(run)  # the sampler sleeps while the step trains on the GPU
    if run.run.train_processes > 1:
        training = _train(inputs, run)
    else:
        training = _train_here(inputs, run.run.device, held_on(run) if resident else "")
    reclaim_sampler_memory(run)
    # Old checkpoints' weights go once this one is written (metrics and markers stay).
    folder = RunFolder(run.run_dir)
    prune_checkpoints([(s, folder.step(s).checkpoint) for s in range(step + 1)], run.run.keep_last, run.run.keep_every)
    line = write_metrics(trajectories, observations, timings, training, metrics, run, step)
    return f"{describe_metrics(training)}\n  {line}"


def _train_here(inputs, device: str, hold_on: str) -> StepMetrics:
    from retool.training.resume import train_from_files

    return train_from_files(inputs, device, hold_on)


def held_on(run: RunSettings) -> str:
    """Where the trainer waits between steps: the host while an engine in this process samples on the same GPU."""
    colocated = run.run.device == "cuda" and sampler_kind(run) in ("vllm", "hf")
    return "cpu" if colocated else run.run.device


def _train(inputs, run: RunSettings) -> StepMetrics:
    """Under torchrun, one process per GPU; rank 0 writes the checkpoint and its metrics."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        file.write(inputs.to_json())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += [str(run.run.train_processes), "-m", "jobs.train_step", "--inputs", file.name]
    try:
        subprocess.run(command, check=True)
    finally:
        Path(file.name).unlink()
    return StepMetrics(**json.loads(Checkpoint(inputs.out).metrics.read_text()))


def write_metrics(
    trajectories: Path,
    observations: Sequence[Path],
    timings: Path,
    training: StepMetrics,
    out: Path,
    run: RunSettings,
    step: int,
) -> str:
    """The step's metrics.parquet (its scalars also to the run's tracker), with the wall time of each stage;
    returns its line."""
    seconds = stage_seconds(timings)
    metrics = step_metrics(
        step,
        read_table(trajectories, TRAJECTORIES),
        pa.concat_tables([read_table(path, OBSERVATIONS) for path in observations]),
        training,
        {**{stage: seconds.get(stage, 0.0) for stage in ROLLOUT_STAGES}, TRAINING_STAGE: training.seconds},
    )
    metrics["sandbox_containment"] = sandbox_for(run.sandbox).containment.describe()
    write_table_atomically(pa.Table.from_pylist([metrics]), out)
    Tracker(run.run.tracker, RunFolder(run.run_dir), run.run.name).log(step, scalars(metrics))
    return describe_step(metrics)


def main() -> None:
    """One torchrun process: binds its GPU, joins the process group (NCCL, or gloo on a CPU) and trains."""
    import torch
    import torch.distributed as dist

    from retool.training.resume import StepInputs, train_from_files

    parser = argparse.ArgumentParser(prog="torchrun ... -m jobs.train_step", description="One PPO step's process.")
    parser.add_argument("--inputs", type=Path, required=True, help="a StepInputs as JSON")
    inputs = StepInputs.from_json(parser.parse_args().inputs.read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "WORLD_SIZE" in os.environ:
        if device == "cuda":  # before the process group, so that NCCL binds each rank to its own GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    train_from_files(inputs, device)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
