"""A pre-warmed sandbox: a long-lived process that has imported the common math libraries and forks
a fresh, contained child per call (started by jobs.sandbox only: python -I sandbox_forkserver.py).

Protocol: one JSON line on stdin per call (the path of the call's settings file, as for the cold
runner); one line back on stdout when the call has ended. The server runs in a network namespace of
its own with no interface up (creating one per call costs tens of milliseconds; calls of one server
run one at a time and nothing of a call outlives it). Each call's child joins its own pids cgroup,
enters new mount and PID namespaces, makes every mount read-only but its working
directory, drops all capabilities and runs the cell exactly as sandbox_runner does. The server
itself never runs model code, so every call starts from the same clean, pre-imported state.
"""

import ctypes
import json
import os
import select
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this folder out
import sandbox_runner as runner  # noqa: E402

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
PREWARMED = ("sympy", "numpy", "math", "fractions", "itertools", "functools", "collections", "decimal")


def contain_and_run(settings: dict, server: int) -> None:
    """In the forked child: new namespaces, then the cold runner's containment and cell."""
    libc = ctypes.CDLL(None, use_errno=True)
    runner.die_with_parent(server)
    os.setsid()  # out of the server's process group and session
    if settings["cgroup_procs"]:
        runner.join_cgroup(settings["cgroup_procs"])
    if libc.unshare(CLONE_NEWNS | CLONE_NEWPID) != 0:  # the server already has its own, empty network namespace
        os._exit(125)
    libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)  # mounts below stay in this namespace
    outer = os.getpid()
    init = os.fork()  # the first process of the new PID namespace; everything in it dies with it
    if init:
        _, status = os.waitpid(init, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    libc.prctl(runner.PR_SET_PDEATHSIG, 9, 0, 0, 0)  # getppid() is 0 across the namespace border
    if not os.path.exists(f"/proc/{outer}"):
        os._exit(137)
    libc.mount(b"proc", b"/proc", b"proc", 0, None)  # a /proc that shows only this namespace
    runner.make_mounts_read_only(settings["workdir"])
    runner.drop_capabilities()
    os.environ.clear()
    os.environ.update(settings["environment"])
    os._exit(runner.run_contained(settings))


def _wait_unless_abandoned(child: int) -> None:
    """Waits for the call; if the pipeline ends meanwhile (stdin closes), kills it and exits. (No
    PR_SET_PDEATHSIG here: it follows the parent thread, and servers start from short-lived threads.)"""
    ended = os.pidfd_open(child)
    try:
        readable, _, _ = select.select([sys.stdin, ended], [], [])
    finally:
        os.close(ended)
    if ended not in readable:
        os.kill(child, 9)  # the call's namespace dies with it: its first process has a parent-death signal
        os.waitpid(child, 0)
        sys.exit(0)
    os.waitpid(child, 0)


def serve() -> None:
    for name in PREWARMED:
        __import__(name)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        settings_path = json.loads(line)["settings"]
        with open(settings_path, encoding="utf-8") as handle:
            settings = json.load(handle)
        server = os.getpid()
        child = os.fork()
        if child == 0:
            try:
                contain_and_run(settings, server)
            finally:
                os._exit(126)
        _wait_unless_abandoned(child)
        sys.stdout.write("done\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
