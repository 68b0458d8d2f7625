"""The run's vLLM servers are the ones it asked for: a port in use is an error naming its holder, and recorded
servers are trusted only while each recorded process answers there and serves the run's model; each of a run's
engines has its own GPUs, and a step's shards sample through all of them."""

from __future__ import annotations

import os
import socket

import luigi
import pyarrow.parquet as pq
import pytest

from retool.config.sampler import SamplerConfig, engine_gpus
from retool.config.settings import RunSettings, SettingsError
from retool.files.layout import RunFolder
from retool.sampling.server import recorded_urls, server_command, server_environment, start_server, write_record
from tests.helpers import fake_completions_server, fake_vllm_server


@pytest.fixture
def settings(tmp_path, tiny_model_dir):
    return RunSettings().changed(run={"device": "cpu", "runs_dir": str(tmp_path)}, model={"name": str(tiny_model_dir)})


@pytest.fixture
def fake_server(tiny_model_dir):
    """A server in this process that answers /health and /v1/models like vLLM does for `model`."""
    served = {"model": str(tiny_model_dir)}
    server = fake_vllm_server(served)
    yield server.server_address[1], served
    server.shutdown()
    server.server_close()


def test_a_port_in_use_is_refused_naming_it_and_its_holder(settings):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(  # the holder is this process, named by its command line (pytest-xdist retitles it)
            SettingsError, match=rf"server_port = {port}: the port {port} is in use by pid {os.getpid()} \(.+\)"
        ):
            start_server(settings, port, settings.run_dir / "server.log")
    assert not (settings.run_dir / "server.log").exists()  # nothing was started


def test_a_record_is_trusted_only_for_its_own_live_process_and_the_runs_model(settings, fake_server):
    import os

    port, served = fake_server
    url, record = f"http://127.0.0.1:{port}", RunFolder(settings.run_dir).server_record
    record.parent.mkdir(parents=True)
    write_record(settings, [(url, os.getpid())], "user")  # this process listens there
    assert recorded_urls(settings) == [url] and record.exists()

    served["model"] = "/models/another"  # another run's server on the same port
    assert recorded_urls(settings) is None and not record.exists()

    served["model"] = str(settings.model.name)
    write_record(settings, [(url, 2**22 + 12345)], "user")  # a pid that does not listen there (gone, or another)
    assert recorded_urls(settings) is None and not record.exists()

    record.write_text("{not json")
    assert recorded_urls(settings) is None and not record.exists()


def test_a_record_of_several_servers_and_an_older_record_of_one(settings, fake_server):
    import json
    import os

    port, _ = fake_server
    url, record = f"http://127.0.0.1:{port}", RunFolder(settings.run_dir).server_record
    record.parent.mkdir(parents=True)
    write_record(settings, [(url, os.getpid()), (url, os.getpid())], "pipeline")
    assert recorded_urls(settings) == [url, url]
    assert json.loads(record.read_text())["servers"] == [{"url": url, "pid": os.getpid()}] * 2
    record.write_text(json.dumps({"url": url, "pid": os.getpid(), "model": str(settings.model.name)}))
    assert recorded_urls(settings) == [url]


def test_each_engine_has_its_own_gpus_and_spans_tensor_parallel_size_of_them(settings, monkeypatch):
    config = SamplerConfig(engines=4, tensor_parallel_size=2)
    assert [engine_gpus(config, index) for index in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    on_gpu = settings.changed(run={"device": "cuda"}, sampler={"tensor_parallel_size": 2})
    command = server_command(on_gpu, 8300)
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert server_environment(on_gpu, "2,3")["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # `retool serve` run on the node's last four GPUs
    assert server_environment(on_gpu, "2,3")["CUDA_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(SettingsError, match=r"setting \[sampler\] engines = 0: must be positive"):
        SamplerConfig(engines=0)


def test_shards_sampled_through_two_servers_give_the_trajectories_of_one(configure, hermes, tiny_model_dir):
    """Shard s samples on server s mod 2; every request carries its seed, so the tokens do not depend on which."""
    from pipeline import ScoreTrajectories

    def reply(body, index):  # a deterministic policy of the request's seed: answers 0, 1 or 2
        return hermes.encode(f"The answer is \\boxed{{{(body['seed'] + index) % 3}}}") + [body["stop_token_ids"][0]]

    received = [[], []]
    servers = [fake_completions_server(str(tiny_model_dir), reply, requests) for requests in received]
    urls = [f"http://127.0.0.1:{server.server_address[1]}" for server in servers]
    tables = {}
    try:
        for name, listed in (("one", urls[:1]), ("two", urls)):
            settings = configure(
                name, sampler={"engine": "vllm-server", "servers": ",".join(listed)}, rollout={"shards": 2}
            )
            assert luigi.build([ScoreTrajectories(step=0)], local_scheduler=True, workers=1, log_level="WARNING")
            trajectories = pq.read_table(settings.run_dir / "step=0000" / "trajectories.parquet")
            tables[name] = trajectories.drop_columns([c for c in trajectories.column_names if "seconds" in c])
            if name == "one":
                assert received[0] and not received[1]
                received[0].clear()
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert received[0] and received[1]  # both servers sampled a shard
    assert tables["two"].equals(tables["one"]) and tables["one"].num_rows == 9
