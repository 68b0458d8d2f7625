"""`python -m tests.kill_points LUIGI_ARGS...` runs the luigi command line and SIGKILLs itself at the
first kill point not yet listed in the file $KILL_POINTS (which it appends to first), so that
re-running the same command until it succeeds stops once at every point of the run:

- just before each output (a Parquet file, a checkpoint or cold-start resume folder) is renamed into place,
- while a checkpoint is being written (its folder holds weights and optimizer state, not yet _SUCCESS),
- at the first forward pass of each training step, and of the cold start before and after its resume point.

Python's audit hooks see the renames and opens, a global forward hook the model; the process is
killed from inside, at exactly that moment, by the same signal as `kill -9`."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from luigi.cmdline import luigi_run

KILL_POINTS = Path(os.environ["KILL_POINTS"])


def kill_once(point: str) -> None:
    if KILL_POINTS.exists() and point in KILL_POINTS.read_text().splitlines():
        return
    with KILL_POINTS.open("a") as log:
        log.write(point + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def on_audit_event(event: str, args: tuple) -> None:
    if event == "os.rename":
        target = Path(os.fsdecode(args[1]))
        if target.suffix == ".parquet" or target.name in ("checkpoint", "progress"):
            kill_once(f"publishing {target}")
    elif event == "open" and isinstance(args[0], (str, os.PathLike)):
        path = Path(os.fsdecode(args[0]))
        for folder in ("checkpoint", "progress"):
            if (
                path.parent.name.startswith(f".{folder}.tmp-") and path.name == "metrics.json"
            ):  # after weights and optimizer
                kill_once(f"writing {path.parent.parent / folder}")


def on_forward(module, inputs, output) -> None:
    run = Path(os.environ["KILL_RUN"])
    if not (run / "sft" / "checkpoint" / "_SUCCESS").exists():
        kill_once(f"cold start {'past its resume point' if (run / 'sft' / 'progress').exists() else 'started'}")
        return
    step = len(list(run.glob("step=*/metrics.parquet")))  # finished training steps
    kill_once(f"training step {step}")


if __name__ == "__main__":
    sys.addaudithook(on_audit_event)
    torch.nn.modules.module.register_module_forward_hook(on_forward)
    luigi_run(sys.argv[1:])
