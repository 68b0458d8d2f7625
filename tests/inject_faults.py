"""`python -m tests.inject_faults LUIGI_ARGS...` runs the luigi command line with a component killed once, as the
OOM killer or a driver fault would kill it, while the command goes on:

- $KILL_SERVER_AT_CALL=n: just before the command's n-th completion call (from 0), every process of the run's vLLM
  servers (their process groups, from $KILL_SERVER_RECORD, the run's sampler-server.json); the call in flight and
  every call after it find the server gone until it is back;
- $KILL_SANDBOX_AT_CALL=n: just before the command's n-th tool call, the sandbox's zygote and fork servers;
- $DISK_FULL_AT=path: the disk fills up while that Parquet file is written: every write of it (through
  pyarrow.parquet.ParquetWriter, which all of the pipeline's tables go through) writes a few bytes to its hidden
  temporary, then fails as pyarrow does on a full disk (OSError ENOSPC). Other files are written as usual."""

from __future__ import annotations

import errno
import itertools
import json
import os
import signal
import sys
import threading
from pathlib import Path

import psutil
import pyarrow.parquet as pq
from luigi.cmdline import luigi_run

import retool.sampling.server_client as client
from retool.sandbox.call import Sandbox

_lock = threading.Lock()


def once_at(variable: str):
    """A function that says True at the call number $variable (never if it is unset), counted under a lock."""
    at, calls = int(os.environ.get(variable, "-1")), itertools.count()
    return lambda: next(calls) == at


def kill_servers_before_a_completion() -> None:
    now, real_call, record = once_at("KILL_SERVER_AT_CALL"), client._call, os.environ.get("KILL_SERVER_RECORD")

    def call(method: str, url: str, path: str, timeout: float, **kwargs) -> dict:
        if path == "/v1/completions":
            with _lock:
                if now():
                    for server in json.loads(Path(record).read_text())["servers"]:
                        os.killpg(int(server["pid"]), signal.SIGKILL)
                    print(f"fault: killed the vLLM servers of {record}", file=sys.stderr, flush=True)
        return real_call(method, url, path, timeout, **kwargs)

    client._call = call


def is_sandbox_server(process: psutil.Process) -> bool:
    try:
        return any(argument.endswith("retool/sandbox/forkserver.py") for argument in process.cmdline())
    except psutil.Error:
        return False


def kill_sandbox_servers_before_a_call() -> None:
    now, real_run = once_at("KILL_SANDBOX_AT_CALL"), Sandbox._run

    def run(self, code: str):
        with _lock:
            if now():
                servers = [p for p in psutil.Process().children(recursive=True) if is_sandbox_server(p)]
                for server in servers:
                    server.kill()
                psutil.wait_procs(servers, timeout=10)
                print(f"fault: killed {len(servers)} sandbox server processes", file=sys.stderr, flush=True)
        return real_run(self, code)

    Sandbox._run = run


def fill_the_disk_while_writing() -> None:
    if "DISK_FULL_AT" not in os.environ:
        return
    full_at = Path(os.environ["DISK_FULL_AT"])
    temporary = str(full_at.with_name(f".{full_at.name}.tmp-"))  # write_atomically's hidden temporary

    class ParquetWriter(pq.ParquetWriter):
        def __init__(self, where, *args, **kwargs) -> None:
            if isinstance(where, (str, os.PathLike)) and os.fsdecode(where).startswith(temporary):
                Path(where).write_bytes(b"PAR1" + bytes(60))  # what fitted before the disk filled
                raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
            super().__init__(where, *args, **kwargs)

    pq.ParquetWriter = ParquetWriter


if __name__ == "__main__":
    kill_servers_before_a_completion()
    kill_sandbox_servers_before_a_call()
    fill_the_disk_while_writing()
    luigi_run(sys.argv[1:])
