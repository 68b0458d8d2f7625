"""A training process under torchrun: `torchrun --nproc-per-node K -m retool.training.worker --inputs FILE` trains
one step on K processes (one per GPU), each reading the same StepInputs; with --serve, the command's training group
trains every step handed to it (retool/training/group.py starts it so)."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from retool.training.group import serve_steps
from retool.training.resume import StepInputs, train_from_files


def main() -> None:
    """Binds its GPU, joins the process group (NCCL, or gloo on a CPU) and trains one step (--inputs), or every
    step the command hands its training group (--serve)."""
    parser = argparse.ArgumentParser(prog="torchrun ... -m retool.training.worker", description="A PPO step's process.")
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
