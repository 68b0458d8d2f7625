"""How a command ends: Luigi's execution summary, then one line for the task it names: done (with where),
already complete before the command ran, or not done (with the first failure this process saw)."""

from __future__ import annotations

import atexit
import logging
import os

import luigi
import luigi.cmdline_parser

_failures: list[str] = []  # "Task(...): error", in the order this process saw them


def note_failure(task: luigi.Task, error: Exception) -> None:
    _failures.append(f"{task.task_family}: {error}")


def watch_if_named_on_the_command_line(task: luigi.Task) -> None:
    """Registers the final line for the task the command line names (once, when it is made)."""
    command_line = luigi.cmdline_parser.CmdlineParser.get_instance()
    if command_line is None or command_line.known_args.root_task != task.task_family or _watched:
        return
    _watched.append(task)
    # Read now: at exit the command line's settings (and so the task's paths) are no longer at hand.
    name, outputs, was_complete = task.label(), luigi.task.flatten(task.output()), task.complete()
    atexit.register(lambda: print(outcome(name, outputs, was_complete), flush=True))


_watched: list[luigi.Task] = []


def outcome(name: str, outputs: list, was_complete: bool) -> str:
    where = ", ".join(target.path for target in outputs)
    if was_complete:
        return f"{name}: already complete, nothing to do ({where}); delete an output to build it again"
    if all(target.exists() for target in outputs):
        return f"{name}: done -> {where}"
    reason = _failures[0] if _failures else "a task it needs failed or could not run (see the errors above)"
    return f"{name}: not done: {reason}"


SUMMARY_HEADER = "===== Luigi Execution Summary ====="


class OnlyTheSummaryAtInfo(logging.Filter):
    """luigi.cfg logs Luigi at INFO for the sake of its execution summary: its other INFO lines (one per task
    scheduled, started and done) are left out unless RETOOL_DEBUG is set."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            record.levelno != logging.INFO or SUMMARY_HEADER in str(record.msg) or bool(os.environ.get("RETOOL_DEBUG"))
        )


logging.getLogger("luigi-interface").addFilter(OnlyTheSummaryAtInfo())
