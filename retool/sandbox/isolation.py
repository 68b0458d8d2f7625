"""How the sandbox isolates a call: the namespaces and pids cgroups this machine allows, the child's
environment, the fork-server handle, and the clean-up of what a killed call or process leaves."""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# New network (no interfaces up), PID (the code sees only its own processes, and everything in it dies
# with its first process) and mount namespaces for each call.
UNSHARE = ("unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child")


# The cold child dies with the process that started it (util-linux; without it, a killed pipeline can
# leave a sleeping call behind).
DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "KILL") if shutil.which("setpriv") else ()


WORKDIR_PREFIX = "retool-sandbox-"  # then the pid of the process that runs the call
RUNNER = Path(__file__).with_name("runner.py")  # the child's side of a cold call
FORK_SERVER = Path(__file__).with_name("forkserver.py")  # the pre-warmed zygote and its servers


PIDS_CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))


# Thread pools inside numpy/BLAS would oversubscribe the machine with parallel calls.
SINGLE_THREADED = {
    name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")
}


# Hardware workarounds for OpenBLAS on some processors; not secrets, and numpy may crash without them.
PASSED_THROUGH = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


@dataclass(frozen=True)
class Containment:
    namespaces: bool  # network, PID and mount namespaces, no capabilities
    pids_cgroup: Path | None  # where per-call pids cgroups are made
    view: bool  # the call's own filesystem view, as an unprivileged user (needs the namespaces)
    view_problem: str = ""  # why there is no view, when there is none

    def describe(self) -> str:
        if not self.namespaces:
            parts = ["NO namespaces: network, other processes and every file are reachable"]
        elif self.view:
            parts = [
                "namespaces (no network, own PIDs, no capabilities); a filesystem view of the interpreter, the "
                "system libraries and its directory only, as user nobody"
            ]
        else:
            parts = [
                "namespaces (no network, own PIDs, no capabilities, read-only filesystem but its directory); NO "
                f"filesystem view ({self.view_problem}): the code can read every file root can"
            ]
        parts.append(
            f"pids cgroup under {self.pids_cgroup}"
            if self.pids_cgroup
            else "NO pids cgroup: a fork bomb is limited only by the timeout"
        )
        return "; ".join(parts)


@lru_cache(maxsize=1)
def probe_containment() -> Containment:
    """What this machine lets the sandbox use; says loudly what it cannot."""
    namespaces = False
    if shutil.which("unshare") and os.geteuid() == 0:
        namespaces = subprocess.run([*UNSHARE, "true"], capture_output=True).returncode == 0
    view, view_problem = probe_view() if namespaces else (False, "no namespaces")
    pids_cgroup = None
    if os.environ.get("RETOOL_SANDBOX_CGROUP"):  # a parent cgroup chosen by the operator (or a test's guard)
        pids_cgroup = Path(os.environ["RETOOL_SANDBOX_CGROUP"])
        pids_cgroup.mkdir(parents=True, exist_ok=True)
    for root in () if pids_cgroup else PIDS_CGROUP_ROOTS:
        # cgroup v1 mounts the pids controller on its own; v2 lists it among the enabled controllers
        if (root / "cgroup.procs").exists() and (
            root.name == "pids" or "pids" in read_text_or_empty(root / "cgroup.subtree_control").split()
        ):
            folder = root / "retool-sandbox"
            try:
                folder.mkdir(exist_ok=True)
                pids_cgroup = folder
                break
            except OSError:
                continue
    containment = Containment(namespaces, pids_cgroup, view, view_problem)
    _remove_leftovers_of_ended_processes(pids_cgroup)
    if not (namespaces and pids_cgroup and view):
        log.warning("sandbox containment is partial on this machine: %s", containment.describe())
    return containment


def probe_view(runner: Path = RUNNER) -> tuple[bool, str]:
    """Whether a call's filesystem view can be made here (a tmpfs root, read-only binds, chroot, user
    nobody), tried once in fresh namespaces; and what failed, if it cannot."""
    with tempfile.TemporaryDirectory(prefix="retool-view-probe-") as empty:
        probe = subprocess.run(
            [*UNSHARE, sys.executable, "-I", str(runner), "--probe-view", empty], capture_output=True, text=True
        )
    problem = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
    return probe.returncode == 0, "" if probe.returncode == 0 else problem


def _remove_leftovers_of_ended_processes(pids_cgroup: Path | None) -> None:
    """Working directories and cgroups are named after the process that made them; those of a
    process that no longer runs (a killed pipeline) are removed."""
    for workdir in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        if not _is_running(workdir.name.removeprefix(WORKDIR_PREFIX).split("-")[0]):
            shutil.rmtree(workdir, ignore_errors=True)
    for cgroup in pids_cgroup.glob("*-*") if pids_cgroup else ():
        if cgroup.is_dir() and not _is_running(cgroup.name.split("-")[0]):
            empty_cgroup(cgroup)


def _is_running(pid: str) -> bool:
    if not pid.isdigit():
        return True  # not named by this module: leave it alone
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def read_text_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class ServerDied(RuntimeError):
    """The fork server's connection broke or closed without a status: the server (not the code) ended."""


@dataclass
class ForkServer:
    connection: socket.socket  # to a server forked from the zygote, in a network namespace of its own
    stream: Any  # the connection as text lines
    pid: int  # the server's
    cgroup: Path  # holds the server and the call it runs

    def forget(self) -> None:
        """Closes this process's copy of the connection (in a forked child), leaving the server alone."""
        try:
            self.stream.close()
        except OSError:  # a dead server: what was left unsent goes nowhere (the stream is closed all the same)
            pass
        self.connection.close()

    def idle_and_alive(self) -> bool:
        """An idle server says nothing: a readable connection means it ended (EOF) since its last call."""
        return not select.select([self.connection], [], [], 0)[0]

    def send(self, message: dict) -> None:
        try:
            self.stream.write(json.dumps(message) + "\n")
            self.stream.flush()
        except (BrokenPipeError, ConnectionResetError) as error:
            raise ServerDied(f"the sandbox fork server is gone ({error})") from None

    def receive(self, word: str) -> int:
        """Reads the server's `WORD NUMBER` line; EOF or a reset means the server died, anything else is a
        protocol error."""
        try:
            line = self.stream.readline()
        except ConnectionResetError as error:
            raise ServerDied(f"the sandbox fork server died ({error})") from None
        if not line:
            raise ServerDied(f"the sandbox fork server died (its connection closed without {word!r})")
        reply = line.split()
        if len(reply) != 2 or reply[0] != word:
            raise RuntimeError(f"the sandbox fork server stopped (expected {word!r}, read {reply!r})")
        return int(reply[1])

    def stop(self) -> None:
        self.forget()
        empty_cgroup(self.cgroup)  # the server too


def empty_cgroup(cgroup: Path, remove: bool = True, spare: int | None = None) -> None:
    """Kills every process in the cgroup (but `spare`), then removes it."""
    for _ in range(100):
        pids = [int(pid) for pid in read_text_or_empty(cgroup / "cgroup.procs").split() if int(pid) != spare]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    if not remove:
        return
    try:
        cgroup.rmdir()
    except OSError:
        log.warning("could not remove sandbox cgroup %s", cgroup)


def kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def child_environment(workdir: str) -> dict[str, str]:
    """The whole environment of a call: nothing of the pipeline's own leaks into the code."""
    environment = {
        "PATH": os.defpath,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MPLBACKEND": "Agg",
    }
    environment.update(SINGLE_THREADED)
    environment.update({name: os.environ[name] for name in PASSED_THROUGH if name in os.environ})
    return environment
