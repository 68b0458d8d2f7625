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
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this folder out
import sandbox_runner as runner  # noqa: E402

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
PREWARMED = ("sympy", "numpy", "math", "fractions", "itertools", "functools", "collections", "decimal")


def contain_and_run(settings: dict) -> None:
    """In the forked child: new namespaces, then the cold runner's containment and cell."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.setsid()  # out of the server's process group and session
    if settings["cgroup_procs"]:
        runner.join_cgroup(settings["cgroup_procs"])
    if libc.unshare(CLONE_NEWNS | CLONE_NEWPID) != 0:  # the server already has its own, empty network namespace
        os._exit(125)
    libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)  # mounts below stay in this namespace
    init = os.fork()  # the first process of the new PID namespace
    if init:
        _, status = os.waitpid(init, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    libc.mount(b"proc", b"/proc", b"proc", 0, None)  # a /proc that shows only this namespace
    runner.make_mounts_read_only(settings["workdir"])
    runner.drop_capabilities()
    os.environ.clear()
    os.environ.update(settings["environment"])
    os._exit(runner.run_contained(settings))


def serve() -> None:
    for name in PREWARMED:
        __import__(name)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        settings_path = json.loads(line)["settings"]
        with open(settings_path, encoding="utf-8") as handle:
            settings = json.load(handle)
        child = os.fork()
        if child == 0:
            try:
                contain_and_run(settings)
            finally:
                os._exit(126)
        os.waitpid(child, 0)
        sys.stdout.write("done\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
