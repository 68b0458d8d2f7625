"""How a command ends: Luigi's execution summary, then one line for the task it names: done (with where),
already complete before the command ran, or not done (with the first failure this process, or the central
scheduler, saw); and an exit code that says whether the target is complete."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from pathlib import Path

import luigi
import luigi.cmdline_parser
import luigi.retcodes

from retool.config.settings import SettingsError
from retool.data.examples import DataError
from retool.protocol.chat import TemplateError

INPUT_ERRORS = (SettingsError, DataError, TemplateError)  # bad input: a setting, a data file, a chat template
INPUT_ERROR_EXIT = 2  # the exit code of a command refused for its input, as argparse's for a bad option

_failures: list[str] = []  # "Task(...): error", in the order this process saw them
_command: dict = {}  # the task the command line names, as it was when it was made
_running: list[str] = []  # the tasks this process has started and not yet finished, by label
_finished: list[str] = []  # the tasks this process has finished, by label
_interrupted: list[str] = []  # the signal that stopped the command (Ctrl-C: SIGINT), once it has
_input_errors: list[str] = []  # input errors the luigi command met (building its tasks, or in one's run)


def note_start(task: luigi.Task) -> None:
    _running.append(task.label())


def note_end(task: luigi.Task, finished: bool) -> None:
    if task.label() in _running:
        _running.remove(task.label())
    if finished:
        _finished.append(task.label())


def note_failure(task: luigi.Task, error: Exception) -> None:
    _failures.append(f"{task.task_family}: {error}")
    if isinstance(error, INPUT_ERRORS):
        note_input_error(error)


def note_input_error(error: Exception) -> None:
    """An input error of the luigi command (`luigi` or `python -m luigi`, not a test calling luigi.build): its exit
    code is INPUT_ERROR_EXIT."""
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if main.name == "luigi" or main.parts[-2:] == ("luigi", "__main__.py"):
        _input_errors.append(str(error))


def interrupted_line(name: str) -> str:
    running = f"while {', '.join(_running)} ran" if _running else "between tasks"
    finished = f"; finished before: {', '.join(_finished)}" if _finished else ""
    return (
        f"{name}: interrupted (Ctrl-C) {running}{finished}. What it had not finished is not written; the same "
        "command goes on from there"
    )


def _quiet_interrupt(kind, error, traceback) -> None:
    """Ctrl-C is an ending, not an error: its traceback (from wherever the command was) only with RETOOL_DEBUG."""
    if issubclass(kind, KeyboardInterrupt) and not os.environ.get("RETOOL_DEBUG"):
        _interrupted.append("SIGINT")
        return
    _excepthook(kind, error, traceback)


_excepthook, sys.excepthook = sys.excepthook, _quiet_interrupt


def watch_if_named_on_the_command_line(task: luigi.Task) -> None:
    """Notes the task the command line names (once, when it is made), for the command's last line and exit code."""
    command_line = luigi.cmdline_parser.CmdlineParser.get_instance()
    if command_line is None or command_line.known_args.root_task != task.task_family or _command:
        return
    core = luigi.interface.core()
    scheduler = (
        None if core.local_scheduler else core.scheduler_url or f"http://{core.scheduler_host}:{core.scheduler_port}/"
    )
    # Read now: at exit the command line's settings (and so the task's paths) are no longer at hand.
    _command.update(
        name=task.label(),
        task_id=task.task_id,
        outputs=luigi.task.flatten(task.output()),
        was_complete=task.complete(),
        scheduler=scheduler,
    )


def outcome(name: str, outputs: list, was_complete: bool, failed: list[str] = ()) -> str:
    """The command's last line; `failed`: the target's tasks the central scheduler holds as failed."""
    where = ", ".join(target.path for target in outputs)
    if was_complete:
        return f"{name}: already complete, nothing to do ({where}); delete an output to build it again"
    if all(target.exists() for target in outputs):
        return f"{name}: done -> {where}"
    if _failures:
        reason = _failures[0]
    elif failed:
        reason = f"{failed[0]} failed (its error is in the log of the node that ran it)"
    else:
        reason = "a task it needs failed or could not run (see the errors above)"
    return f"{name}: not done: {reason}"


def servers() -> str:
    """Which vLLM servers the command sampled through, if any: ' (sampled through http://... : how it was found)'."""
    from retool.sampling.server import used

    return f" (sampled through {'; '.join(f'{url}: {how}' for url, how in used.items())})" if used else ""


def failed_in_the_scheduler(scheduler: str, task_id: str) -> list[str]:
    """The tasks of `task_id`'s graph that the central scheduler holds as failed or disabled (by any node)."""
    from luigi.rpc import RemoteScheduler

    try:
        graph = RemoteScheduler(scheduler, connect_timeout=5).dep_graph(task_id)
    except Exception:  # the scheduler is gone: nothing more to learn
        return []
    return [info["display_name"] for info in graph.values() if info["status"] in ("FAILED", "DISABLED")]


@atexit.register  # at import, so that it runs last: after Luigi's summary and every other handler
def _finish() -> None:
    """The command's last line, and an exit code that tells the truth: 0 when the target is complete, whoever
    ran its tasks (Luigi's own code counts what this process saw: another node's work reads as "already
    running" or "not run"); [retcode] task_failed when a task it needs failed here or on another node;
    INPUT_ERROR_EXIT when the command was refused for its input (Luigi would say unhandled_exception)."""
    if _input_errors and not (_command and all(target.exists() for target in _command["outputs"])):
        logging.shutdown()
        sys.stderr.flush()
        os._exit(INPUT_ERROR_EXIT)
    if not _command:
        return
    if _interrupted:
        print(interrupted_line(_command["name"]), flush=True)
        logging.shutdown()
        os._exit(130)  # 128 + SIGINT, as a shell reports it
    complete = all(target.exists() for target in _command["outputs"])
    scheduler = _command["scheduler"]
    failed = failed_in_the_scheduler(scheduler, _command["task_id"]) if scheduler and not complete else []
    print(outcome(_command["name"], _command["outputs"], _command["was_complete"], failed) + servers(), flush=True)
    if complete or failed:
        code = 0 if complete else luigi.retcodes.retcode().task_failed
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)


SUMMARY_HEADER = "===== Luigi Execution Summary ====="


class OnlyTheSummaryAtInfo(logging.Filter):
    """luigi.cfg logs Luigi at INFO for the sake of its execution summary: its other INFO lines (one per task
    scheduled, started and done) are left out unless RETOOL_DEBUG is set."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            record.levelno != logging.INFO or SUMMARY_HEADER in str(record.msg) or bool(os.environ.get("RETOOL_DEBUG"))
        )


logging.getLogger("luigi-interface").addFilter(OnlyTheSummaryAtInfo())
