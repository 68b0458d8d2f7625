"""`torchrun ... -m retool.cli.train`: one training step in each of several processes (one per GPU)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from retool.config.trainer import TrainerConfig
from retool.files.tables import DATUMS, read_table
from retool.rollout.datums import datums_from_table
from retool.training.step import train_from_files


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Train one PPO step from a datums file (run under torchrun for data parallel)."
    )
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--datums", type=Path, required=True)
    parser.add_argument(
        "--trajectories", type=int, required=True, help="trajectories in the step (sample_mean denominator)"
    )
    parser.add_argument("--zero-variance-groups", type=int, default=0, help="recorded in the metrics")
    parser.add_argument("--previous", type=Path, help="checkpoint of the step before, if any")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True, help="JSON of TrainerConfig fields")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "WORLD_SIZE" in os.environ:
        if device == "cuda":  # before the process group, so that NCCL binds each rank to its own GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    config = TrainerConfig(**json.loads(args.config.read_text()))
    datums = datums_from_table(read_table(args.datums, DATUMS))
    train_from_files(
        args.base_model, datums, args.trajectories, args.previous, args.out, config, device, args.zero_variance_groups
    )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
