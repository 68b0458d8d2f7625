"""The sandbox's fork server (or its zygote) killed with SIGKILL mid-round: the next call starts a new one and
gives its real result; a call whose server dies under it runs once more on a new server, and a second death ends
as a sandbox failure (docs/safety.md). The code itself cannot kill its server: it keeps its own observation."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from retool.config.sandbox import SandboxConfig
from retool.sandbox import call
from retool.sandbox.call import Sandbox
from retool.sandbox.isolation import FORK_SERVER, ForkServer
from tests.test_faults import assert_no_process_left, assert_same_outputs, outputs, run, write_config

pytestmark = pytest.mark.skipif(not Sandbox().prewarmed, reason="pre-warmed servers need namespaces and a pids cgroup")


def state(pid: int) -> str:
    """The process's state letter ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def sandbox_processes() -> set[int]:
    """Live fork-server processes of this test process: zygotes (its children) and servers with their calls (in
    pids cgroups named after it: a server outlives a killed zygote)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(cmdline.parent.name)
        try:
            if str(FORK_SERVER).encode() not in cmdline.read_bytes() or state(pid) in ("", "Z"):
                continue
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() or f"/{os.getpid()}-server-" in Path(f"/proc/{pid}/cgroup").read_text():
                found.add(pid)
        except (OSError, ValueError, IndexError):
            continue
    return found


def server_cgroups(sandbox: Sandbox) -> set[Path]:
    return set(sandbox.containment.pids_cgroup.glob(f"{os.getpid()}-server-*"))


def idle_server(sandbox: Sandbox) -> ForkServer:
    server = sandbox._servers.get_nowait()
    sandbox._servers.put(server)
    return server


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while state(pid) not in ("", "Z"):
        assert time.monotonic() < deadline, f"{pid} outlived SIGKILL"
        time.sleep(0.01)


def assert_only_the_live_server_runs(sandbox: Sandbox) -> None:
    """No killed server, call or zygote is left: just the current zygote and its one idle server (and its cgroup)."""
    server = idle_server(sandbox)
    deadline = time.monotonic() + 5
    while sandbox_processes() - sandbox.processes_before != {sandbox._zygote.pid, server.pid}:
        assert time.monotonic() < deadline, (sandbox_processes(), sandbox.processes_before, sandbox._zygote.pid)
        time.sleep(0.05)
    assert server_cgroups(sandbox) - sandbox.cgroups_before == {server.cgroup}


@pytest.fixture
def sandbox(request):
    """A sandbox (settings: the test's parameter, or one worker and 10 s) that leaves no process or cgroup once
    closed."""
    before = sandbox_processes()
    sandbox = Sandbox(SandboxConfig(**{"max_workers": 1, "timeout_seconds": 10, **getattr(request, "param", {})}))
    sandbox.cgroups_before = server_cgroups(sandbox)  # another sandbox of this process may hold some
    sandbox.processes_before = before  # and processes (the process's shared sandbox, made by an earlier test)
    yield sandbox
    sandbox.close()
    deadline = time.monotonic() + 5
    while sandbox_processes() - before or server_cgroups(sandbox) - sandbox.cgroups_before:
        assert time.monotonic() < deadline, (sandbox_processes() - before, server_cgroups(sandbox))
        time.sleep(0.05)


@pytest.mark.parametrize("killed", ["server", "server and zygote"])
def test_a_server_killed_between_calls_is_replaced_and_the_next_call_gives_its_real_result(sandbox, killed):
    assert sandbox.run_code("print(1)").stdout == "1\n"
    kill(idle_server(sandbox).pid)
    if killed == "server and zygote":
        kill(sandbox._zygote.pid)
    result = sandbox.run_code("print(6 * 7)")
    assert (result.status, result.stdout, result.stderr, result.exit_code) == ("ok", "42\n", "", 0)
    assert sandbox.server_restarts == 1
    assert_only_the_live_server_runs(sandbox)


@pytest.mark.parametrize("sandbox", [{"max_workers": 2}], indirect=True, ids=["2 workers"])
def test_replacing_a_killed_zygote_leaves_the_servers_it_forked_serving(sandbox):
    """A call in flight on a server of the killed zygote ends normally while another call starts a new zygote."""
    assert sandbox.run_code("print(0)").stdout == "0\n"
    server, zygote = idle_server(sandbox), sandbox._zygote.pid
    kill(zygote)
    results = []
    slow = threading.Thread(target=lambda: results.append(sandbox.run_code("import time; time.sleep(1); print(1)")))
    slow.start()
    deadline = time.monotonic() + 10
    while len((server.cgroup / "cgroup.procs").read_text().split()) < 2:  # the slow call runs on the old server
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert sandbox.run_code("print(2)").stdout == "2\n"  # a new server, from a new zygote
    slow.join()
    assert sandbox._zygote.pid != zygote and [(r.status, r.stdout) for r in results] == [("ok", "1\n")]
    assert sandbox.server_restarts == 0


def test_a_call_whose_server_is_killed_under_it_runs_once_more_on_a_new_server(sandbox):
    assert sandbox.run_code("print(0)").stdout == "0\n"
    server = idle_server(sandbox)
    killed = []

    def kill_while_the_call_runs() -> None:
        deadline = time.monotonic() + 10
        while len((server.cgroup / "cgroup.procs").read_text().split()) < 2:  # the server and its call
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        time.sleep(0.3)  # the code sleeps by now
        kill(server.pid)
        killed.append(time.perf_counter())

    killer = threading.Thread(target=kill_while_the_call_runs)
    killer.start()
    started = time.perf_counter()
    result = sandbox.run_code("import time; time.sleep(2); print(1)")
    killer.join()
    assert killed and killed[0] - started < 2, "the server was not killed mid-call"
    assert (result.status, result.stdout, result.stderr, result.exit_code) == ("ok", "1\n", "", 0)
    assert result.seconds >= 2 and time.perf_counter() - started >= killed[0] - started + 2  # run anew, in full
    assert sandbox.server_restarts == 1
    assert_only_the_live_server_runs(sandbox)


def test_code_cannot_kill_its_server_and_keeps_its_own_observation(sandbox):
    """In its own PID namespace, as nobody, the code sees no server: its parent (the runner) refuses, kill(-1) finds
    nothing, and killing its group kills only itself."""
    code = (
        "import os, signal\nfor pid in (os.getppid(), -1, 0):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError as error:\n        print(pid, error.strerror, flush=True)\n"
    )
    result = sandbox.run_code(code)
    assert result.stdout == "1 Operation not permitted\n-1 No such process\n", result
    assert (result.status, result.exit_code, result.stderr) == (
        "error",
        -signal.SIGKILL,
        "Process killed by signal SIGKILL\n",
    )
    assert sandbox.server_restarts == 0
    assert sandbox.run_code("print(1)").stdout == "1\n"
    assert_only_the_live_server_runs(sandbox)


def test_a_server_that_dies_under_the_call_every_time_is_rerun_once_then_a_sandbox_failure(sandbox, monkeypatch):
    """Injected (the code cannot do it): every server is killed as soon as it has been sent the call."""
    assert sandbox.run_code("print(0)").stdout == "0\n"
    sent = []
    send = ForkServer.send

    def send_then_die(server: ForkServer, message: dict) -> None:
        send(server, message)
        if "settings" in message:
            sent.append(server.pid)
            kill(server.pid)

    with monkeypatch.context() as patched:
        patched.setattr(ForkServer, "send", send_then_die)
        result = sandbox.run_code("import time; time.sleep(0.5); print(1)")
    assert len(sent) == 2 and len(set(sent)) == 2, sent  # a new server for the one re-run, then no more
    assert (result.status, result.stdout, result.exit_code) == ("error", "", None)
    assert result.stderr.startswith("SandboxError:") and "twice for this call: not run again" in result.stderr
    assert sandbox.observation(result) == result.stderr
    assert sandbox.server_restarts == 2
    assert sandbox.run_code("print(2)").stdout == "2\n"  # the round goes on
    assert_only_the_live_server_runs(sandbox)


@pytest.mark.parametrize("sandbox", [{"timeout_seconds": 1}], indirect=True, ids=["timeout 1 s"])
def test_a_server_that_dies_after_the_call_timed_out_leaves_a_timeout_not_a_rerun(sandbox, monkeypatch):
    """Injected: the server dies while the timed-out call is being killed; the code has used its time already."""
    assert sandbox.run_code("print(0)").stdout == "0\n"
    empty_cgroup = call.empty_cgroup
    killed = []

    def kill_the_server_then_empty(cgroup, remove=True, spare=None):
        if spare is not None and not killed:  # the first clean-up that spares the server: in the timeout loop
            killed.append(spare)
            kill(spare)  # before the call ends, so that the server cannot report it
        empty_cgroup(cgroup, remove, spare)

    with monkeypatch.context() as patched:
        patched.setattr(call, "empty_cgroup", kill_the_server_then_empty)
        started = time.perf_counter()
        result = sandbox.run_code("import time; time.sleep(30)")
    assert time.perf_counter() - started < 1.9  # not run again for another timeout
    assert (result.status, result.exit_code) == ("timeout", None) and len(killed) == 1
    assert sandbox.server_restarts == 1
    assert sandbox.run_code("print(3)").stdout == "3\n"
    assert_only_the_live_server_runs(sandbox)


@pytest.mark.slow
def test_a_run_whose_sandbox_servers_are_killed_mid_round_ends_as_an_uninterrupted_one(
    uninterrupted_run, tiny_model_dir, tmp_path
):
    """The zygote and every fork server killed before the second tool call of a luigi command (tests.inject_faults):
    the call gets its real result, the step counts the restart, and the run's files are the uninterrupted run's."""
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "faulty.cfg", runs, tiny_model_dir, "faulty")
    done = run(config, "tests.inject_faults", KILL_SANDBOX_AT_CALL="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fault: killed" in done.stderr and "fault: killed 0 " not in done.stderr, done.stderr[-3000:]
    assert_no_process_left("the faulty run")
    assert_same_outputs(uninterrupted_run, outputs(runs / "faulty"))
