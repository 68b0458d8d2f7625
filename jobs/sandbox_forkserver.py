"""A pre-warmed sandbox: a long-lived process that has imported the common math libraries and forks
a fresh, contained child per call (started by jobs.sandbox only: python -I sandbox_forkserver.py CGROUP_PROCS_FILE).

Protocol: one JSON line on stdin per call (the path of the call's settings file, as for the cold
runner); one line back on stdout when the call has ended (`done EXIT_CODE`, negative for a signal). The server runs in a network namespace of
its own with no interface up (creating one per call costs tens of milliseconds; calls of one server
run one at a time and nothing of a call outlives it) and a pids cgroup that it shares with the call
it runs (emptied of the call's processes after each). Each call's child enters new mount and PID namespaces, makes every mount read-only but its working
directory, drops all capabilities and runs the cell exactly as sandbox_runner does. The server
itself never runs model code, so every call starts from the same clean, pre-imported state.
"""

import ctypes
import gc
import json
import os
import select
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this folder out
import sandbox_runner as runner  # noqa: E402

CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_PDEATHSIG = 1
PREWARMED = ("sympy", "numpy", "math", "fractions", "itertools", "functools", "collections", "decimal")


def contain_and_run(settings: dict, server: int) -> None:
    """In the forked child, the first process of a new PID namespace (everything it starts dies
    with it): a new mount namespace, then the cold runner's containment and cell."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # a killed server (pipeline) takes the call with it
    if not os.path.exists(f"/proc/{server}"):  # it ended before that took effect (this /proc is still the server's)
        os._exit(137)
    os.setsid()  # out of the server's process group and session
    if libc.unshare(CLONE_NEWNS) != 0:  # the server already has its own, empty network namespace
        os._exit(125)
    libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)  # mounts below stay in this namespace
    libc.mount(b"proc", b"/proc", b"proc", 0, None)  # a /proc that shows only this namespace
    runner.make_mounts_read_only(settings["workdir"])
    runner.drop_capabilities()
    os.environ.clear()
    os.environ.update(settings["environment"])
    os._exit(runner.run_contained(settings))


def fork_into_new_pid_namespace(own_namespace: int) -> int:
    """os.fork(), the child being the first process of a fresh PID namespace. unshare() only
    redirects the server's next child, and once per namespace, so setns() first points the server
    back at its own namespace: one fork per call, not two."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(own_namespace, CLONE_NEWPID) != 0 or libc.unshare(CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "cannot create a PID namespace")
    return os.fork()


def _wait_unless_abandoned(child: int) -> int:
    """Waits for the call; if the pipeline ends meanwhile (stdin closes), kills it and exits. (No
    PR_SET_PDEATHSIG here: it follows the parent thread, and servers start from short-lived threads.)"""
    ended = os.pidfd_open(child)
    try:
        readable, _, _ = select.select([sys.stdin, ended], [], [])
    finally:
        os.close(ended)
    if ended not in readable:
        os.kill(child, 9)  # the call's PID namespace dies with its first process
        os.waitpid(child, 0)
        sys.exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def serve(cgroup_procs: str) -> None:
    runner.join_cgroup(cgroup_procs)  # each call is forked into it: no costly move per call
    for name in PREWARMED:
        __import__(name)
    own_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
    gc.freeze()  # a call's garbage collections leave the imported objects (and their pages) untouched
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        settings_path = json.loads(line)["settings"]
        with open(settings_path, encoding="utf-8") as handle:
            settings = json.load(handle)
        server = os.getpid()
        child = fork_into_new_pid_namespace(own_namespace)
        if child == 0:
            try:
                contain_and_run(settings, server)
            finally:
                os._exit(126)
        exit_code = _wait_unless_abandoned(child)
        sys.stdout.write(f"done {exit_code}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
