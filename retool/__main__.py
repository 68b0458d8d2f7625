"""`python -m retool COMMAND [options]`: the command-line tools beside the pipeline (whose tasks run with
`luigi --module pipeline TASK`). `python -m retool COMMAND --help` describes each."""

import importlib
import os
import sys

COMMANDS = {  # command -> (module of retool.cli, what it does)
    "model": ("model", "build the embedded default model, or a tiny random one, into a folder"),
    "synthetic": ("synthetic", "write the shipped synthetic data sets"),
    "convert": ("convert", "cold-start conversations of a public layout, in the project's layout"),
    "sandbox": ("sandbox", "run a Python file in the sandbox and print what the model would see"),
    "serve": ("serve", "start vLLM's OpenAI-compatible server for a run's model"),
    "report": ("report", "plots and a Markdown summary of a run folder"),
    "export-sft": ("export_sft", "a run's correct rollouts as cold-start conversations"),
    "settings": ("settings", "every setting by section, with its default and description"),
    "view": ("view", "a step's or an evaluation's trajectories as one HTML page: turns, rewards, tokens"),
    "verify": ("verify", "a run checked from its own files: every rule, and the first row that breaks one"),
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        listing = "\n".join(f"  {name:<11} {what}" for name, (_, what) in COMMANDS.items())
        print(f"usage: python -m retool COMMAND [options]\n\ncommands:\n{listing}", file=sys.stderr)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    command = sys.argv.pop(1)
    try:
        sys.exit(importlib.import_module(f"retool.cli.{COMMANDS[command][0]}").main())  # the command's exit code
    except KeyboardInterrupt:
        if os.environ.get("RETOOL_DEBUG"):
            raise
        # Every file is published whole, by a rename: an interrupted command leaves none half-written.
        print(f"python -m retool {command}: interrupted (Ctrl-C); what it had not finished is not written", flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
