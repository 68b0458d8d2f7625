"""BuildDatums: the trajectories of the groups that train, as the trainer's token rows -> datums.parquet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from retool.config.settings import RunSettings
from retool.files.layout import RoundPaths
from retool.files.tables import DATUMS, TRAJECTORIES, read_table, table_from_rows, write_table_atomically
from retool.rollout.replay import replay_files, shard_of
from retool.rollout.stage_tables import datums_table, describe_datums, in_question_order
from retool.run.shared import policy_step, protocol_for


def build_datums(
    prompts: Path, shards: Sequence[Sequence[RoundPaths]], trajectories: Path, out: Path, run: RunSettings, step: int
) -> str:
    """`shards`: every round of every shard; `trajectories`: the step's scores, advantages and kept groups. One shard
    is replayed at a time (a question's group lies in one shard), so the process holds one shard's tokens as Python
    values and the step's datums as Arrow columns."""
    scored, protocol = read_table(trajectories, TRAJECTORIES), protocol_for(run.model)
    in_shard = shard_of(scored.column("question_index").to_numpy(), len(shards))  # each score's shard
    tables = []
    for shard, rounds in enumerate(shards):
        replayed = replay_files(prompts, rounds, protocol, run.rollout, shard)
        shard_scores = scored.filter(in_shard == shard)
        tables.append(
            datums_table(replayed, shard_scores, step, policy_step(run, step), run.rollout.trainer_max_tokens)
        )
    table = in_question_order(pa.concat_tables(tables) if tables else table_from_rows([], DATUMS))
    write_table_atomically(table, out)
    return describe_datums(table)
