"""TrainStep: one PPO update from the step's datums -> checkpoint/ (the policy the next step samples), then the
step's metrics -> metrics.parquet. Also the torchrun worker: `torchrun --nproc-per-node K -m jobs.train_step
--inputs FILE` trains the step on K processes (one per GPU), each reading the same StepInputs."""

from __future__ import annotations

import argparse
import multiprocessing
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import pyarrow as pa

from retool.config.sampler import engine_dtype
from retool.config.settings import RunSettings
from retool.config.trainer import saves_in_full
from retool.evaluation.metrics import (
    METRICS_COLUMNS,
    ROLLOUT_STAGES,
    TRAINING_STAGE,
    describe_step,
    stage_seconds,
    step_metrics,
)
from retool.evaluation.tracking import Tracker, scalars
from retool.files.layout import RunFolder
from retool.files.tables import OBSERVATIONS, TRAJECTORIES, read_table, write_table_atomically
from retool.rollout.scoring import zero_variance_groups
from retool.run.shared import policy_step, sandbox_for
from retool.sampling.engines import reclaim_sampler_memory, release_sampler_memory, sampler_kind
from retool.training.record import StepMetrics, describe_metrics
from retool.weights.models import rl_base


def train_step(
    datums: Path,
    trajectories: Path,
    observations: Sequence[Path],
    previous: Path | None,
    cold_start: Path | None,
    sampled_by: Path | None,
    checkpoint: Path,
    metrics: Path,
    timings: Path,
    run: RunSettings,
    step: int,
) -> str:
    """`previous`: the step before's checkpoint, which the update starts from (None: step 0, from the RL base:
    the cold start's checkpoint `cold_start`, or the model setting); `sampled_by`: the checkpoint of the older step
    that sampled it, when it trains [rollout] max_staleness steps behind; `observations`: every round's, and
    `timings`: the rollout stages' wall times, for the metrics."""
    from retool.training.checkpoints import prune_checkpoints  # torch: only once a step trains
    from retool.training.resume import StepInputs

    # The trainer stays between steps in this process (one training process, Luigi running the tasks here) or in
    # the command's training group (several); only then may a step skip the full save, which the held state makes
    # at the end of the command.
    in_group = run.run.train_processes > 1
    resident = in_group or multiprocessing.parent_process() is None
    full_save = not resident or saves_in_full(step, run.trainer.save_every)
    kept = [row for row in read_table(trajectories, TRAJECTORIES).to_pylist() if row["kept"] and not row["masked"]]
    base = rl_base(cold_start, run.model.name)
    inputs = StepInputs(
        base_model=base,
        datums=datums,
        num_trajectories=len(kept),  # of the groups that train
        zero_variance_groups=zero_variance_groups((row["question_index"], trained_reward(row)) for row in kept),
        previous=previous,
        out=checkpoint,
        config=run.trainer_on_device(),
        served_in="" if full_save else engine_dtype(run.sampler, run.run.device),
        behaviour=older_policy(run, step, sampled_by, base),
    )
    release_sampler_memory(run)  # the sampler sleeps while the step trains on the GPU
    if in_group:
        training = _train_in_group(inputs, run)
    else:
        training = _train_here(inputs, run.run.device, held_on(run) if resident else "")
    reclaim_sampler_memory(run)
    # Old checkpoints' weights go once this one is written (metrics and markers stay).
    folder = RunFolder(run.run_dir)
    prune_checkpoints([(s, folder.step(s).checkpoint) for s in range(step + 1)], run.run.keep_last, run.run.keep_every)
    line = write_metrics(trajectories, observations, timings, training, metrics, run, step)
    return f"{describe_metrics(training)}\n  {line}"


def trained_reward(row: dict) -> float:
    """The reward a trajectory's advantage was computed from (files written before shaping: correctness)."""
    return row["reward"] if row["shaped_reward"] is None else row["shaped_reward"]


def older_policy(run: RunSettings, step: int, sampled_by: Path | None, base: Path) -> Path | None:
    """The policy that sampled the step if older than the checkpoint it trains from ([rollout] max_staleness): the
    older step's checkpoint `sampled_by`, or `base`; None: on-policy."""
    source = policy_step(run, step)
    if source == step - 1:
        return None
    return sampled_by if source >= 0 else base


def _train_here(inputs, device: str, hold_on: str) -> StepMetrics:
    from retool.training.resume import train_from_files

    return train_from_files(inputs, device, hold_on)


def held_on(run: RunSettings) -> str:
    """Where the trainer waits between steps: the host while a sampler uses the same GPUs (an engine in this
    process, or servers that sleep while a step trains: colocated); the GPU when the servers have their own."""
    in_process = sampler_kind(run) in ("vllm", "hf")
    colocated = in_process or (sampler_kind(run) == "vllm-server" and run.sampler.sleep_while_training)
    return "cpu" if run.run.device == "cuda" and colocated else run.run.device


def _train_in_group(inputs, run: RunSettings) -> StepMetrics:
    """The command's training group (one process per GPU, started at its first step) trains the step."""
    from retool.training.group import group_for, train_in_group

    folder = RunFolder(run.run_dir).trainer_group
    command = multiprocessing.parent_process()  # Luigi's worker processes are the command's children
    pid = group_for(folder, run.run.train_processes, held_on(run), command.pid if command else os.getpid())
    return train_in_group(folder, pid, inputs)


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
        pa.concat_tables([read_table(path, OBSERVATIONS, METRICS_COLUMNS) for path in observations]),
        training,
        {**{stage: seconds.get(stage, 0.0) for stage in ROLLOUT_STAGES}, TRAINING_STAGE: training.seconds},
    )
    metrics["sandbox_containment"] = sandbox_for(run.sandbox).containment.describe()
    write_table_atomically(pa.Table.from_pylist([metrics]), out)
    Tracker.of(run).log(step, scalars(metrics))
    return describe_step(metrics)


def main() -> None:
    """One torchrun process: binds its GPU, joins the process group (NCCL, or gloo on a CPU) and trains one step
    (--inputs), or every step the command hands its training group (--serve)."""
    import torch
    import torch.distributed as dist

    from retool.training.group import serve_steps
    from retool.training.resume import StepInputs, train_from_files

    parser = argparse.ArgumentParser(prog="torchrun ... -m jobs.train_step", description="A PPO step's process.")
    parser.add_argument("--inputs", type=Path, help="a StepInputs as JSON: train this step and exit")
    parser.add_argument("--serve", type=Path, help="the training group's folder: train the steps handed to it")
    parser.add_argument("--parent", type=int, help="--serve: the command's process; the group stops without it")
    parser.add_argument("--hold-on", default="", help="--serve: where the state waits between steps")
    args = parser.parse_args()
    if (args.inputs is None) == (args.serve is None):
        parser.error("give --inputs or --serve")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "WORLD_SIZE" in os.environ:
        if device == "cuda":  # before the process group, so that NCCL binds each rank to its own GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # A group waits for its next step while the command samples: no collective may time out meanwhile.
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(hours=24))
    if args.serve:
        serve_steps(args.serve, args.parent, args.hold_on, device)
    else:
        train_from_files(StepInputs.from_json(args.inputs.read_text()), device)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
