"""The sandbox's filesystem view: the model's code sees the interpreter, the system libraries and its own
directory, as user nobody; no secrets, no answer key, no other user's files."""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import pytest

import retool.sandbox.isolation as isolation
from retool.config.sandbox import SandboxConfig
from retool.sandbox.call import Sandbox
from retool.sandbox.isolation import probe_containment
from tests.helpers import REPO

VIEW = probe_containment().view
needs_view = pytest.mark.skipif(not VIEW, reason="no filesystem view on this machine (see docs/safety.md)")


@pytest.fixture(scope="module", params=[False, True], ids=["cold", "prewarmed"])
def sandbox(request):
    box = Sandbox(SandboxConfig(timeout_seconds=30.0, prewarmed=request.param))
    yield box
    box.close()


def run_json(sandbox: Sandbox, code: str):
    result = sandbox.run_code(code + "\nimport json as _json\nprint(_json.dumps(report))")
    assert result.status == "ok", result.stderr
    return json.loads(result.stdout.splitlines()[-1])


READ_EACH = """
report = {}
for path in PATHS:
    try:
        with open(path) as handle:
            report[path] = "read: " + handle.read(40)
    except OSError as error:
        report[path] = type(error).__name__
"""


@needs_view
def test_secrets_of_the_machine_are_not_readable(sandbox, tmp_path):
    name, token = uuid.uuid4().hex, uuid.uuid4().hex
    secrets = [Path.home() / f".retool-test-token-{name}", Path("/root") / f".retool-test-key-{name}"]
    for secret in secrets:
        secret.write_text(token)
        secret.chmod(0o600)
    try:
        paths = [str(s) for s in secrets] + ["/etc/shadow"]
        report = run_json(sandbox, f"PATHS = {paths!r}\n{READ_EACH}")
    finally:
        for secret in secrets:
            secret.unlink()
    assert all(not outcome.startswith("read") for outcome in report.values()), report
    assert token not in json.dumps(report)


@needs_view
def test_the_answer_key_is_neither_found_nor_readable(sandbox, tmp_path):
    run = f"run-{uuid.uuid4().hex}"
    runs = tmp_path / "runs" / run / "step=0000"
    runs.mkdir(parents=True)
    (runs / "trajectories.parquet").write_text("every earlier answer")
    data = sorted(str(path) for path in (REPO / "data").glob("synthetic_*.jsonl"))
    assert len(data) == 3  # training, cold-start and evaluation files
    paths = [*data, str(runs / "trajectories.parquet"), str(REPO / "luigi.cfg")]
    walk = """
found = []
for folder, subfolders, files in os.walk("/"):
    if folder == "/proc":
        subfolders[:] = []  # this call's own processes
    found += [os.path.join(folder, name) for name in files + subfolders
              if name.startswith("synthetic_") or name in (RUN, "trajectories.parquet", "retool-pipeline")]
report["found"] = found
"""
    report = run_json(sandbox, f"import os\nPATHS = {paths!r}\nRUN = {run!r}\n{READ_EACH}{walk}")
    assert report.pop("found") == []
    assert all(outcome == "FileNotFoundError" for outcome in report.values()), report


@needs_view
def test_the_code_runs_as_nobody_with_its_libraries_and_its_own_files(sandbox):
    code = """
import os, fractions, numpy, sympy
open("notes.txt", "w").write("kept")
open("/tmp/scratch.txt", "w").write("private")
report = {
    "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "root": sorted(os.listdir("/")), "notes": open("notes.txt").read(), "scratch": open("/tmp/scratch.txt").read(),
    "numpy": int(numpy.arange(5).sum()), "sympy": str(sympy.factorint(360)), "cwd": os.getcwd(),
}
try:
    open("/usr/created-by-the-code", "w")
    report["write_outside"] = "written"
except OSError as error:
    report["write_outside"] = type(error).__name__
"""
    report = run_json(sandbox, code)
    assert (report["uid"], report["gid"], report["groups"]) == (65534, 65534, [])
    assert {"usr", "proc", "dev", "tmp", "etc"} <= set(report["root"]) and "home" not in report["root"]
    assert (report["notes"], report["scratch"], report["numpy"]) == ("kept", "private", 10)
    assert report["sympy"] == "{2: 3, 3: 2, 5: 1}" and report["cwd"].startswith("/tmp/retool-sandbox-")
    assert report["write_outside"] in ("PermissionError", "OSError")
    assert sandbox.run_code("print(6 * 7)").stdout == "42\n"


@needs_view
def test_extra_read_only_paths_are_visible_and_stay_read_only(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "table.csv").write_text("a,b\n1,2\n")
    shared.chmod(0o755)
    tmp_path.chmod(0o755)
    box = Sandbox(SandboxConfig(prewarmed=False, extra_ro_paths=str(shared)))
    try:
        code = f"""
report = {{"read": open({str(shared / "table.csv")!r}).read()}}
try:
    open({str(shared / "new.csv")!r}, "w")
    report["write"] = "written"
except OSError as error:
    report["write"] = type(error).__name__
"""
        report = run_json(box, code)
    finally:
        box.close()
    assert report["read"] == "a,b\n1,2\n" and report["write"] != "written"


def test_an_extra_path_that_does_not_exist_is_refused():
    with pytest.raises(
        ValueError,
        match="extra_ro_paths = '/no/such/folder': must be absolute paths of folders or files that exist; not /no/such",
    ):
        SandboxConfig(extra_ro_paths="/no/such/folder")


def test_a_machine_without_the_view_is_named_at_start_up_and_calls_still_run(monkeypatch, caplog, tmp_path):
    failing = tmp_path / "runner.py"
    failing.write_text(
        "import sys\nprint('cannot mount tmpfs on /x: Operation not permitted', file=sys.stderr)\nsys.exit(1)\n"
    )
    assert isolation.probe_view(failing) == (False, "cannot mount tmpfs on /x: Operation not permitted")
    monkeypatch.setattr(isolation, "probe_view", lambda: (False, "cannot mount tmpfs on /x: Operation not permitted"))
    probe_containment.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=isolation.__name__):
            containment = probe_containment()
        assert not containment.view
        if containment.namespaces:
            assert "NO filesystem view (cannot mount tmpfs on /x: Operation not permitted)" in caplog.text
        box = Sandbox(SandboxConfig(prewarmed=False))
        try:
            result = box.run_code("import os\nprint(os.getuid(), 1 + 1)")
        finally:
            box.close()
        assert result.status == "ok" and result.stdout.split()[-1] == "2"
    finally:
        monkeypatch.undo()
        probe_containment.cache_clear()
    assert os.geteuid() != 0 or probe_containment().view == VIEW
