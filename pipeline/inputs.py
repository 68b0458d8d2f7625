"""A task's input and output targets as the paths its job takes."""

from __future__ import annotations

from pathlib import Path

import luigi

from retool.files.layout import RoundPaths


def path(target: luigi.LocalTarget) -> Path:
    return Path(target.path)


def round_paths(rounds: list[dict]) -> list[RoundPaths]:
    """The inputs of `RunTask.rounds` as paths."""
    return [RoundPaths(path(r["samples"]), path(r["observations"])) for r in rounds]


def checkpoint_of(inputs: dict) -> Path | None:
    """The checkpoint folder of a task's "policy" input (its marker's folder); None: the model setting."""
    return path(inputs["policy"]["checkpoint"]).parent if "policy" in inputs else None
