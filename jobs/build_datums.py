"""BuildDatums: the trajectories of the groups that train, as the trainer's token rows -> datums.parquet."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path

from retool.config.settings import StageSettings
from retool.files.layout import RoundPaths
from retool.files.tables import TRAJECTORIES, read_table, write_table_atomically
from retool.rollout.datums import datums_to_table, in_file_types
from retool.rollout.replay import replay_files, shard_of
from retool.rollout.stage_tables import describe_datums, trained_datums
from retool.run.shared import protocol_for


def build_datums(
    prompts: Path,
    shards: Sequence[Sequence[RoundPaths]],
    trajectories: Path,
    out: Path,
    stage: StageSettings,
    step: int,
) -> str:
    """`shards`: every round of every shard; `trajectories`: the step's scores, advantages and kept groups. One shard
    is replayed at a time (a question's group lies in one shard): the process holds one shard's round files and the
    step's datums, in the file's types, which the shards' (question, branch) orders merge into the file's."""
    settings = stage.settings
    scored, protocol = read_table(trajectories, TRAJECTORIES), protocol_for(settings.model)
    in_shard = shard_of(scored.column("question_index").to_numpy(), len(shards))  # each score's shard
    datums = []
    for shard, rounds in enumerate(shards):
        replayed = replay_files(prompts, rounds, protocol, settings.rollout, shard)
        built = trained_datums(replayed, scored.filter(in_shard == shard), settings.rollout.trainer_max_tokens)
        datums.append([in_file_types(datum) for datum in built])
    table = datums_to_table(
        list(heapq.merge(*datums, key=lambda d: (d.question_index, d.group_index))), step, stage.sampled_by
    )
    write_table_atomically(table, out)
    return describe_datums(table)
