"""`python -m retool serve`: starts vLLM's OpenAI-compatible server for the run's model and waits."""

from __future__ import annotations

import argparse

from retool.files.layout import RunFolder
from retool.sampling.server import start_server, stop_server, write_record


def main() -> None:

    from pipeline.config import current_settings

    parser = argparse.ArgumentParser(
        prog="python -m retool serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, help="port to listen on (default: [sampler] server_port)")
    args = parser.parse_args()
    settings = current_settings()
    port = args.port or settings.sampler.server_port
    folder = RunFolder(settings.run_dir)
    log_path = folder.server_log
    print(f"starting vLLM for {settings.model.name} on port {port} (log: {log_path})", flush=True)
    process, url = start_server(settings, port, log_path)
    write_record(settings, url, process.pid, "user")
    print(f"serving at {url}; recorded in {folder.server_record}. Ctrl-C stops it.", flush=True)
    try:
        process.wait()
    except KeyboardInterrupt:
        stop_server(process)
    finally:
        (folder.server_record).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
