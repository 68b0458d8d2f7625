"""Faults a process survived, counted by cause: a stage's task records the count it added (in its timings file)
and the step's metrics sum them (`retries_<cause>` columns, docs/run-folder.md)."""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger(__name__)

# What is counted: a sampler call retried after an HTTP 5xx, a lost connection or a timeout; the run's vLLM server
# found dead and started again (or waited for, when another command owns it); the sandbox's fork server restarted.
CAUSES = ("sampler_server_error", "sampler_connection", "sampler_timeout", "sampler_server_restart",
          "sandbox_server_restart")  # fmt: skip

_counts: Counter[str] = Counter()
_lock = threading.Lock()  # the sampler's HTTP calls run in threads


def note_recovery(cause: str) -> None:
    if cause not in CAUSES:
        raise ValueError(f"unknown recovery cause {cause!r}; one of {', '.join(CAUSES)}")
    with _lock:
        _counts[cause] += 1


def recovery_counts() -> dict[str, int]:
    """This process's counts so far (a task's own: the difference between its end and its start)."""
    with _lock:
        return dict(_counts)


def added_since(start: dict[str, int]) -> dict[str, int]:
    added = Counter(recovery_counts())
    added.subtract(start)
    return {cause: count for cause, count in added.items() if count > 0}
