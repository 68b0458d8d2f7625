"""The rules checked straight on a step's files, apart from the stages' code: which rows each file holds, each
datum against the samples it was built from, each reward against its final text, each advantage against its group.
A fault shared by a stage and its replay (a logprob moved off its token while the datums are built) shows here."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy

from retool.config.settings import StageSettings
from retool.files.layout import StepFolder
from retool.files.tables import DATUMS, OBSERVATIONS, PROMPTS, SAMPLES, TRAJECTORIES, read_table, row_views
from retool.protocol.chat import ChatProtocol
from retool.rollout.replay import sample_rows
from retool.rollout.state import turn_text
from retool.sampling.contract import SampledSequence
from retool.verify.findings import Finding, Report, branches, first_difference

Branch = tuple[int, int]  # (question_index, group_index)
ADVANTAGE_TOLERANCE = 1e-5  # float32 rounding of a mean over a group


def check_once(file: Path, found: list[Branch], expected: set[Branch], step: int, report: Report, round_index=None):
    """Each expected branch exactly once in `file`, and no other."""
    counts = Counter(found)
    problems = [(branch, "doubled") for branch, count in counts.items() if count > 1]
    problems += [(branch, "missing") for branch in expected - counts.keys()]
    problems += [(branch, "not expected here") for branch in counts.keys() - expected]
    for (question, group), what in sorted(problems):
        report.add(Finding("accounting", str(file), f"row {what}", step, question, group, round_index))
    report.checked("accounting", len(found))


def check_accounting(folder: StepFolder, stage: StageSettings, step: int, report: Report) -> None:
    """Prompts x group_size branches: each once in round 0, each round's live ones once in the next, each once in
    every shard's scores and the step's, and in the datums exactly those that train."""
    rollout = stage.settings.rollout
    questions = read_table(folder.prompts, PROMPTS, ["question_index"]).column("question_index").to_pylist()
    grid = {(question, group) for question in questions for group in range(rollout.group_size)}
    scores = read_table(folder.trajectories, TRAJECTORIES)
    check_once(folder.trajectories, branches(scores), grid, step, report)
    trains = {
        (row["question_index"], row["group_index"])
        for row in scores.to_pylist()
        if row["kept"] and not row["masked"] and row["advantage"] and row["num_turns"]
    }
    for shard in range(rollout.shards):
        live = {branch for branch in grid if branch[0] % rollout.shards == shard}
        everyone = set(live)
        for round_index, paths in enumerate(folder.rounds(shard, rollout.rounds)):
            observations = read_table(paths.observations, OBSERVATIONS, ["question_index", "group_index", "done"])
            check_once(paths.observations, branches(observations), live, step, report, round_index)
            sampled = branches(read_table(paths.samples, SAMPLES, ["question_index", "group_index"]))
            check_once(paths.samples, sampled, set(sampled) & live, step, report, round_index)
            done = observations.column("done").to_pylist()
            live = {branch for branch, ended in zip(branches(observations), done, strict=True) if not ended}
        check_once(
            folder.scored(shard), branches(read_table(folder.scored(shard), TRAJECTORIES)), everyone, step, report
        )
        if folder.shard_datums(shard).exists():
            found = branches(read_table(folder.shard_datums(shard), DATUMS, ["question_index", "group_index"]))
            check_once(folder.shard_datums(shard), found, trains & everyone, step, report)
    if folder.datums.exists():
        found = branches(read_table(folder.datums, DATUMS, ["question_index", "group_index"]))
        check_once(folder.datums, found, trains, step, report)
        if found != sorted(found):
            report.add(Finding("accounting", str(folder.datums), "rows not in (question, branch) order", step))


def check_rewards(folder: StepFolder, stage: StageSettings, step: int, report: Report) -> None:
    """Each reward the ±1 of its verdict; each advantage its shaped reward less its group's mean (over every branch
    of the question, as the step scored it)."""
    rows = read_table(folder.trajectories, TRAJECTORIES).to_pylist()
    groups: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["question_index"]].append(row)
        # Re-scored from the final text by the replay (retool/verify/replay.py); here the reward is its verdict's.
        if row["reward"] != (1.0 if row["correct"] else -1.0) or (row["correct"] and not row["valid_format"]):
            message = f"reward {row['reward']} with correct {row['correct']} and valid format {row['valid_format']}"
            report.add(
                Finding("reward", str(folder.trajectories), message, step, row["question_index"], row["group_index"])
            )
    for question, group in groups.items():
        mean = sum(row["shaped_reward"] for row in group) / len(group)
        for row in group:
            if abs(row["advantage"] - (row["shaped_reward"] - mean)) > ADVANTAGE_TOLERANCE:
                message = f"advantage {row['advantage']:.6g}, its group gives {row['shaped_reward'] - mean:.6g}"
                report.add(Finding("reward", str(folder.trajectories), message, step, question, row["group_index"]))
    report.checked("reward", len(rows))


def sampled_turns(folder: StepFolder, stage: StageSettings, shard: int) -> dict[Branch, list[dict]]:
    """Each branch's samples, round by round."""
    turns: dict[Branch, list[dict]] = defaultdict(list)
    for paths in folder.rounds(shard, stage.settings.rollout.rounds):
        samples = read_table(paths.samples, SAMPLES)
        views = {name: row_views(samples.column(name)) for name in ("prompt_tokens", "completion_tokens", "logprobs")}
        for index, branch in enumerate(branches(samples)):
            turns[branch].append({name: column[index] for name, column in views.items()})
    return turns


def check_rounds(folder: StepFolder, stage: StageSettings, protocol: ChatProtocol, step: int, report: Report):
    """Each turn's text its tokens' decoding, with a logprob a token; each turn within the token budgets; each
    trajectory within its calls; each observation within its tokens; done exactly when a stop reason is given."""
    rollout = stage.settings.rollout
    for shard in range(rollout.shards):
        for round_index, paths in enumerate(folder.rounds(shard, rollout.rounds)):
            for row in sample_rows(read_table(paths.samples, SAMPLES)):  # token columns as numpy views
                for rule, message in turn_problems(row, protocol, rollout):
                    report.add(Finding(rule, str(paths.samples), message, step, row["question_index"],
                                       row["group_index"], round_index))  # fmt: skip
                report.checked("continuation", 1, len(row["completion_tokens"]))
            for row in read_table(paths.observations, OBSERVATIONS).to_pylist():
                for rule, message in observation_problems(row, protocol, rollout):
                    report.add(Finding(rule, str(paths.observations), message, step, row["question_index"],
                                       row["group_index"], round_index))  # fmt: skip
                report.checked("stops_and_budgets", 1)


def turn_problems(row: dict, protocol: ChatProtocol, rollout) -> list[tuple[str, str]]:
    """(rule, what is wrong) of one sampled turn."""
    problems = []
    completion, prompt = row["completion_tokens"], row["prompt_tokens"]
    if row["text"] != turn_text(protocol, SampledSequence(tuple(completion), tuple(row["logprobs"]), "stop")):
        problems.append(("continuation", "the turn's text is not its tokens' decoding"))
    if len(row["logprobs"]) != len(completion):
        problems.append(("datums", f"{len(row['logprobs'])} logprobs for {len(completion)} sampled tokens"))
    if len(completion) > rollout.max_assistant_tokens:
        problems.append(("stops_and_budgets", f"{len(completion)} completion tokens over max_assistant_tokens"))
    if len(prompt) + len(completion) > rollout.max_trajectory_tokens:
        problems.append(("stops_and_budgets", f"{len(prompt) + len(completion)} tokens over max_trajectory_tokens"))
    return problems


def observation_problems(row: dict, protocol: ChatProtocol, rollout) -> list[tuple[str, str]]:
    """(rule, what is wrong) of one trajectory's state after a round."""
    problems = []
    if row["code_calls"] > rollout.max_code_calls:
        problems.append(("stops_and_budgets", f"{row['code_calls']} code calls over max_code_calls"))
    if row["tool_content"] and protocol.count_tokens(row["tool_content"]) > rollout.max_tool_response_tokens:
        problems.append(("observation", "an observation over max_tool_response_tokens"))
    if row["done"] != (row["stop_reason"] is not None):
        problems.append(("stops_and_budgets", f"done {row['done']} with stop reason {row['stop_reason']}"))
    return problems


def check_datums(folder: StepFolder, stage: StageSettings, shard: int, step: int, report: Report) -> None:
    """Each datum against its branch's samples: its tokens the last prompt and completion, shifted by one; its loss
    mask on the sampled tokens and only there; their logprobs the sampler's; the advantage on them, 0 elsewhere."""
    path = folder.shard_datums(shard)
    if not path.exists():
        return
    table = read_table(path, DATUMS)
    scores = read_table(folder.trajectories, TRAJECTORIES, ["question_index", "group_index", "advantage"])
    advantages = dict(zip(branches(scores), scores.column("advantage").to_pylist(), strict=True))
    turns = sampled_turns(folder, stage, shard)
    columns = {name: row_views(table.column(name)) for name in ("input_tokens", "target_tokens", "old_logprobs")}
    columns |= {name: row_views(table.column(name)) for name in ("advantages", "loss_mask")}
    policy_steps = table.column("policy_step").to_pylist()
    for index, branch in enumerate(branches(table)):
        datum = {name: column[index] for name, column in columns.items()}
        for column, position, message in datum_problems(datum, turns[branch], advantages[branch]):
            report.add(Finding("datums", str(path), message, step, branch[0], branch[1], None, position, column))
        if policy_steps[index] != stage.sampled_by:
            message = f"policy step {policy_steps[index]}, sampled by step {stage.sampled_by}'s checkpoint"
            report.add(Finding("datums", str(path), message, step, branch[0], branch[1], column="policy_step"))
        report.checked("datums", 1, len(datum["input_tokens"]))


def datum_problems(datum: dict, turns: list[dict], advantage: float) -> list[tuple[str, int | None, str]]:
    """(column, position, what is wrong) of one datum against its branch's samples and advantage."""
    inputs, targets, mask = datum["input_tokens"], datum["target_tokens"], numpy.asarray(datum["loss_mask"], bool)
    problems = []
    whole = numpy.concatenate([turns[-1]["prompt_tokens"], turns[-1]["completion_tokens"]]) if turns else []
    if (position := first_difference(whole[:-1], inputs)) is not None:
        problems.append(("input_tokens", position, "not the last prompt and completion"))
    if (position := first_difference(inputs[1:], targets[:-1])) is not None:
        problems.append(("target_tokens", position, "not the inputs shifted by one"))
    sampled = numpy.concatenate([turn["completion_tokens"] for turn in turns]) if turns else numpy.zeros(0)
    if (position := first_difference(sampled, targets[mask])) is not None:
        problems.append(("loss_mask", position, "the masked targets are not the sampled tokens"))
    logprobs = numpy.concatenate([turn["logprobs"] for turn in turns]) if turns else numpy.zeros(0)
    old = numpy.asarray(datum["old_logprobs"], numpy.float32)
    if (position := first_difference(logprobs.astype(numpy.float32), old[mask])) is not None:
        problems.append(("old_logprobs", position, "not the sampler's logprob of the same token"))
    if numpy.any(old[~mask]):
        problems.append(("old_logprobs", int(numpy.flatnonzero(old * ~mask)[0]), "a logprob off the loss mask"))
    advantages = numpy.asarray(datum["advantages"], numpy.float32)
    wrong = ~numpy.isclose(advantages, numpy.where(mask, advantage, 0.0), rtol=0, atol=ADVANTAGE_TOLERANCE)
    if numpy.any(wrong):
        problems.append(("advantages", int(numpy.flatnonzero(wrong)[0]), f"not the trajectory's {advantage:.6g}"))
    return problems
