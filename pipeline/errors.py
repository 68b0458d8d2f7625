"""Input errors as one line. A bad setting, data file or run folder is found while the command builds
its task, before anything is scheduled: Luigi reports it as an uncaught exception with a traceback, which
this filter turns into the error's own message (RETOOL_DEBUG=1 keeps the traceback)."""

from __future__ import annotations

import logging
import os
import re

from luigi.rpc import RPCError

from retool.config.settings import SettingsError
from retool.data.examples import DataError
from retool.protocol.chat import TemplateError

INPUT_ERRORS = (SettingsError, DataError, TemplateError)


class InputErrorsAsOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if os.environ.get("RETOOL_DEBUG") or error is None:
            return True
        if isinstance(error, INPUT_ERRORS):
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


logging.getLogger("luigi-interface").addFilter(InputErrorsAsOneLine())
