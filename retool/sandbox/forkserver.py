"""A pre-warmed sandbox: a long-lived process (the zygote) that has imported the common math libraries
and forks, for each client connection, a server that forks a fresh, contained child per call
(started by retool.sandbox.call only: python -I forkserver.py LISTENING_SOCKET_FD).

The listening socket is an abstract Unix socket in the pipeline's network namespace, so every
process of the pipeline (Luigi's task processes too) can connect, and no sandboxed call can: each
server enters a network namespace of its own with no interface up before it serves (creating one
per call would cost tens of milliseconds; the calls of one server run one at a time, so concurrent
calls never share one). Protocol on a connection: one JSON line with the path of the server's pids
cgroup, which it joins (each call is born into it, so nothing moves per call), answered by
`ready PID`; then one JSON line per call (the path of the call's settings file, as for the cold
runner), answered by `done EXIT_CODE` (negative for a signal) when the call has ended. Each call's
child enters new mount and PID namespaces, then the call's filesystem view, drops all capabilities,
becomes an unprivileged user and runs the cell exactly as runner.py does. Neither zygote nor server
runs model code, so every call starts from the same clean, pre-imported state. A server ends when
its connection closes (killing a call in flight); the zygote when its standard input closes.
"""

import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves this folder out
import runner  # noqa: E402

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
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
    runner.contain(settings)
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


def _wait_unless_abandoned(child: int, connection: socket.socket) -> int:
    """Waits for the call; if the client goes away meanwhile (its connection closes), kills the call
    and exits. (No PR_SET_PDEATHSIG here: the client is not this process's parent.)"""
    ended = os.pidfd_open(child)
    try:
        readable, _, _ = select.select([connection, ended], [], [])
    finally:
        os.close(ended)
    if ended not in readable:
        os.kill(child, 9)  # the call's PID namespace dies with its first process
        os.waitpid(child, 0)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def serve_client(connection: socket.socket) -> None:
    """In a child of the zygote: a server for one client, in a network namespace of its own."""
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
        os._exit(125)
    stream = connection.makefile("rw", encoding="utf-8", newline="\n")
    runner.join_cgroup(json.loads(stream.readline())["cgroup_procs"])
    own_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY)
    server = os.getpid()
    stream.write(f"ready {server}\n")
    stream.flush()
    for line in stream:
        with open(json.loads(line)["settings"], encoding="utf-8") as handle:
            settings = json.load(handle)
        child = fork_into_new_pid_namespace(own_namespace)
        if child == 0:
            try:
                contain_and_run(settings, server)
            finally:
                os._exit(126)
        exit_code = _wait_unless_abandoned(child, connection)
        stream.write(f"done {exit_code}\n")
        stream.flush()


def serve(listener: socket.socket) -> None:
    for name in PREWARMED:
        __import__(name)
    gc.freeze()  # a call's garbage collections leave the imported objects (and their pages) untouched
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # servers that end are reaped by the kernel
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        readable, _, _ = select.select([sys.stdin, listener], [], [])
        if sys.stdin in readable:  # the pipeline closed our input (or ended)
            return
        connection, _ = listener.accept()
        if os.fork() == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a server waits for its calls
                listener.close()
                serve_client(connection)
            finally:
                os._exit(0)
        connection.close()


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
