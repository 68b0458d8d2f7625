"""Faults of the sampling server, against a stand-in server in this process (fast): an HTTP 500, a connection
reset and a hang past the request timeout are retried with backoff and counted by cause, with the replies of
calls that never failed; a 4xx and a 5xx that persists fail with the server's message; a server found dead is
revived and the policy loaded on it again; a server another command owns is waited for, then named. The same
faults against vLLM's real server, and a server killed mid-round: tests/test_fault_sampler_server.py."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retool.config.settings import RunSettings
from retool.evaluation.analysis import metrics_by_step
from retool.evaluation.metrics import record_stage_seconds, stage_recoveries
from retool.recoveries import CAUSES, added_since, recovery_counts
from retool.sampling.adapters import ADAPTER_WEIGHTS
from retool.sampling.contract import SampleRequest, SamplerFailure, SamplingSettings, sample_checked
from retool.sampling.server import ServerGone, revive_server
from retool.sampling.server_client import ServerSampler
from retool.weights.checkpoint import Policy
from tests.helpers import fake_completions_server, fault_proxy

MODEL = "stand-in"


def reply(body: dict, index: int) -> list[int]:
    """Tokens drawn from the request's seed alone, as a seeded engine's are."""
    return [(body["seed"] * 7 + index * 3 + k) % 1000 for k in range(5)]


def requests_of_a_round() -> list[SampleRequest]:
    prompt = tuple(range(100, 120))
    return [SampleRequest(question, (0, 1), prompt, 8, seed=1000 + question) for question in range(4)]


@pytest.fixture
def server():
    received: list[dict] = []
    stand_in = fake_completions_server(MODEL, reply, received)
    yield f"http://127.0.0.1:{stand_in.server_address[1]}", received
    stand_in.shutdown()
    stand_in.server_close()


def sampled(url: str, requests: int = 4, **client) -> list[list[tuple[int, ...]]]:
    sampler = ServerSampler(url, "cpu", **{"backoff_seconds": 0.05, "workers": 1, **client})
    try:
        replies = sample_checked(sampler, requests_of_a_round()[:requests], SamplingSettings())
    finally:
        sampler.close()
    return [[sequence.tokens for sequence in sequences] for sequences in replies]


def test_a_500_a_reset_and_a_hang_are_retried_counted_and_give_the_same_replies(server):
    url, _ = server
    expected = sampled(url)
    faults = {0: "500", 2: "reset", 4: "hang"}
    proxy = fault_proxy(url, faults.get, hang_seconds=1.5)
    start = recovery_counts()
    assert sampled(f"http://127.0.0.1:{proxy.server_address[1]}", request_timeout_seconds=0.5) == expected
    assert added_since(start) == {"sampler_server_error": 1, "sampler_connection": 1, "sampler_timeout": 1}
    proxy.shutdown()


def test_a_4xx_fails_at_once_with_the_servers_message(server):
    url, received = server
    proxy = fault_proxy(url, lambda n: "400")
    with pytest.raises(SamplerFailure, match=r"POST /v1/completions answered 400: injected failure 400$"):
        sampled(f"http://127.0.0.1:{proxy.server_address[1]}")
    assert received == []  # not retried
    proxy.shutdown()


def test_a_5xx_that_persists_fails_after_its_tries_with_the_servers_message(server):
    url, _ = server
    proxy = fault_proxy(url, lambda n: "500")
    start = recovery_counts()
    with pytest.raises(SamplerFailure, match=r"answered 500: injected failure 500 \(after 3 tries\)$"):
        sampled(f"http://127.0.0.1:{proxy.server_address[1]}", requests=1, attempts=3)
    assert added_since(start) == {"sampler_server_error": 2}  # one call, three tries
    proxy.shutdown()


def test_a_dead_server_is_revived_and_the_policy_loaded_on_it_again(server, tmp_path, monkeypatch):
    """The client samples under its adapter's name; the server dies; once revived (here: a new stand-in on the same
    port), the adapter is loaded on it again before the calls are repeated, which give the same replies."""
    url, _ = server
    expected = sampled(url)
    monkeypatch.setattr("retool.sampling.server_client.adapter_for_engine", lambda adapter, base, out: adapter)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / ADAPTER_WEIGHTS).write_bytes(b"trained")
    posted: list[tuple[str, dict]] = []
    first = fake_completions_server(MODEL, reply, [], posted=posted)
    port = first.server_address[1]
    revived: list[str] = []

    def revive(at: str) -> None:  # what retool.sampling.server.revive_server does: returns once it answers
        revived.append(at)
        fake_completions_server(MODEL, reply, [], port=port, posted=posted)

    sampler = ServerSampler(f"http://127.0.0.1:{port}", "cpu", backoff_seconds=0.05, workers=1, revive=revive)
    sampler.use_policy(Policy(Path(MODEL), adapter))
    loads = [body["lora_name"] for path, body in posted if path == "/v1/load_lora_adapter"]
    first.shutdown()
    first.server_close()
    start = recovery_counts()
    replies = sample_checked(sampler, requests_of_a_round(), SamplingSettings())
    assert [[sequence.tokens for sequence in sequences] for sequences in replies] == expected
    assert revived == [f"http://127.0.0.1:{port}"]
    assert [body["lora_name"] for path, body in posted if path == "/v1/load_lora_adapter"] == loads * 2
    assert {body["model"] for path, body in posted if path == "/v1/completions"} == set(loads)
    assert added_since(start) == {"sampler_connection": 1, "sampler_server_restart": 1}


def test_a_server_another_command_owns_is_waited_for_then_named(tmp_path):
    settings = RunSettings().changed(
        run={"runs_dir": str(tmp_path)}, sampler={"engine": "vllm-server", "server_wait_seconds": 0.5}
    )
    with pytest.raises(ServerGone, match=r"http://127.0.0.1:9 .*did not return within 0 s.*python -m retool serve"):
        revive_server(settings, "http://127.0.0.1:9")


def test_the_steps_metrics_sum_what_its_tasks_survived_by_cause(tmp_path):
    record_stage_seconds(tmp_path, "SampleRound_a", "SampleRound", 1.0, 0.1, {"sampler_timeout": 2})
    record_stage_seconds(tmp_path, "SampleRound_b", "SampleRound", 1.0, 0.1, {"sampler_timeout": 1})
    record_stage_seconds(tmp_path, "ExecuteRound_a", "ExecuteRound", 1.0, 0.1, {})
    counts = stage_recoveries(tmp_path)
    assert counts == {f"retries_{cause}": 3 if cause == "sampler_timeout" else 0 for cause in CAUSES}


def test_steps_written_before_the_retries_columns_read_with_later_ones(tmp_path):
    for step, row in enumerate([{"step": 0, "reward_mean": 0.5}, {"step": 1, "reward_mean": 0.7, "retries_x": 2}]):
        (tmp_path / f"step={step:04d}").mkdir()
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / f"step={step:04d}/metrics.parquet")
    metrics = metrics_by_step(tmp_path)
    assert metrics["reward_mean"].to_list() == [0.5, 0.7] and metrics["retries_x"].to_list() == [None, 2]
