"""The resident training group: torchrun's processes (one per GPU) started once for a command and kept until it
ends, each holding its share of the policy and its Adam state between steps (resident.py), instead of new
processes that load the checkpoint at every step.

A TrainStep (in whichever of the command's processes Luigi runs it) hands the group the step's StepInputs as
runs/<run>/trainer/request.json and waits for response.json; the group's first process broadcasts each request to
the others. runs/<run>/trainer/group.json records the group (its pid and the command's), so that a second command
cannot train the same run at once. The group stops when the command ends (after saving the held step in full), or
by itself when the command's process is gone (killed)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from retool.files.atomic import write_text_atomically
from retool.training.record import StepMetrics

RECORD, REQUEST, RESPONSE, LOG = "group.json", "request.json", "response.json", "group.log"
POLL_SECONDS = 0.05  # how often the group and a step look for each other's file
STOP_SECONDS = 600.0  # a stopping group's final full save (a large model's weights and Adam state)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


class TrainingGroupError(RuntimeError):
    """The group refused or failed a step, or exited; the message names its log."""


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _record(folder: Path) -> dict | None:
    try:
        return json.loads((folder / RECORD).read_text())
    except (FileNotFoundError, ValueError):
        return None


def group_for(folder: Path, processes: int, hold_on: str, command_pid: int) -> int:
    """The pid of the command's group, started here if it has none (stopped when the command's process ends)."""
    record = _record(folder)
    if record and alive(record["pid"]):
        if record["command_pid"] != command_pid and alive(record["command_pid"]):
            raise TrainingGroupError(
                f"{folder / RECORD}: the run's training group (pid {record['pid']}) belongs to another command still "
                f"running (pid {record['command_pid']}): two commands cannot train one run at once"
            )
        if record["command_pid"] == command_pid and record["processes"] == processes:
            return record["pid"]
        stop_group(folder, record["command_pid"])  # a killed command's, or another size: replaced
    folder.mkdir(parents=True, exist_ok=True)
    for name in (REQUEST, RESPONSE):
        (folder / name).unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command += [
        "-m",
        "retool.training.worker",
        "--serve",
        str(folder),
        "--parent",
        str(command_pid),
        "--hold-on",
        hold_on,
    ]
    with (folder / LOG).open("ab") as log:
        # Its own session: Ctrl-C reaches the command, which stops the group after the held step is saved.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    record = {"pid": process.pid, "command_pid": command_pid, "processes": processes}
    write_text_atomically(folder / RECORD, json.dumps(record) + "\n")
    if command_pid == os.getpid():
        atexit.register(stop_group, folder, command_pid)
    return process.pid


def train_in_group(folder: Path, pid: int, inputs) -> StepMetrics:
    """One step (a StepInputs) trained by the group `pid`; its metrics."""
    (folder / RESPONSE).unlink(missing_ok=True)
    write_text_atomically(folder / REQUEST, json.dumps({"inputs": json.loads(inputs.to_json())}))
    while not (folder / RESPONSE).exists():
        if not alive(pid):
            raise TrainingGroupError(f"the training group (pid {pid}) exited; see {folder / LOG}")
        time.sleep(POLL_SECONDS)
    response = json.loads((folder / RESPONSE).read_text())
    (folder / RESPONSE).unlink()
    if "error" in response:
        raise TrainingGroupError(f"{response['error']} (the training group's log: {folder / LOG})")
    return StepMetrics(**response["metrics"])


def stop_group(folder: Path, command_pid: int) -> None:
    """Stops the group that `command_pid` started: asked (it saves its held step in full), then killed."""
    record = _record(folder)
    if not record or record["command_pid"] != command_pid:
        return
    pid = record["pid"]
    if alive(pid):
        write_text_atomically(folder / REQUEST, json.dumps({"stop": True}))
        deadline = time.monotonic() + STOP_SECONDS
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (folder / RECORD).unlink(missing_ok=True)
