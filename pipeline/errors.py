"""Input errors as one line. A bad setting, data file or run folder is found while the command builds
its task, before anything is scheduled: Luigi reports it as an uncaught exception with a traceback, which
this filter turns into the error's own message (RETOOL_DEBUG=1 keeps the traceback)."""

from __future__ import annotations

import logging
import os

from retool.config.settings import SettingsError
from retool.data.examples import DataError
from retool.protocol.chat import TemplateError

INPUT_ERRORS = (SettingsError, DataError, TemplateError)


class InputErrorsAsOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, INPUT_ERRORS) and not os.environ.get("RETOOL_DEBUG"):
            record.msg, record.args, record.exc_info, record.exc_text = str(error), (), None, None
        return True


logging.getLogger("luigi-interface").addFilter(InputErrorsAsOneLine())
