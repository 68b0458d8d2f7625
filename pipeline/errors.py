"""Input errors and faults as one line, and a misspelt option answered with the closest real one. A bad setting, data
file or run folder is found while the command builds its task, before anything is scheduled: Luigi reports
it as an uncaught exception with a traceback, which this filter turns into the error's own message
(RETOOL_DEBUG=1 keeps the traceback). A task that meets a fault it cannot survive fails with one line too: a full
disk (the file, and the space left), a sampling server gone or refusing (the server and its message), the trainer
out of memory again after re-planning (the micro-batch and the memory plan); it is retried as any failed task."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re

import luigi.cmdline_parser
from luigi.rpc import RPCError

from pipeline.outcome import INPUT_ERRORS, note_input_error
from retool.files.atomic import DiskFullError
from retool.sampling.contract import SamplerFailure
from retool.training.memory_plan import TrainerOutOfMemoryError

FAULTS = (DiskFullError, SamplerFailure, TrainerOutOfMemoryError)  # not input errors: the exit code stays task_failed


class ErrorsAsOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if os.environ.get("RETOOL_DEBUG") or error is None:
            return True
        if isinstance(error, INPUT_ERRORS):
            note_input_error(error)
            record.msg, record.args, record.exc_info, record.exc_text = str(error), (), None, None
        elif isinstance(error, FAULTS):
            record.msg, record.args, record.exc_info, record.exc_text = str(error), (), None, None
        elif isinstance(error, RPCError):
            record.msg, record.args, record.exc_info, record.exc_text = unreachable(error), (), None, None
        elif str(record.msg).startswith("Failed connecting to remote scheduler"):  # a retry: its cause in a line
            record.msg, record.args = f"{record.msg % record.args} ({error.__class__.__name__}); retrying", ()
            record.exc_info, record.exc_text = None, None
        return True


def unreachable(error: RPCError) -> str:
    """A central scheduler that does not answer, by its address."""
    address = re.search(r"'(https?://[^']*)'", str(error))
    where = address.group(1) if address else "the configured address"
    cause = f" ({error.sub_exception.__class__.__name__})" if error.sub_exception is not None else ""
    return (
        f"the central scheduler at {where} does not answer{cause}: start luigid there (see docs/multi-node.md), "
        "or name the right one with --scheduler-host and --scheduler-port"
    )


logging.getLogger("luigi-interface").addFilter(ErrorsAsOneLine())


class SuggestingParser(argparse.ArgumentParser):
    """Luigi's command-line parser, naming the closest real option of a misspelt one."""

    def error(self, message: str):
        hints = []
        if message.startswith("unrecognized arguments"):
            options = [option for action in self._actions for option in action.option_strings]
            for unknown in re.findall(r"--[\w-]+", message):
                match = difflib.get_close_matches(unknown, options, n=1)
                hints += [f"{unknown}: did you mean {match[0]}?"] if match else []
        super().error("; ".join([message, *hints]))


_build_parser = luigi.cmdline_parser.CmdlineParser._build_parser


def _build_suggesting_parser(*args, **kwargs) -> argparse.ArgumentParser:
    parser = _build_parser(*args, **kwargs)
    parser.__class__ = SuggestingParser  # Luigi builds a plain ArgumentParser and offers no hook for its errors
    return parser


luigi.cmdline_parser.CmdlineParser._build_parser = staticmethod(_build_suggesting_parser)
