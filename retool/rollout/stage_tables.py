"""The table each rollout stage writes, from the trajectories `replay` rebuilt from the files before it (the
state of a round is never stored separately), by the same steps as rollout_in_memory; and the one-line
summary of each table for the log."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy
import pyarrow as pa
import pyarrow.compute as pc

from retool.config.reward import RewardConfig
from retool.config.rollout import RolloutConfig
from retool.data.frontier import Draw
from retool.files.tables import OBSERVATIONS, PROMPTS, SAMPLES, TRAJECTORIES, table_from_rows
from retool.protocol.chat import ChatProtocol
from retool.rollout.datums import Datum, datums_of, datums_to_table
from retool.rollout.replay import StaleInputError, sample_rows
from retool.rollout.rows import (
    observation_row,
    prompt_row,
    restore_score,
    sample_row,
    sequence_of,
    trajectory_row,
)
from retool.rollout.scoring import end_step, kept_questions
from retool.rollout.state import (
    REFUSED,
    PendingExecution,
    Trajectory,
    apply_results,
    begin_advance,
    execute,
    plan_requests,
    sampling_settings,
    turn_seed,
    turn_text,
)
from retool.sampling.contract import Sampler, sample_checked


def prompts_table(draws: Sequence[Draw], protocol: ChatProtocol, step: int) -> pa.Table:
    rows = [
        prompt_row(step, index, draw, protocol.build_prompt(protocol.initial_messages(draw.example.question)))
        for index, draw in enumerate(draws)
    ]
    return table_from_rows(rows, PROMPTS)


def samples_table(
    trajectories: Sequence[Trajectory],
    get_sampler: Callable[[], Sampler],
    protocol: ChatProtocol,
    config: RolloutConfig,
    step: int,
    round_index: int,
    policy_step: int,
) -> pa.Table:
    """SampleRound: one row per sampled sequence for every live trajectory with budget left, sampled from step
    `policy_step`'s checkpoint (-1: the RL base). The engine is only loaded when there is something to sample."""
    requests = plan_requests(trajectories, protocol, config, step)
    replies = sample_checked(get_sampler(), requests, sampling_settings(config, protocol)) if requests else []
    rows = [
        sample_row(step, round_index, request, group_index, sequence, turn_text(protocol, sequence), policy_step)
        for request, sequences in zip(requests, replies, strict=True)
        for group_index, sequence in zip(request.group_indices, sequences, strict=True)
    ]
    return table_from_rows(rows, SAMPLES)


def _sampled_turns(
    live: Sequence[Trajectory],
    samples: pa.Table,
    protocol: ChatProtocol,
    config: RolloutConfig,
    step: int,
    round_index: int,
) -> list[PendingExecution]:
    """What SampleRound's plan asked for and samples.parquet holds, applied to the live trajectories in (question,
    branch) order, as apply_samples does. A branch without a sample must be one the plan ended for want of budget
    (plan_requests ends it here too); only those branches' budgets are computed again. Each sample's prompt and seed
    are checked against the state; its text is SampleRound's turn_text of the same tokens, not decoded again."""
    rows = {(row["question_index"], row["group_index"]): row for row in sample_rows(samples)}
    branches = {(t.question_index, t.group_index): t for t in live}
    unsampled = [t for branch, t in branches.items() if branch not in rows]
    asked = {(r.question_index, g) for r in plan_requests(unsampled, protocol, config, step) for g in r.group_indices}
    if asked or not set(rows) <= set(branches):
        raise StaleInputError(
            f"round {round_index}: samples.parquet holds branches {sorted(rows)} but the state asks for "
            f"{sorted(set(branches) - set(unsampled) | asked)}; re-run its SampleRound"
        )
    pendings = []
    for branch in sorted(rows):
        trajectory, row = branches[branch], rows[branch]
        seed = turn_seed(trajectory, config, step)
        if row["seed"] != seed or not numpy.array_equal(row["prompt_tokens"], trajectory.next_prompt_tokens):
            raise StaleInputError(
                f"round {round_index}: samples for question {branch[0]} branch {branch[1]} were drawn from another "
                "prompt or seed; re-run its SampleRound"
            )
        pending = begin_advance(trajectory, sequence_of(row), seed, protocol, config, row["text"])
        if pending is not None:
            pendings.append(pending)
    return pendings


def observations_table(
    trajectories: Sequence[Trajectory],
    samples: pa.Table,
    sandbox,
    protocol: ChatProtocol,
    config: RolloutConfig,
    step: int,
    round_index: int,
) -> pa.Table:
    """ExecuteRound: parses this round's samples, runs the tool calls, and records the state of every
    trajectory that was live at the start of the round."""
    live = [t for t in trajectories if not t.done]
    pendings = _sampled_turns(live, samples, protocol, config, step, round_index)
    apply_results(pendings, execute(pendings, sandbox), sandbox, protocol, config)
    return table_from_rows([observation_row(t, step, round_index) for t in live], OBSERVATIONS)


def scored_table(
    trajectories: Sequence[Trajectory],
    step: int,
    policy_step: int,
    keep_limit: int | None = None,
    reward: RewardConfig = RewardConfig(),
    max_tokens: int = 0,
) -> pa.Table:
    """ScoreTrajectories: the end of the step (`end_step`) once the last round's files say every trajectory
    has ended."""
    live = [t for t in trajectories if not t.done]
    if live:
        raise StaleInputError(
            f"{len(live)} trajectories are still live after the last round; the round files are incomplete"
        )
    return trajectories_table(end_step(trajectories, keep_limit, reward, max_tokens), step, policy_step)


def merged_scores(parts: Sequence[pa.Table], keep_limit: int | None = None) -> pa.Table:
    """ScoreTrajectories: the shards' scored trajectories (each shard's scored with every group kept: a question's
    group lies in one shard) in (question, branch) order, and which groups train over the whole step (with a
    `keep_limit`, dynamic sampling counts the step's groups in question order)."""
    table = pa.concat_tables(parts).sort_by([("question_index", "ascending"), ("group_index", "ascending")])
    kept = kept_questions(
        zip(table.column("question_index").to_pylist(), table.column("correct").to_pylist(), strict=True), keep_limit
    )
    if kept is None:
        return table
    in_kept_group = pc.is_in(table.column("question_index"), value_set=pa.array(sorted(kept), pa.int32()))
    return table.set_column(table.schema.get_field_index("kept"), table.schema.field("kept"), in_kept_group)


def trajectories_table(trajectories: Sequence[Trajectory], step: int, policy_step: int) -> pa.Table:
    return table_from_rows([trajectory_row(t, step, policy_step) for t in trajectories], TRAJECTORIES)


def datums_table(
    trajectories: Sequence[Trajectory], scored: pa.Table, step: int, policy_step: int, trainer_max_tokens: int
) -> pa.Table:
    """The datums of `trained_datums`, as a datums.parquet table."""
    return datums_to_table(trained_datums(trajectories, scored, trainer_max_tokens), step, policy_step)


def trained_datums(trajectories: Sequence[Trajectory], scored: pa.Table, trainer_max_tokens: int) -> list[Datum]:
    """The replayed trajectories of the groups ScoreTrajectories kept (but those it masked), with the advantages it
    assigned, as datums in (question, branch) order."""
    columns = ["question_index", "group_index", "advantage", "kept", "masked"]
    rows = {(row["question_index"], row["group_index"]): row for row in scored.select(columns).to_pylist()}
    for trajectory in trajectories:
        restore_score(trajectory, rows[(trajectory.question_index, trajectory.group_index)])
    ordered = sorted(
        (t for t in trajectories if t.kept and not t.masked), key=lambda t: (t.question_index, t.group_index)
    )
    return datums_of(ordered, trainer_max_tokens)


# One-line summaries of each stage's output, for the log.


def describe_prompts(prompts: pa.Table) -> str:
    tokens = _total_length(prompts.column("prompt_tokens"))
    rates = [rate for rate in prompts.column("pass_rate").to_pylist() if rate is not None]
    drawn = f", drawn at estimated pass rates {min(rates):.2f} to {max(rates):.2f}" if rates else ""
    return f"{prompts.num_rows} questions, {tokens} prompt tokens{drawn}"


def describe_samples(samples: pa.Table) -> str:
    if not samples.num_rows:
        return "no rows (no trajectory was live)"
    tokens = _total_length(samples.column("completion_tokens"))
    return f"{samples.num_rows} sequences, {tokens} sampled tokens"


def describe_observations(observations: pa.Table) -> str:
    if not observations.num_rows:
        return "no rows (no trajectory was live)"
    statuses = [s for s in observations.column("exec_status").to_pylist() if s and s != REFUSED]
    done = sum(observations.column("done").to_pylist())
    calls = f"{len(statuses)} tool calls ({statuses.count('ok')} ok)"
    return f"{observations.num_rows} trajectories, {calls}, {done} ended"


def describe_trajectories(trajectories: pa.Table) -> str:
    if not trajectories.num_rows:
        return "no rows"
    rewards = trajectories.column("reward").to_pylist()
    correct = sum(trajectories.column("correct").to_pylist())
    groups = set(zip(trajectories.column("question_index").to_pylist(), trajectories.column("kept").to_pylist()))
    kept = f", {sum(k for _, k in groups)} of {len(groups)} groups kept" if not all(k for _, k in groups) else ""
    return (
        f"{trajectories.num_rows} trajectories, reward mean {sum(rewards) / len(rewards):+.3f}, correct {correct}{kept}"
    )


def describe_datums(datums: pa.Table, kind: str = "datums") -> str:
    """Datums, or (kind) the cold start's SFT examples, which have the same token and mask columns."""
    if not datums.num_rows:
        return "no rows"
    tokens = pc.sum(datums.column("num_tokens")).as_py()
    loss_tokens = pc.sum(pc.list_flatten(datums.column("loss_mask")).cast(pa.int64())).as_py()
    return f"{datums.num_rows} {kind}, {tokens} tokens, {loss_tokens} loss tokens"


def _total_length(column: pa.ChunkedArray) -> int:
    """Items in every row of a list column (tokens, without a Python value per token)."""
    return pc.sum(pc.list_value_length(column)).as_py() or 0
