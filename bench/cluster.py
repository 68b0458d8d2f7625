"""Several nodes through one central scheduler (`python -m bench cluster`): a real luigid on 127.0.0.1, and one
training step run by one command against two commands sharing its shards, as docs/multi-node.md runs them.
The helpers here start luigid and the commands for tests/test_cluster.py too."""

from __future__ import annotations

import configparser
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from retool.protocol.chat import BUNDLED_TEMPLATE

REPO = Path(__file__).resolve().parent.parent
# The run the nodes share (with a model and a scripted policy): four questions of three samples in four shards.
RUN = {
    "data": {"train": str(REPO / "data/synthetic_eval.jsonl"), "questions_per_step": "4"},
    "rollout": {
        "group_size": "3",
        "max_code_calls": "2",
        "max_assistant_turns": "3",
        "max_trajectory_tokens": "900",
        "max_assistant_tokens": "96",
        "max_tool_response_tokens": "48",
        "trainer_max_tokens": "1024",
        "shards": "4",
    },
    "sandbox": {"max_workers": "2", "timeout_seconds": "5"},
    "trainer": {"max_sampler_gap": "0", "lora_rank": "4", "lora_alpha": "8", "learning_rate": "1e-3"},
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_config(
    path: Path,
    model: Path,
    runs: Path,
    name: str,
    port: int,
    central: bool = True,
    policy: str = "slow_branching_tools",
    **overrides: dict[str, str],
) -> Path:
    """configs/cluster.cfg with a run on top, its scheduler on 127.0.0.1:`port` (or, not central, Luigi's local
    one); a short retry policy: 1 s between retries, a node gone after 3 s of silence; `overrides` by section."""
    config = configparser.ConfigParser()
    config.read(REPO / "configs/cluster.cfg")
    sections = {
        "core": {
            "local_scheduler": str(not central).lower(),
            "scheduler_host": "127.0.0.1",
            "scheduler_port": str(port),
            "rpc_retry_attempts": "1",
            "rpc_retry_wait": "1",
        },
        "worker": {"wait_interval": "0.5", "wait_jitter": "0.5"},
        "scheduler": {"retry_delay": "1", "worker_disconnect_delay": "3"},
        "run": {"device": "cpu", "name": name, "runs_dir": str(runs)},
        "model": {"name": str(model), "chat_template": str(BUNDLED_TEMPLATE)},
        **RUN,
        "sampler": {"engine": f"scripted:tests.policies:{policy}"},
    }
    for section, values in overrides.items():
        sections[section] = {**sections.get(section, {}), **values}
    for section, values in sections.items():
        if not config.has_section(section):
            config.add_section(section)
        for key, value in values.items():
            config.set(section, key, value)
    with path.open("w") as handle:
        config.write(handle)
    return path


def command(config: Path, log: Path, *args: str, debug: bool = False) -> subprocess.Popen:
    """A node's Luigi command in a process (and session) of its own, its output in `log`.out and `log`.err."""
    environment = {**os.environ, "LUIGI_CONFIG_PATH": str(config), "PYTHONDONTWRITEBYTECODE": "1"}
    if debug:
        environment["RETOOL_DEBUG"] = "1"  # Luigi's per-task lines, to see when a task starts
    with log.with_suffix(".out").open("w") as stdout, log.with_suffix(".err").open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "luigi", "--module", "pipeline", *args, "--no-lock"],  # the nodes share a machine
            cwd=REPO,
            env=environment,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    process.log = log
    return process


def finished(process: subprocess.Popen, seconds: float = 300) -> tuple[int, str, str]:
    """The command's exit code, standard output and standard error, once it has ended."""
    process.wait(timeout=seconds)
    return process.returncode, process.log.with_suffix(".out").read_text(), process.log.with_suffix(".err").read_text()


@contextmanager
def luigid(config: Path, port: int, state: Path):
    """A central scheduler on 127.0.0.1:`port`, reading luigi.cfg from the repository and then `config`."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from luigi.cmdline import luigid; luigid()",
            "--address",
            "127.0.0.1",
            "--port",
            str(port),
            "--state-path",
            str(state),
        ],
        cwd=REPO,
        env={**os.environ, "LUIGI_CONFIG_PATH": str(config)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"luigid did not start on 127.0.0.1:{port}")
            time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=10)


def bench_cluster(workdir: Path) -> list[tuple[str, str]]:
    """Wall time of TrainStep 0 (4 questions x 3 samples, 4 shards, 3 rounds; a tiny model; a scripted policy
    at 50 ms a sampled token, so that sampling waits as on a remote engine rather than using the 2 cores)
    through luigid: one command with 2 workers, against two commands of 2 workers each."""
    from retool.weights.models import build_default_model, build_tiny_model

    model = build_tiny_model(workdir / "tiny", build_default_model())
    rows = []
    seconds = {}
    for nodes in (1, 2):
        port = free_port()
        folder = workdir / f"cluster-{nodes}"
        folder.mkdir(parents=True, exist_ok=True)
        config = write_config(
            folder / "nodes.cfg", model, folder / "runs", "bench", port, policy="paced_branching_tools"
        )
        with luigid(config, port, folder / "luigid.pickle"):
            started = time.perf_counter()
            processes = [
                command(config, folder / f"node{node}", "TrainStep", "--step", "0", "--workers", "2")
                for node in range(nodes)
            ]
            codes = [finished(process)[0] for process in processes]
            seconds[nodes] = time.perf_counter() - started
        rows.append((f"{nodes} node(s) x 2 workers", f"{seconds[nodes]:.1f} s, exit codes {codes}"))
    rows.append(("two nodes / one", f"{seconds[2] / seconds[1]:.2f} of the wall time"))
    return rows
