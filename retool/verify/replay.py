"""A shard's rollout made again from its files: replayed forward round by round through the stages' own functions,
fed the samples and tool outputs the rounds recorded, and what each stage would write from its inputs compared with
the file it wrote. A file edited, lost or written from other inputs shows as the first row where the two differ."""

from __future__ import annotations

import functools

import pyarrow as pa
import pyarrow.compute as pc

from retool.config.settings import StageSettings
from retool.files.layout import StepFolder
from retool.files.tables import DATUMS, OBSERVATIONS, SAMPLES, TRAJECTORIES, read_table
from retool.protocol.chat import ChatProtocol
from retool.rollout.replay import TOKEN_COLUMNS, StaleInputError, replay_files, shard_of
from retool.rollout.stage_tables import datums_table, observations_table, scored_table
from retool.rollout.state import REFUSED, Trajectory
from retool.sandbox.observation import ExecutionResult
from retool.verify.findings import Finding, Report, branches, compare_tables

# The rule each column of a stage's file answers to.
OBSERVATION_RULES = {
    "kind": "stops_and_budgets",
    "code_calls": "stops_and_budgets",
    "turns": "stops_and_budgets",
    "done": "stops_and_budgets",
    "stop_reason": "stops_and_budgets",
    "final_text": "stops_and_budgets",
    "code": "observation",
    "call_id": "observation",
    "exec_status": "observation",
    "tool_content": "observation",
}
SCORE_RULES = {
    **{name: "reward" for name in TRAJECTORIES.names if name not in ("step", "question_index", "group_index")},
    **{name: "stops_and_budgets" for name in ("num_turns", "code_calls", "code_calls_ok", "stop_reason")},
    **{name: "stops_and_budgets" for name in ("trajectory_tokens", "sampled_tokens")},
    "policy_step": "datums",
    "kept": "accounting",  # a shard's file keeps every group: the step's says which train
}
DATUM_RULES = {name: "datums" for name in DATUMS.names if name not in ("step", "question_index", "group_index")}


class RecordedSandbox:
    """The sandbox as a round's file recorded it: each call that ran answers with the output the model read, which,
    cut to fit already, fits again unchanged; a refused call never reaches a sandbox."""

    def __init__(self, observations: pa.Table) -> None:
        columns = ["call_id", "exec_status", "exec_seconds", "tool_content"]
        rows = observations.select(columns).to_pylist()
        self.ran = [row for row in rows if row["call_id"] is not None and row["exec_status"] != REFUSED]

    def run_many(self, codes) -> list[ExecutionResult]:
        # A call the file does not hold (the replay made more than the round did) answers with nothing: the
        # comparison of the round's rows then names the branch.
        results = [
            ExecutionResult(r["exec_status"], r["tool_content"] or "", "", r["exec_seconds"], 0) for r in self.ran
        ]
        missing = [ExecutionResult("error", "", "", 0.0, 1)] * max(0, len(codes) - len(results))
        return (results + missing)[: len(codes)]

    def observation(self, result: ExecutionResult) -> str:
        return result.stdout


def next_prompt_rule(extended: dict, branch: tuple[int, int], position: int | None) -> str:
    """A next prompt that differs within its turn's prompt and completion breaks the continuation; after them, in
    the observation rendered from the recorded tool output, the observation."""
    return "observation" if position is not None and position >= extended.get(branch, 0) else "continuation"


def replayed_rounds(
    folder: StepFolder, stage: StageSettings, protocol: ChatProtocol, shard: int, step: int, report: Report
) -> list[Trajectory] | None:
    """Shard `shard`'s trajectories after its last round, each round's observations compared with its file on the
    way; None where the replay cannot go on (a round's samples were drawn from another prompt)."""
    rollout = stage.settings.rollout
    try:
        trajectories = replay_files(folder.prompts, [], protocol, rollout, shard, "state")
    except StaleInputError as error:
        report.add(Finding("continuation", str(folder.prompts), str(error), step))
        return None
    for round_index, paths in enumerate(folder.rounds(shard, rollout.rounds)):
        samples, recorded = read_table(paths.samples, SAMPLES), read_table(paths.observations, OBSERVATIONS)
        sandbox = RecordedSandbox(recorded)
        try:
            derived = observations_table(trajectories, samples, sandbox, protocol, rollout, step, round_index)
        except StaleInputError as error:
            report.add(Finding("continuation", str(paths.samples), str(error), step, round=round_index))
            return None
        # The next prompt: its prompt and completion are the continuation's; what follows, the observation's.
        lengths = pc.add(*(pc.list_value_length(samples[name]) for name in TOKEN_COLUMNS[:2])).to_pylist()
        extended = dict(zip(branches(samples), lengths, strict=True))
        rules = {**OBSERVATION_RULES, "next_prompt_tokens": functools.partial(next_prompt_rule, extended)}
        compare_tables(rules, derived, recorded, paths.observations, report, step)
        report.checked("observation", recorded.num_rows)  # the other rules count these rows in invariants.py
    return trajectories


def check_shard(
    folder: StepFolder,
    stage: StageSettings,
    protocol: ChatProtocol,
    step_scores: pa.Table,
    shard: int,
    step: int,
    report: Report,
) -> None:
    """A shard's rounds, its scores and its datums, each as its stage would write it from the files before it."""
    settings = stage.settings
    trajectories = replayed_rounds(folder, stage, protocol, shard, step, report)
    if trajectories is None:
        return
    try:
        scored = scored_table(
            trajectories, step, stage.sampled_by, None, settings.reward, settings.rollout.max_trajectory_tokens
        )
    except StaleInputError as error:  # a branch still live after the last round
        report.add(Finding("stops_and_budgets", str(folder.scored(shard)), str(error), step))
        return
    recorded = read_table(folder.scored(shard), TRAJECTORIES)
    compare_tables(SCORE_RULES, scored, recorded, folder.scored(shard), report, step)
    if not folder.shard_datums(shard).exists():  # an evaluation, or a step not trained yet
        return
    in_shard = shard_of(step_scores.column("question_index").to_numpy(), settings.rollout.shards) == shard
    derived = datums_table(
        trajectories, step_scores.filter(in_shard), step, stage.sampled_by, settings.rollout.trainer_max_tokens
    )
    found = read_table(folder.shard_datums(shard), DATUMS)
    compare_tables(DATUM_RULES, derived, found, folder.shard_datums(shard), report, step)
