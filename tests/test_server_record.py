"""The run's vLLM server is the one it asked for: a port in use is an error naming its holder, and a recorded
server is trusted only while the recorded process answers there and serves the run's model."""

from __future__ import annotations

import socket

import pytest

from retool.config.settings import RunSettings, SettingsError
from retool.files.layout import RunFolder
from retool.sampling.server import recorded_url, start_server, write_record
from tests.helpers import fake_vllm_server


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
        with pytest.raises(SettingsError, match=rf"server_port = {port}: the port is in use by pid \d+ \(.*python"):
            start_server(settings, port, settings.run_dir / "server.log")
    assert not (settings.run_dir / "server.log").exists()  # nothing was started


def test_a_record_is_trusted_only_for_its_own_live_process_and_the_runs_model(settings, fake_server):
    import os

    port, served = fake_server
    url, record = f"http://127.0.0.1:{port}", RunFolder(settings.run_dir).server_record
    record.parent.mkdir(parents=True)
    write_record(settings, url, os.getpid(), "user")  # this process listens there
    assert recorded_url(settings) == url and record.exists()

    served["model"] = "/models/another"  # another run's server on the same port
    assert recorded_url(settings) is None and not record.exists()

    served["model"] = str(settings.model.name)
    write_record(settings, url, 2**22 + 12345, "user")  # a pid that does not listen there (gone, or another one)
    assert recorded_url(settings) is None and not record.exists()

    record.write_text("{not json")
    assert recorded_url(settings) is None and not record.exists()
