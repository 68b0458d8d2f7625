"""A step's datums.parquet: its shards' datums joined while the update trains (TrainStep does it beside the update,
so none waits for it), its wall time recorded in the step's timings as the stage BuildDatums."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import StageSettings
from retool.evaluation.metrics import record_stage_seconds
from retool.files.tables import DATUMS, parquet_seconds, read_table
from retool.rollout.datums import step_datums, write_datums
from retool.rollout.stage_tables import describe_datums


def join_step_datums(shards: Sequence[Path], out: Path, stage: StageSettings, step: int, timings: Path) -> str:
    """`shards`: every shard's datums.parquet, merged in (question, branch) order into the step's (`step_datums`;
    Arrow's `take` on list columns costs seconds a step). Its wall time goes in the step's `timings`."""
    started, parquet = time.perf_counter(), parquet_seconds()
    datums = step_datums([read_table(path, DATUMS) for path in shards])
    table = write_datums(datums, step, stage.sampled_by, out)
    spent = (time.perf_counter() - started, parquet_seconds() - parquet)
    record_stage_seconds(timings, "BuildDatums", "BuildDatums", *spent, {})
    return describe_datums(table)
