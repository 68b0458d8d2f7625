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
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from retool.config.settings import RunSettings
from retool.files.atomic import write_text_atomically
from retool.files.layout import RunFolder
from retool.sampling.engines import reclaim_sampler_memory, release_sampler_memory, sampler_kind
from retool.training.record import StepMetrics

RECORD, REQUEST, RESPONSE, LOG = "group.json", "request.json", "response.json", "group.log"
POLL_SECONDS = 0.05  # how often the group and a step look for each other's file
STOP_SECONDS = 600.0  # a stopping group's final full save (a large model's weights and Adam state)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


class TrainingGroupError(RuntimeError):
    """The group refused or failed a step, or exited; the message names its log."""


def _alive(pid: int) -> bool:
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
    if record and _alive(record["pid"]):
        if record["command_pid"] != command_pid and _alive(record["command_pid"]):
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
        if not _alive(pid):
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
    if _alive(pid):
        write_text_atomically(folder / REQUEST, json.dumps({"stop": True}))
        deadline = time.monotonic() + STOP_SECONDS
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (folder / RECORD).unlink(missing_ok=True)


def _next_request(folder: Path, parent: int) -> dict | None:
    """The next step's inputs (the request consumed); None when asked to stop or the command is gone."""
    request = folder / REQUEST
    while not request.exists():
        if not _alive(parent):
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
    import torch.distributed as dist

    from retool.training import resident
    from retool.training.resume import StepInputs, train_from_files

    _die_with_parent()
    first = dist.get_rank() == 0
    logging.basicConfig(level=logging.INFO, format=f"[process {dist.get_rank()}] %(message)s")  # to the group's log
    while True:
        request = [_next_request(folder, parent) if first else None]
        dist.broadcast_object_list(request, src=0)
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


# Where a step trains: in this process, or in the command's training group (one process per GPU); and where the
# trainer's state waits between steps, so that the next step starts from it rather than from the files.


def trains_in_group(settings: RunSettings) -> bool:
    return settings.run.train_processes > 1


def stays_resident(settings: RunSettings) -> bool:
    """The trainer stays between steps in this process (one training process, Luigi running the tasks here) or in
    the command's training group (several); only then may a step skip the full save, which the held state makes at
    the end of the command."""
    return trains_in_group(settings) or multiprocessing.parent_process() is None


def held_on(settings: RunSettings) -> str:
    """Where the trainer waits between steps: the host while a sampler uses the same GPUs (an engine in this
    process, or servers that sleep while a step trains: colocated); the GPU when the servers have their own."""
    kind = sampler_kind(settings)
    colocated = kind in ("vllm", "hf") or (kind == "vllm-server" and settings.sampler.sleep_while_training)
    device = settings.run.device
    return "cpu" if device == "cuda" and colocated else device


def train_placed(inputs, settings: RunSettings) -> StepMetrics:
    """Trains a StepInputs where the settings place it: the command's training group (started at its first step),
    or this process (its state held on afterwards where it stays resident); the sampler sleeps meanwhile."""
    release_sampler_memory(settings)  # the sampler's GPU memory is the step's while it trains
    if trains_in_group(settings):
        folder = RunFolder(settings.run_dir).trainer_group
        command = multiprocessing.parent_process()  # Luigi's worker processes are the command's children
        pid = group_for(
            folder, settings.run.train_processes, held_on(settings), command.pid if command else os.getpid()
        )
        metrics = train_in_group(folder, pid, inputs)
    else:
        from retool.training.resume import train_from_files

        metrics = train_from_files(inputs, settings.run.device, held_on(settings) if stays_resident(settings) else "")
    reclaim_sampler_memory(settings)
    return metrics
