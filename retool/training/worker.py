"""A training process under torchrun: `torchrun --nproc-per-node K -m retool.training.worker --inputs FILE` trains
one step on K processes (one per GPU), each reading the same StepInputs; with --serve, the command's training group
trains every step handed to it (retool/training/group.py starts it so)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from retool.files.atomic import write_text_atomically
from retool.training import resident
from retool.training.group import POLL_SECONDS, PR_SET_PDEATHSIG, REQUEST, RESPONSE, alive
from retool.training.resume import StepInputs, train_from_files

WAIT_FOR_STEP = timedelta(hours=24)  # a group waits for its next step while the command samples: no time-out meanwhile


def _next_request(folder: Path, parent: int) -> dict | None:
    """The next step's inputs (the request consumed); None when asked to stop or the command is gone."""
    request = folder / REQUEST
    while not request.exists():
        if not alive(parent):
            return None
        time.sleep(POLL_SECONDS)
    body = json.loads(request.read_text())
    request.unlink()
    return body.get("inputs")


def _die_with_parent() -> None:
    """This process is killed when torchrun's agent, its parent, is (Linux's parent-death signal, which neither
    torchrun nor the standard library sets): a group killed in the middle of a step leaves no process that
    would finish the step, or take the next request, beside the group that replaces it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() == 1:  # the agent already gone
        os._exit(1)


def serve_steps(folder: Path, parent: int, hold_on: str, device: str) -> None:
    """Each process of the group: trains every step the command hands it, holding the state between them; at
    the end saves the held step in full (every process takes part in gathering it)."""
    _die_with_parent()
    first = dist.get_rank() == 0
    logging.basicConfig(level=logging.INFO, format=f"[process {dist.get_rank()}] %(message)s")  # to the group's log
    # The others wait for the next request on the host (gloo), not in an NCCL kernel that spins on a GPU the sampler
    # uses meanwhile; no wait may time out while the command samples.
    requests = dist.new_group(backend="gloo", timeout=WAIT_FOR_STEP)
    while True:
        request = [_next_request(folder, parent) if first else None]
        dist.broadcast_object_list(request, src=0, group=requests)
        if request[0] is None:
            break
        try:
            metrics = train_from_files(StepInputs.from_json(json.dumps(request[0])), device, hold_on)
        except Exception as error:
            resident.drop()  # no final save of a state the group may no longer agree on
            if first:
                write_text_atomically(folder / RESPONSE, json.dumps({"error": f"{type(error).__name__}: {error}"}))
            raise
        if first:
            write_text_atomically(folder / RESPONSE, json.dumps({"metrics": asdict(metrics)}))
    resident.save_at_exit()


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
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=WAIT_FOR_STEP)
    if args.serve:
        serve_steps(args.serve, args.parent, args.hold_on, device)
    else:
        train_from_files(StepInputs.from_json(args.inputs.read_text()), device)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
