"""The training group outlives no command: killed with its command, it saves its held step in full and exits by
itself; killed in the middle of a step, the step fails and the command run again trains it to the same weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest
import torch

from retool.training import resident
from retool.training.group import RECORD, TrainingGroupError, group_for, stop_group, train_in_group
from retool.weights.checkpoint import Checkpoint
from tests.conftest import REPO
from tests.test_resume import CONFIGS, state_of, step_inputs, train

CONFIG = replace(CONFIGS[1], micro_batch_items=1, save_every=20)  # a full fine-tune: FSDP2 in the group

# A command: starts the run's group, trains steps 0 and 1 in it, says so, and waits to be killed.
COMMAND = """
import os, sys, time
from pathlib import Path
from retool.training.group import group_for, train_in_group
from tests.test_resume import step_inputs
from tests.test_training_group import CONFIG
run, model = Path(sys.argv[1]), Path(sys.argv[2])
pid = group_for(run / "trainer", 2, "cpu", os.getpid())
for step in range(2):
    train_in_group(run / "trainer", pid, step_inputs(run, model, CONFIG, step))
print(pid, flush=True)
time.sleep(3600)
"""


def wait_for_exit(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_killed_command_or_group_loses_no_step(tiny_model_dir, tmp_path):
    run, folder = tmp_path / "run", tmp_path / "run" / "trainer"
    command = subprocess.Popen(
        [sys.executable, "-c", COMMAND, str(run), str(tiny_model_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    group = int(command.stdout.readline())
    assert not Checkpoint(run / "step=0001" / "checkpoint").holds_state  # held by the group, saved only for vLLM
    command.send_signal(signal.SIGKILL)
    command.wait()
    # The group sees its command gone, saves the step it holds in full and exits.
    assert wait_for_exit(group, 120), (folder / "group.log").read_text()[-3000:]
    assert Checkpoint(run / "step=0001" / "checkpoint").holds_state

    # The command run again: a new group (the record of the dead one replaced) resumes from step 1's full save.
    pid = group_for(folder, 2, "cpu", os.getpid())
    assert pid != group
    try:
        train_in_group(folder, pid, step_inputs(run, tiny_model_dir, CONFIG, 2))
        inputs = step_inputs(run, tiny_model_dir, CONFIG, 3)
        workers = psutil.Process(pid).children(recursive=True)
        os.kill(pid, signal.SIGKILL)  # torchrun's agent killed as step 3 is handed to the group
        assert not psutil.wait_procs(workers, timeout=30)[1]  # its workers die with it, none left to take a step
        with pytest.raises(TrainingGroupError, match="the training group .* exited"):
            train_in_group(folder, pid, inputs)
        # Run again: step 3 from step 2's checkpoint, which is only what vLLM loads; its full save was never
        # made, so the new group replays step 2 from step 1's.
        pid = group_for(folder, 2, "cpu", os.getpid())
        train_in_group(folder, pid, inputs)
    finally:
        stop_group(folder, os.getpid())
    assert not (folder / RECORD).exists()

    train(tmp_path / "one", tiny_model_dir, CONFIG, range(4), 20)
    resident.save_at_exit()
    (weights, adam), (one_weights, one_adam) = (
        state_of(run / "step=0003/checkpoint"),
        state_of(tmp_path / "one" / "step=0003/checkpoint"),
    )
    assert weights.keys() == one_weights.keys() and adam["state"].keys() == one_adam["state"].keys()
    for name in weights:
        torch.testing.assert_close(weights[name], one_weights[name], rtol=0, atol=1e-4, msg=name)
