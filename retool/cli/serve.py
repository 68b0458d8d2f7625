"""`python -m retool serve`: starts vLLM's OpenAI-compatible servers for a run's model ([sampler] engines of them,
each on its own [sampler] tensor_parallel_size GPUs) and waits. Every command of that run with [sampler] engine =
vllm-server samples through them, shard s on server s mod engines. Ctrl-C or SIGTERM stops them (vLLM's processes
too) and removes their record; one that dies is started again."""

from __future__ import annotations

import argparse
import signal
import time

from retool.config.files import config_files, settings_from_files
from retool.config.sampler import engine_gpus
from retool.config.settings import SettingsError
from retool.files.layout import RunFolder
from retool.run.setup import cpu_server_limit
from retool.sampling.server import server_log, start_server, start_servers, stop_server, write_record


class Stopped(Exception):
    """SIGINT or SIGTERM arrived."""


def stop_on_signal(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m retool serve", description=__doc__)
    parser.add_argument("--config", help="a config file layered on luigi.cfg, as LUIGI_CONFIG_PATH would be")
    parser.add_argument("--run-name", help="the run it serves (default: [run] name)")
    parser.add_argument("--port", type=int, help="port to listen on (default: [sampler] server_port)")
    args = parser.parse_args()
    try:  # the files a luigi command of the run reads, then --config over them
        settings = settings_from_files(
            config_files(args.config), {"run": {"name": args.run_name}} if args.run_name else {}
        )
    except SettingsError as error:
        parser.exit(2, f"python -m retool serve: {error}\n")
    if limit := cpu_server_limit(settings):  # said before the server starts, not when a step first samples
        print(f"note: {limit.removeprefix('setting ')}; this server can still evaluate the RL base", flush=True)
    port = args.port or settings.sampler.server_port
    folder = RunFolder(settings.run_dir)
    # Python's own handlers, installed after every import: a native extension's (polars') restarts the wait.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop_on_signal)
    count = settings.sampler.engines
    print(
        f"starting {count} vLLM server(s) for run {settings.run.name} ({settings.model.name}) on port(s) "
        f"{port}..{port + count - 1} (log: {folder.server_log})",
        flush=True,
    )
    started = []
    try:
        started = start_servers(settings, port, folder.server_log)
        write_record(settings, [(url, process.pid) for process, url in started], "user")
        urls = ", ".join(url for _, url in started)
        print(f"serving at {urls}; recorded in {folder.server_record}. Ctrl-C stops them.", flush=True)
        while True:  # a server that dies (the OOM killer, a driver fault) is started again on its port
            for index, (process, url) in enumerate(started):
                if process.poll() is not None:
                    log = server_log(settings, folder.server_log, index)
                    print(
                        f"the vLLM server at {url} exited ({process.returncode}); starting it again (log: {log})",
                        flush=True,
                    )
                    stop_server(process)  # what is left of its process group
                    gpus = engine_gpus(settings.sampler, index) if settings.run.device == "cuda" else ""
                    started[index] = (start_server(settings, port + index, log, gpus)[0], url)
                    write_record(settings, [(each, server.pid) for server, each in started], "user")
                    print(f"serving at {url} again", flush=True)
            time.sleep(1.0)
    except SettingsError as error:
        parser.exit(2, f"python -m retool serve: {error}\n")
    except Stopped as signal_name:
        print(f"{signal_name}: stopping the vLLM servers", flush=True)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        for process, _ in started:
            stop_server(process)
        if started:
            folder.server_record.unlink(missing_ok=True)
            print("stopped", flush=True)


if __name__ == "__main__":
    main()
