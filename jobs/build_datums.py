"""ShardDatums: one shard's trajectories of the groups that train, as the trainer's token rows ->
shard=NN/datums.parquet, which the trainer reads (TrainStep joins the shards' into datums.parquet while it trains:
retool/run/joined_datums.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import StageSettings
from retool.files.layout import RoundPaths
from retool.files.tables import TRAJECTORIES, read_table
from retool.rollout.datums import write_datums
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
    table = write_datums(datums, step, stage.sampled_by, out)
    return describe_datums(table)
