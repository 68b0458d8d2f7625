"""The vLLM server benchmarks (`python -m bench server`), with the real vLLM CPU sampler on the default
run's cold-start model (it writes code):
  - a step's shards run by --workers 4 over one server, against the in-memory loop (one in-process
    engine), on a long-tailed tool latency: one call in eight takes TAIL_SECONDS, the others 50 ms;
  - three consecutive `luigi` commands on one live server: how long until each starts sampling.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

from bench.benchmarks import REPO, default_run_settings, luigi_build
from retool.config.settings import RunSettings, setting_fields
from retool.rollout.in_memory import rollout_in_memory
from retool.run.shared import protocol_for, run_rl_base, sandbox_for, step_examples
from retool.sampling.server import start_server, stop_server
from retool.sandbox.call import Sandbox

TAIL_SECONDS = 8.0  # comparable to a round's sampling on two CPU cores, as a slow tool call is to a GPU's
SHARDS = 4


def tool_latency(code: str) -> float:
    return TAIL_SECONDS if zlib.crc32(code.encode()) % 8 == 0 else 0.05


@contextlib.contextmanager
def long_tailed_tools():
    """Every sandbox call first waits its latency (worker processes forked inside inherit the patch)."""
    real = Sandbox.run_code

    def slow(self, code: str):
        time.sleep(tool_latency(code))
        return real(self, code)

    Sandbox.run_code = slow
    try:
        yield
    finally:
        Sandbox.run_code = real


def cold_started(workdir: Path) -> RunSettings:
    """The default run's settings on its cold-start model (trained here first), without a cold start."""
    from pipeline.cold_start import ColdStart

    settings = default_run_settings().changed(run={"runs_dir": str(workdir), "name": "server-sft"})
    luigi_build(settings, ColdStart)
    model = run_rl_base(settings)
    return settings.changed(model={"name": str(model)}, cold_start={"data": ""}, trainer={"lora_rank": 0})


def bench_server(workdir: Path) -> list[tuple[str, str]]:
    from pipeline.tasks import ScoreTrajectories
    from retool.sampling.vllm_engine import VLLMSampler

    settings = cold_started(workdir).changed(data={"questions_per_step": 8})
    examples = step_examples(settings, 0)
    protocol, sandbox = protocol_for(settings.model), sandbox_for(settings.sandbox)
    sandbox.prewarm()
    engine = VLLMSampler(settings.model.name, "cpu", max_model_len=settings.rollout.max_trajectory_tokens)
    with long_tailed_tools():
        started = time.perf_counter()
        trajectories = rollout_in_memory(examples, engine, sandbox, protocol, settings.rollout, step=0)
        in_memory = time.perf_counter() - started
    engine.close()
    calls = sum(t.code_calls for t in trajectories)
    process, url = start_server(settings, 8391, workdir / "server.log")
    try:
        sharded = settings.changed(
            run={"name": "server-shards"},
            sampler={"engine": "vllm-server", "servers": url},
            rollout={"shards": SHARDS},
        )
        with long_tailed_tools():
            pipeline = luigi_build(sharded, ScoreTrajectories, workers=SHARDS, step=0)
        starts = consecutive_commands(settings.changed(sampler={"engine": "vllm-server", "servers": url}), workdir)
    finally:
        stop_server(process)
    rows = [
        (
            "config",
            f"cold-start SmolLM2 on configs/cpu.cfg, {len(examples)} questions x {settings.rollout.group_size}, "
            f"{calls} tool calls in memory; one in eight sleeps {TAIL_SECONDS:g} s, the rest 50 ms",
        ),
        ("in-memory loop, one in-process engine", f"{in_memory:.1f} s"),
        (f"{SHARDS} shards, --workers {SHARDS}, one server", f"{pipeline:.1f} s"),
        ("speed-up", f"{in_memory / pipeline:.2f}x (goal >= 1.4x)"),
    ]
    return rows + [
        (f"command {i + 1}: start to sampling", f"{start:.1f} s (Python and the pipeline's imports included)")
        for i, start in enumerate(starts)
    ]


def config_text(settings: RunSettings) -> str:
    """The settings as a config file (a value's later lines indented, as configparser continues them)."""
    lines = []
    for name, section in settings.sections().items():
        lines.append(f"[{name}]")
        for field in setting_fields(name, type(section)):
            value = str(getattr(section, field.name)).replace("\n", "\n  ")
            lines.append(f"{field.name} = {value}")
    return "\n".join(lines) + "\n"


def consecutive_commands(settings: RunSettings, workdir: Path) -> list[float]:
    """Three `luigi` commands, each the first round of step 0 of a new run, on the live server: the time
    from the command's start to its SampleRound's start (the command's wall time minus the stages' own)."""
    config = workdir / "server.cfg"
    config.write_text(config_text(settings))
    starts = []
    for command in range(3):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "luigi", "--module", "pipeline", "SampleRound", "--step", "0", "--round", "0"]
            + ["--run-name", f"server-command-{command}"],
            cwd=REPO,
            env={**os.environ, "LUIGI_CONFIG_PATH": str(config)},
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"command {command} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        wall = time.perf_counter() - started
        sampling = float(re.search(r"SampleRound\(.*?\): .*?, ([0-9.]+) s ->", done.stdout).group(1))
        starts.append(wall - sampling)
    return starts
