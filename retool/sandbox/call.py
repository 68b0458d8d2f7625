"""Runs the model's Python in a fresh, limited child process per call (`python -m retool sandbox FILE` runs a
file the same way and prints what the model would see)."""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from retool.config.sandbox import SandboxConfig
from retool.recoveries import note_recovery
from retool.sandbox.isolation import (
    DIE_WITH_PARENT,
    FORK_SERVER,
    RUNNER,
    UNSHARE,
    WORKDIR_PREFIX,
    Containment,
    ForkServer,
    ServerDied,
    child_environment,
    empty_cgroup,
    kill_group,
    probe_containment,
)
from retool.sandbox.observation import ExecutionResult, observation_text
from retool.sandbox.runner import SANDBOX_GID, SANDBOX_UID

log = logging.getLogger(__name__)


def _read_tail(path: Path, limit: int) -> str:
    size = path.stat().st_size
    with path.open("rb") as handle:
        handle.seek(max(0, size - limit))
        data = handle.read()
    text = data.decode("utf-8", errors="replace")
    return f"[... {size - limit} bytes truncated ...]\n{text}" if size > limit else text


@dataclass(eq=False)  # a resource, compared by identity
class Sandbox:
    config: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        self._slots = threading.BoundedSemaphore(self.config.max_workers)
        self.containment = probe_containment() if self.config.contain else Containment(False, None, False)
        # Fork servers, one per concurrent call; a server's timeouts rely on the pids cgroup.
        self.prewarmed = (
            self.config.prewarmed and self.containment.namespaces and self.containment.pids_cgroup is not None
        )
        self._servers: queue.SimpleQueue = queue.SimpleQueue()  # this process's idle servers
        self._zygote: subprocess.Popen | None = None  # started by this process, or None
        self._zygote_address: str | None = None  # where any process of the pipeline connects
        self._zygote_lock = threading.Lock()
        self.server_restarts = 0  # fork servers found dead (between calls or under one) and replaced
        self._restarts_lock = threading.Lock()
        _SANDBOXES.add(self)

    def prewarm(self) -> None:
        """Starts the zygote now (it takes about a second): before Luigi forks its task processes,
        so that all of them fork their servers from it."""
        if self.prewarmed:
            self._zygote_socket_address()

    def _forget_inherited(self) -> None:
        """In a forked child: the parent's servers and zygote input are not ours to use or keep
        open (a server ends when every copy of its connection closes)."""
        while True:
            try:
                self._servers.get_nowait().forget()
            except queue.Empty:
                break
        if self._zygote is not None:
            self._zygote.stdin.close()
            self._zygote = None
        self._zygote_lock = threading.Lock()
        self._restarts_lock = threading.Lock()

    def run_code(self, code: str) -> ExecutionResult:
        """Runs one call; safe to call from many threads (at most max_workers run at once)."""
        with self._slots:
            try:
                result = self._run_rerun_once_if_the_server_dies(code)
            except Exception as error:  # the sandbox itself failed: only this call is affected
                log.exception("sandbox call failed")
                result = ExecutionResult(
                    "error",
                    "",
                    f"SandboxError: the sandbox could not run this code ({type(error).__name__}: {error})\n",
                    0.0,
                    None,
                )
        return result

    def _run_rerun_once_if_the_server_dies(self, code: str) -> ExecutionResult:
        """A call whose fork server died under it (killed from outside: the code cannot reach it) runs once
        more on a new server; it starts from a fresh process and directory either way, so that gives its real
        result. A second death is not retried: it ends as a sandbox failure."""
        try:
            return self._run(code)
        except ServerDied as died:
            self._count_server_restart()
            log.warning("%s during a call; running the call once more on a new server", died)
        try:
            return self._run(code)
        except ServerDied as died:
            self._count_server_restart()
            raise ServerDied(f"{died}, twice for this call: not run again") from None

    def _count_server_restart(self) -> None:
        with self._restarts_lock:
            self.server_restarts += 1
        note_recovery("sandbox_server_restart")

    def run_many(self, codes: Sequence[str]) -> list[ExecutionResult]:
        """Runs calls concurrently; results come back in the order of `codes`."""
        if not codes:
            return []
        with ThreadPoolExecutor(max_workers=min(len(codes), self.config.max_workers)) as pool:
            return list(
                tqdm(
                    pool.map(self.run_code, codes),
                    total=len(codes),
                    desc="running tool calls",
                    unit="call",
                    leave=False,
                    disable=None,
                )
            )

    def _run(self, code: str) -> ExecutionResult:
        config, containment = self.config, self.containment
        # A fresh directory per call: no call sees another's files, and removing it removes everything it wrote.
        workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
        # A cold call gets a pids cgroup of its own; a warm one is born into its server's.
        cgroup = (
            containment.pids_cgroup / f"{os.getpid()}-{uuid.uuid4().hex}"
            if containment.pids_cgroup and not self.prewarmed
            else None
        )
        try:
            # Output goes to files, not pipes: a flood of output cannot block the child or fill this process.
            code_file, out_file, err_file = (Path(workdir, name) for name in ("cell.py", ".stdout", ".stderr"))
            code_file.write_text(code, encoding="utf-8")
            out_file.touch()
            err_file.touch()
            if containment.view:  # the code runs as nobody, which owns its directory and nothing else
                for path in (workdir, code_file, out_file, err_file):
                    os.chown(path, SANDBOX_UID, SANDBOX_GID)
                os.chmod(workdir, 0o711)  # the runner (uid 0 without capabilities) reaches its .status inside
                Path(workdir, ".status").touch()  # the runner's own: the code cannot write it
            if cgroup:
                cgroup.mkdir()
                (cgroup / "pids.max").write_text(str(config.max_processes))
            # The runner applies the limits itself, inside the child, before the code runs.
            settings_file = Path(workdir, ".settings.json")
            settings_file.write_text(json.dumps(self._runner_settings(code_file, workdir, cgroup)))
            # Run it: forked from a warm server (no interpreter start) or a new interpreter; both end by the timeout.
            started = time.perf_counter()
            try:
                exit_code = (
                    self._run_prewarmed(settings_file) if self.prewarmed else self._run_cold(settings_file, workdir)
                )
            finally:
                if cgroup:
                    empty_cgroup(cgroup)  # kills whatever is left, wherever it went
            seconds = time.perf_counter() - started
            # How the code ended, as the runner saw it (the runner's own exit code says less), and the outputs'
            # tails: the model reads the end of a traceback, not its start.
            exit_code = _child_status(Path(workdir, ".status"), exit_code)
            output_limited = max(out_file.stat().st_size, err_file.stat().st_size) >= config.file_mb * 2**20
            stdout_text = _read_tail(out_file, config.output_tail_bytes)
            stderr_text = _read_tail(err_file, config.output_tail_bytes)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        # A limit that stopped the code is said in the observation's last line, as Python would say an error.
        status, note = _classify(exit_code, output_limited, config)
        if note:
            stderr_text = f"{stderr_text.rstrip(chr(10))}\n{note}\n".lstrip("\n")
        return ExecutionResult(status, stdout_text, stderr_text, seconds, exit_code)

    def _runner_settings(self, code_file: Path, workdir: str, cgroup: Path | None) -> dict:
        """What the runner must apply in the child before the code runs."""
        config, containment = self.config, self.containment
        return {
            "code_file": str(code_file),
            "workdir": workdir,
            "contained": containment.namespaces,
            "view": containment.view,
            "extra_ro_paths": config.readable_extra,
            "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup else None,
            "cpu_seconds": config.cpu_limit,
            "memory_bytes": config.memory_mb * 2**20,
            "file_bytes": config.file_mb * 2**20,
            "environment": child_environment(workdir),
            "print_trailing_expression": config.observation == "notebook",
        }

    def _run_cold(self, settings_file: Path, workdir: str) -> int | None:
        """A new interpreter for the call (in new namespaces when available); None after a timeout."""
        argv = [
            *DIE_WITH_PARENT,
            *(UNSHARE if self.containment.namespaces else ()),
            self.config.python,
            "-I",
            str(RUNNER),
            str(settings_file),
        ]
        with open(Path(workdir, ".stdout"), "ab") as stdout, open(Path(workdir, ".stderr"), "ab") as stderr:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                cwd=workdir,
                env=child_environment(workdir),
                close_fds=True,
                start_new_session=True,
            )
            try:
                return child.wait(timeout=self.config.timeout_seconds)
            except subprocess.TimeoutExpired:
                return None
            finally:
                kill_group(child)  # also reaps children the code left running

    def _run_prewarmed(self, settings_file: Path) -> int | None:
        """A child forked from a pre-warmed server, into the server's pids cgroup; after the call
        (or its timeout) everything in that cgroup but the server is killed, wherever it went.
        None after a timeout; ServerDied if the server died before the call ended."""
        server = self._live_idle_server()
        timed_out = False
        try:
            server.send({"settings": str(settings_file)})
            ready, _, _ = select.select([server.connection], [], [], self.config.timeout_seconds)
            timed_out = not ready
            while not ready:  # kill until the server reports the call over
                empty_cgroup(server.cgroup, remove=False, spare=server.pid)
                ready, _, _ = select.select([server.connection], [], [], 0.2)
            exit_code = server.receive("done")
            empty_cgroup(server.cgroup, remove=False, spare=server.pid)  # what the code left running
        except Exception as error:
            server.stop()
            if isinstance(error, ServerDied) and timed_out:  # past its wall clock already: that is its result
                self._count_server_restart()
                return None
            raise
        self._servers.put(server)
        return None if timed_out else exit_code

    def _live_idle_server(self) -> ForkServer:
        """An idle server of this process that is still alive (dead ones are stopped and counted), or a new one."""
        while True:
            try:
                server = self._servers.get_nowait()
            except queue.Empty:
                return self._start_server()
            if server.idle_and_alive():
                return server
            log.warning("a sandbox fork server died between calls; starting a new one")
            server.stop()
            self._count_server_restart()

    def _start_server(self) -> "ForkServer":
        """A server forked from the zygote for this process, in a pids cgroup of its own."""
        cgroup = self.containment.pids_cgroup / f"{os.getpid()}-server-{uuid.uuid4().hex}"
        cgroup.mkdir()
        (cgroup / "pids.max").write_text(str(self.config.max_processes + 1))  # the server, and one call
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server = ForkServer(connection, connection.makefile("rw", encoding="utf-8", newline="\n"), 0, cgroup)
        try:
            self._connect_to_zygote(connection)
            server.send({"cgroup_procs": str(cgroup / "cgroup.procs")})
            server.pid = server.receive("ready")
        except Exception:
            server.stop()
            raise
        return server

    def _connect_to_zygote(self, connection: socket.socket) -> None:
        address = self._zygote_socket_address()
        try:
            connection.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):  # the zygote ended (killed?): start another here
            log.warning("the sandbox zygote is gone; starting a new one in process %d", os.getpid())
            self._stop_zygote(address)
            connection.connect(self._zygote_socket_address())

    def _zygote_socket_address(self) -> str:
        """Starts the zygote on first use (one per pipeline: forked processes inherit its address)."""
        with self._zygote_lock:
            if self._zygote_address is None:
                # abstract: lives in this network namespace only
                address = f"\0retool-sandbox-{os.getpid()}-{uuid.uuid4().hex}"
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                    listener.bind(address)
                    listener.listen(64)
                    zygote = subprocess.Popen(
                        [self.config.python, "-I", str(FORK_SERVER), str(listener.fileno())],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        cwd="/",
                        env=child_environment(tempfile.gettempdir()),
                        close_fds=True,
                        start_new_session=True,
                        text=True,
                        pass_fds=(listener.fileno(),),
                    )
                if zygote.stdout.readline() != "ready\n":
                    kill_group(zygote)
                    raise RuntimeError("the sandbox zygote did not start")
                self._zygote, self._zygote_address = zygote, address
            return self._zygote_address

    def close(self) -> None:
        """Stops this process's servers and the zygote it started (they also stop when this
        process ends: their connections and input close)."""
        while True:
            try:
                self._servers.get_nowait().stop()
            except queue.Empty:
                break
        self._stop_zygote()

    def _stop_zygote(self, address: str | None = None) -> None:
        """Stops the zygote this process started (if any) and forgets its address; with `address`,
        only if that is still the current one (another thread may have replaced it already)."""
        with self._zygote_lock:
            if address is not None and address != self._zygote_address:
                return
            if self._zygote is not None and address is None:
                kill_group(self._zygote)  # and every server forked from it
            elif self._zygote is not None:  # it ended: the servers it forked still run their calls
                self._zygote.kill()
                self._zygote.wait()
                self._zygote.stdin.close()
            self._zygote, self._zygote_address = None, None

    def observation(self, result: ExecutionResult) -> str:
        return observation_text(result, self.config)


def _classify(exit_code: int | None, output_limited: bool, config: SandboxConfig) -> tuple[str, str]:
    """Status and an explanatory last line for the observation, from how the child ended."""
    if exit_code is None:
        return "timeout", f"TimeoutError: execution exceeded the wall-clock limit of {config.timeout_seconds:g} s"
    if exit_code == -signal.SIGXCPU:
        return "timeout", f"TimeoutError: execution exceeded the CPU limit of {config.cpu_limit} s"
    if output_limited:
        return "error", f"OutputLimitError: output exceeded {config.file_mb} MB and was cut off"
    if exit_code < 0:
        return "error", f"Process killed by signal {signal.Signals(-exit_code).name}"
    return ("ok", "") if exit_code == 0 else ("error", "")


def _child_status(status_file: Path, exit_code: int | None) -> int | None:
    """How the code's process ended, as the runner recorded it (negative for a signal); the
    runner's own exit code when it recorded nothing (None after a timeout stays None)."""
    recorded = status_file.read_text() if exit_code is not None and status_file.exists() else ""
    if not recorded.strip():
        return exit_code
    ended = json.loads(recorded)
    return -ended["signal"] if "signal" in ended else ended["exit"]


_SANDBOXES: "weakref.WeakSet[Sandbox]" = weakref.WeakSet()


def _forget_inherited_servers() -> None:
    for sandbox in list(_SANDBOXES):
        sandbox._forget_inherited()


os.register_at_fork(after_in_child=_forget_inherited_servers)
