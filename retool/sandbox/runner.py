"""Runs inside the sandbox child: contains itself, applies limits, then executes the model's code as a
notebook cell.

Usage (by retool.sandbox.call only): python -I runner.py SETTINGS_JSON, or --probe-view EMPTY_DIR to check
that this machine allows the filesystem view. It imports nothing from the project, so it works in an isolated
interpreter. When retool.sandbox.call started it in fresh network, PID and mount namespaces (as root), it
first joins its pids cgroup, then enters the call's filesystem view: an empty root holding only the Python
installation, the system libraries, a few files of /etc, four devices, its own /proc, a private /tmp and the
call's directory; then it drops all capabilities and becomes an unprivileged user, so the code can neither
undo that nor read anything else. Where the view cannot be made, every mount is made read-only but the
call's directory instead.
"""

import ast
import ctypes
import errno
import json
import linecache
import os
import resource
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
CAPABILITY_VERSION_3 = 0x20080522

SANDBOX_UID = SANDBOX_GID = 65534  # nobody: owns nothing outside the call's directory
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # bound read-only, or their links
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")  # what the loader and Python read of /etc
DEVICES = ("null", "zero", "urandom", "random")


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def join_cgroup(procs_file: str) -> None:
    with open(procs_file, "w") as handle:
        handle.write(str(os.getpid()))


def make_mounts_read_only(writable: str) -> None:
    """Every mount becomes read-only in this (private) mount namespace, but a bind of `writable`."""
    libc = _libc()
    if libc.mount(writable.encode(), writable.encode(), None, MS_BIND | MS_REC, None) != 0:
        raise OSError(ctypes.get_errno(), f"cannot bind {writable}")
    os.chdir(writable)  # the old working directory still points into the mount below the bind
    with open("/proc/self/mountinfo") as handle:
        targets = [line.split()[4] for line in handle]
    for target in targets:
        if target != writable:
            libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)  # some refuse: fine


def _mount(source, target: str, kind, flags: int, data=None) -> None:
    encoded = [value.encode() if isinstance(value, str) else value for value in (source, target, kind, data)]
    if _libc().mount(*encoded[:3], flags, encoded[3]) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot mount {source or kind} on {target}: {os.strerror(error)}")


def _bind(source: str, root: str, read_only: bool = True) -> None:
    """`source` at the same path inside `root`: a read-only bind, or the same symbolic link."""
    target = root + source
    if os.path.islink(source):
        if not os.path.lexists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(source), target)
        return
    if not os.path.exists(source) or os.path.ismount(target):
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


def readable_paths(extra: list[str]) -> list[str]:
    """What the call's interpreter needs beside the system's paths (its installation: the prefix and base
    prefix, the real interpreter), then the user's extra paths; nested ones once."""
    wanted = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    paths = []
    for path in [*wanted, *extra]:
        path = os.path.realpath(path)
        if path not in paths and not any(path.startswith(p.rstrip("/") + "/") for p in (*SYSTEM_PATHS, *paths)):
            paths.append(path)
    return paths


def enter_view(workdir: str, readable: list[str], tmp_bytes: int) -> None:
    """The call's filesystem: a fresh tmpfs as root over the call's directory, which is bound back into it at
    its own path; into it, read-only, the system's paths and `readable`; then chroot into it."""
    directory = os.open(workdir, os.O_PATH | os.O_DIRECTORY)  # reachable once the tmpfs covers its path
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={tmp_bytes}")
    root = workdir
    for path in (*SYSTEM_PATHS, *readable, *(f"/etc/{name}" for name in ETC_FILES)):
        _bind(path, root)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        _bind(f"/dev/{name}", root, read_only=False)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's
    os.makedirs(root + "/tmp", mode=0o1777, exist_ok=True)
    os.chmod(root + "/tmp", 0o1777)  # the call's private /tmp, gone with the call
    os.makedirs(root + workdir, exist_ok=True)
    _mount(f"/proc/self/fd/{directory}", root + workdir, None, MS_BIND)
    os.close(directory)
    os.chroot(root)
    os.chdir(workdir)


def become_unprivileged() -> None:
    """The code runs as nobody, in no supplementary group: a file visible by mistake is still unreadable unless
    it is world-readable."""
    os.setgroups([])
    os.setgid(SANDBOX_GID)
    os.setuid(SANDBOX_UID)


def contain(settings: dict) -> None:
    """The containment of a call as root in its new namespaces: the filesystem view (or, where this machine
    does not allow one, read-only mounts), then no capabilities and (with the view) an unprivileged user."""
    if settings["view"]:
        enter_view(settings["workdir"], readable_paths(settings["extra_ro_paths"]), settings["file_bytes"])
        drop_bounding_set()  # the rest once the cell's process has become nobody (see run_contained)
    else:
        make_mounts_read_only(settings["workdir"])
        drop_capabilities()


def probe_view(workdir: str) -> int:
    """In fresh namespaces, over an empty directory: can a call's view be made here? Prints what failed."""
    try:
        os.chown(workdir, SANDBOX_UID, SANDBOX_GID)  # as a call's directory is
        enter_view(workdir, readable_paths([]), 2**20)
        drop_bounding_set()
        become_unprivileged()
        drop_capabilities()
        if os.path.exists("/etc/shadow") or not os.access(workdir, os.W_OK):
            print("the view holds more than it should", file=sys.stderr)
            return 1
    except OSError as error:
        print(error.strerror or str(error), file=sys.stderr)
        return 1
    return 0


def drop_bounding_set() -> None:
    """No capability can be gained again, not even by executing a program (needs CAP_SETPCAP: first)."""
    libc = _libc()
    for capability in range(64):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)


def drop_capabilities() -> None:
    libc = _libc()
    drop_bounding_set()
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    empty = (ctypes.c_uint32 * 6)()
    if libc.capset(header, empty) != 0:
        raise OSError(ctypes.get_errno(), "cannot drop capabilities")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def apply_limits(cpu_seconds: int, memory_bytes: int, file_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def with_trailing_print(tree: ast.Module) -> ast.Module:
    """Prints the value of a trailing expression, as a notebook cell does (None prints nothing)."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        value = ast.Name(id="__retool_value__", ctx=ast.Load())
        tree.body[-1:] = [
            ast.Assign(targets=[ast.Name(id="__retool_value__", ctx=ast.Store())], value=last.value),
            ast.If(
                test=ast.Compare(left=value, ops=[ast.IsNot()], comparators=[ast.Constant(None)]),
                body=[
                    ast.Expr(
                        ast.Call(
                            ast.Name("print", ast.Load()), [ast.Call(ast.Name("repr", ast.Load()), [value], [])], []
                        )
                    )
                ],
                orelse=[],
            ),
        ]
        for node in tree.body[-2:]:
            ast.copy_location(node, last)
            ast.fix_missing_locations(node)
    return tree


def main() -> int:
    """Contains the process, then runs the cell in a child and records how that child ended in
    .status (the first process of a PID namespace cannot be killed by a signal from inside it, and
    unshare does not pass signals on)."""
    with open(sys.argv[1], encoding="utf-8") as handle:
        settings = json.load(handle)
    if settings["cgroup_procs"]:
        join_cgroup(settings["cgroup_procs"])
    if settings["contained"]:
        contain(settings)
    return run_contained(settings)


def run_contained(settings: dict) -> int:
    """Runs the cell in a child and records how that child ended in .status; returns its exit code."""
    child = os.fork()
    if child == 0:
        if settings["contained"] and settings["view"]:
            become_unprivileged()  # which clears every capability it had
            drop_capabilities()
        if settings["contained"]:
            os.setsid()  # a group of its own: killpg(0) in the code reaches only the code's processes
        redirect_output(settings["workdir"])
        os._exit(run_cell(settings))
    if settings["contained"] and settings["view"]:
        # This process stays uid 0 (a change of user would clear the signal that kills it with its parent),
        # without any capability: the code, another user, can neither signal nor trace it.
        drop_capabilities()
    _, status = os.waitpid(child, 0)
    ended = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
    with open(os.path.join(settings["workdir"], ".status"), "w") as handle:
        json.dump(ended, handle)
    return ended.get("exit", 1)


def redirect_output(workdir: str) -> None:
    """Standard input from /dev/null, output appended to the call's .stdout and .stderr files."""
    opened = [os.open(os.devnull, os.O_RDONLY)]
    opened += [
        os.open(os.path.join(workdir, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        for name in (".stdout", ".stderr")
    ]
    for fd, source in enumerate(opened):
        os.dup2(source, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the code inherits nothing else


def run_cell(settings: dict) -> int:
    apply_limits(settings["cpu_seconds"], settings["memory_bytes"], settings["file_bytes"])
    sys.stdout.reconfigure(errors="backslashreplace")
    sys.stderr.reconfigure(errors="backslashreplace")
    with open(settings["code_file"], encoding="utf-8") as handle:
        source = handle.read()
    linecache.cache["<code>"] = (
        len(source),
        None,
        source.splitlines(keepends=True),
        "<code>",
    )  # source lines in tracebacks
    try:
        tree = ast.parse(source, filename="<code>")
        tree = with_trailing_print(tree) if settings["print_trailing_expression"] else tree
    except SyntaxError as error:
        traceback.print_exception(type(error), error, None)
        return 1
    del sys.argv[1:]
    exit_code = execute(tree)
    return exit_code if flush_streams() else exit_code or 1


def execute(tree: ast.Module) -> int:
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(tree, "<code>", "exec"), namespace)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as error:  # the traceback is the observation; skip this runner's own frame
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        return 1
    return 0


def flush_streams() -> bool:
    """Flushes by hand (os._exit follows); says so on stderr when the code closed a stream."""
    flushed = True
    for name, stream in (("output", sys.stdout), ("error", sys.stderr)):
        try:
            stream.flush()
        except (OSError, ValueError) as error:
            flushed = False
            if getattr(error, "errno", None) == errno.EFBIG:  # the output cap (RLIMIT_FSIZE), not a closed stream
                message = (
                    f"OutputLimitError: the code printed more than the sandbox keeps; the rest of its {name} is lost"
                )
            else:
                message = f"OSError: the code closed its standard {name}; what it printed there is lost ({error})"
            try:
                os.write(2, (message + "\n").encode())
            except OSError:
                pass
    return flushed


if __name__ == "__main__":
    sys.exit(probe_view(sys.argv[2]) if sys.argv[1] == "--probe-view" else main())
