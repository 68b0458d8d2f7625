"""ShardDatums: one shard's trajectories of the groups that train, as the trainer's token rows ->
shard=NN/datums.parquet; BuildDatums: the shards' together -> datums.parquet."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import StageSettings
from retool.files.layout import RoundPaths
from retool.files.tables import DATUMS, TRAJECTORIES, read_table, write_table_atomically
from retool.rollout.datums import datums_from_table, datums_to_table
from retool.rollout.replay import replay_files, shard_of
from retool.rollout.stage_tables import describe_datums, trained_datums
from retool.run.shared import protocol_for

SCORE_COLUMNS = ["question_index", "group_index", "advantage", "kept", "masked"]  # what a datum takes of its score


def shard_datums(
    prompts: Path,
    rounds: Sequence[RoundPaths],
    trajectories: Path,
    out: Path,
    stage: StageSettings,
    step: int,
    shard: int,
) -> str:
    """`rounds`: every round of shard `shard`; `trajectories`: the step's scores, advantages and kept groups. The
    process holds one shard's round files and its datums, in the file's types."""
    settings = stage.settings
    scored = read_table(trajectories, TRAJECTORIES, SCORE_COLUMNS)
    in_shard = shard_of(scored.column("question_index").to_numpy(), settings.rollout.shards) == shard
    replayed = replay_files(prompts, rounds, protocol_for(settings.model), settings.rollout, shard)
    datums = trained_datums(replayed, scored.filter(in_shard), settings.rollout.trainer_max_tokens)
    table = datums_to_table(datums, step, stage.sampled_by)
    write_table_atomically(table, out)
    return describe_datums(table)


def build_datums(shards: Sequence[Path], out: Path, stage: StageSettings, step: int) -> str:
    """`shards`: every shard's datums.parquet, merged in (question, branch) order: each shard's rows are in that
    order, and a merge of their rows' numpy views costs no copy of a token until the file's columns are built
    (Arrow's `take` on list columns costs seconds a step)."""
    parts = [datums_from_table(read_table(path, DATUMS)) for path in shards]
    merged = heapq.merge(*parts, key=lambda datum: (datum.question_index, datum.group_index))
    table = datums_to_table(list(merged), step, stage.sampled_by)
    write_table_atomically(table, out)
    return describe_datums(table)
