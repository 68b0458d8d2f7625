"""A run folder checked from its files alone, step by step and shard by shard (one shard's rounds in memory at a
time): each rule of retool/verify/findings.py RULES, with what it checked and the rows that broke it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pyarrow.compute as pc

from retool.config.settings import StageSettings, training_stage
from retool.files.layout import TRAJECTORIES_FILE, RunFolder, StepFolder
from retool.files.tables import DATUMS, TRAJECTORIES, read_table
from retool.protocol.chat import ChatProtocol
from retool.rollout.datums import datums_to_table, step_datums
from retool.rollout.stage_tables import merged_scores
from retool.run.setup import recorded_settings
from retool.run.shared import protocol_for
from retool.verify.findings import Finding, Report, compare_tables
from retool.verify.invariants import check_accounting, check_datums, check_rewards, check_rounds
from retool.verify.replay import DATUM_RULES, SCORE_RULES, check_shard
from retool.weights.checkpoint import Checkpoint


def verify_run(run_dir: Path, steps: Sequence[int] = ()) -> Report:
    """Every training step of the run (or `steps`) that has its trajectories, under the settings it froze."""
    settings = recorded_settings(run_dir)
    protocol = protocol_for(settings.model)
    folder, report = RunFolder(run_dir), Report()
    for step in steps or folder.steps_with(TRAJECTORIES_FILE):
        if not folder.step(step).trajectories.exists():
            report.add(Finding("accounting", str(folder.step(step).trajectories), "no such file", step))
            continue
        verify_step(folder.step(step), training_stage(settings, step), protocol, step, report)
    return report


def verify_step(folder: StepFolder, stage: StageSettings, protocol: ChatProtocol, step: int, report: Report) -> None:
    check_accounting(folder, stage, step, report)
    check_rounds(folder, stage, protocol, step, report)
    check_rewards(folder, stage, step, report)
    shards = range(stage.settings.rollout.shards)
    # The step's scores: its shards' joined, with the groups that train chosen over the whole step.
    scores = read_table(folder.trajectories, TRAJECTORIES)
    merged = merged_scores(
        [read_table(folder.scored(shard), TRAJECTORIES) for shard in shards], stage.settings.data.keep_limit
    )
    compare_tables(SCORE_RULES, merged, scores, folder.trajectories, report, step)
    for shard in shards:
        check_shard(folder, stage, protocol, scores, shard, step, report)
        check_datums(folder, stage, shard, step, report)
    if folder.datums.exists():
        joined = datums_to_table(
            step_datums([read_table(folder.shard_datums(s), DATUMS) for s in shards]), step, stage.sampled_by
        )
        compare_tables(DATUM_RULES, joined, read_table(folder.datums, DATUMS), folder.datums, report, step)
        check_checkpoint(folder, stage, step, report)


def check_checkpoint(folder: StepFolder, stage: StageSettings, step: int, report: Report) -> None:
    """A trained step's checkpoint, where there is one: marked (written to the end), its metrics those of the datums
    it trained on, and the sampler's logprobs within max_sampler_gap of the trainer's where the step measured them."""
    checkpoint, path = Checkpoint(folder.checkpoint), str(folder.checkpoint)
    if not folder.checkpoint.exists():  # not trained yet (a checkpoint is written whole, then renamed into place)
        return
    report.checked("checkpoints", 1)
    if not checkpoint.marker.exists() or not checkpoint.metrics.exists():
        report.add(
            Finding("checkpoints", path, "no checkpoint marker or metrics: the step never finished training", step)
        )
        return
    metrics = json.loads(checkpoint.metrics.read_text())
    datums = read_table(folder.datums, DATUMS, ["num_tokens", "loss_mask"])
    found = {
        "datums": datums.num_rows,
        "tokens": pc.sum(datums.column("num_tokens")).as_py() or 0,
        "loss_tokens": pc.sum(pc.cast(pc.list_flatten(datums.column("loss_mask")), "int64")).as_py() or 0,
    }
    for name, value in found.items():
        if metrics.get(name) != value:
            message = f"metrics.json says {name} {metrics.get(name)}, the step's datums.parquet has {value}"
            report.add(Finding("checkpoints", str(checkpoint.metrics), message, step, column=name))
    trainer, gap = stage.settings.trainer, metrics.get("logprob_gap", math.nan)
    checked = trainer.max_sampler_gap and trainer.objective == "ppo" and found["loss_tokens"]
    if checked and gap == gap and gap > trainer.max_sampler_gap:
        message = f"sampler gap {gap:.3g} over max_sampler_gap {trainer.max_sampler_gap}: another policy sampled"
        report.add(Finding("checkpoints", str(checkpoint.metrics), message, step, column="logprob_gap"))
