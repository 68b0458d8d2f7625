"""The [sandbox] section: the limits and isolation of one call of the model's code."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import ClassVar

from retool.config.checks import require

OBSERVATIONS = ("seed", "notebook")  # [sandbox] observation: the formats of what a call reads back


@dataclass(frozen=True)
class SandboxConfig:
    SECTION: ClassVar[str] = "sandbox"  # its luigi.cfg section, named by `require`
    timeout_seconds: float = 10.0  # wall clock for one call, children included
    cpu_seconds: int = 0  # RLIMIT_CPU of the child; 0 = timeout_seconds, rounded up
    memory_mb: int = 2048  # RLIMIT_AS of the child (0 = no limit)
    file_mb: int = 64  # RLIMIT_FSIZE: caps every file the code writes, its output files included
    # How much of the end of stdout and of stderr is read back: the seed's 4 bytes a character of the 4096 a seed
    # observation keeps, so that its "[... truncated N chars ...]" counts what the seed's does
    output_tail_bytes: int = 16384
    max_workers: int = 4  # calls running at the same time, across threads and event loops
    max_processes: int = 64  # processes and threads of one call, counted by a pids cgroup
    contain: bool = True  # use the namespaces and cgroups this machine allows (see Containment)
    prewarmed: bool = True  # fork each call from a server that imported the math libraries (needs full containment)
    python: str = sys.executable  # interpreter for the child (needs the math libraries)
    # Comma-separated paths the code may read beside the interpreter and the system libraries (a data set
    # meant for the tool, say); everything else of the machine is absent from its view.
    extra_ro_paths: str = ""
    # What the model reads back from a call: seed (what the code prints, "" when nothing; on an error its stderr, or
    # "Error: process exited with code N." when there is none; a timeout as one line; the last 4096 characters) |
    # notebook (a trailing expression's value printed too, as a notebook cell does; stdout, then stderr; "(no output)")
    observation: str = "seed"

    def __post_init__(self) -> None:
        require(self, "observation", self.observation in OBSERVATIONS, f"one of {', '.join(OBSERVATIONS)}")
        for name in ("timeout_seconds", "file_mb", "output_tail_bytes", "max_workers", "max_processes"):
            require(self, name, getattr(self, name) > 0, "positive")
        for name in ("cpu_seconds", "memory_mb"):
            require(self, name, getattr(self, name) >= 0, ">= 0")
        missing = [p for p in self.readable_extra if not os.path.isabs(p) or not os.path.exists(p)]
        require(
            self,
            "extra_ro_paths",
            not missing,
            f"absolute paths of folders or files that exist; not {', '.join(missing)}",
        )

    @property
    def readable_extra(self) -> list[str]:
        return [path.strip() for path in self.extra_ro_paths.split(",") if path.strip()]

    @property
    def cpu_limit(self) -> int:
        return self.cpu_seconds or math.ceil(self.timeout_seconds)
