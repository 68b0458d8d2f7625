"""The table each rollout stage writes, from the trajectories `replay` rebuilt from the files before it (the
state of a round is never stored separately), by the same steps as rollout_in_memory; and the one-line
summary of each table for the log."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa

from retool.config.rollout import RolloutConfig
from retool.data.examples import MathExample
from retool.files.tables import DATUMS, OBSERVATIONS, PROMPTS, SAMPLES, TRAJECTORIES, table_from_rows
from retool.protocol.chat import ChatProtocol
from retool.rollout.datums import build_datums, trajectory_sequence
from retool.rollout.replay import StaleInputError
from retool.rollout.scoring import end_step
from retool.rollout.state import (
    Trajectory,
    apply_results,
    apply_samples,
    plan_requests,
    sampling_settings,
)
from retool.sampling.contract import SampledSequence, Sampler, SampleRequest, sample_checked


def prompts_table(examples: Sequence[MathExample], protocol: ChatProtocol, step: int) -> pa.Table:
    rows = []
    for question_index, example in enumerate(examples):
        rows.append(
            {
                "step": step,
                "question_index": question_index,
                "example_id": example.id,
                "question": example.question,
                "answer": example.answer,
                "data_source": example.data_source,
                "prompt_tokens": protocol.build_prompt(protocol.initial_messages(example.question)),
            }
        )
    return table_from_rows(rows, PROMPTS)


def samples_table(
    trajectories: Sequence[Trajectory],
    get_sampler: Callable[[], Sampler],
    protocol: ChatProtocol,
    config: RolloutConfig,
    step: int,
    round_index: int,
) -> pa.Table:
    """SampleRound: one row per sampled sequence for every live trajectory with budget left. The
    engine is only loaded when there is something to sample."""
    requests = plan_requests(trajectories, protocol, config, step)
    replies = sample_checked(get_sampler(), requests, sampling_settings(config, protocol)) if requests else []
    rows = []
    for request, sequences in zip(requests, replies, strict=True):
        for group_index, sequence in zip(request.group_indices, sequences, strict=True):
            rows.append(
                {
                    "step": step,
                    "round": round_index,
                    "question_index": request.question_index,
                    "group_index": group_index,
                    "prompt_tokens": list(request.prompt_tokens),
                    "completion_tokens": list(sequence.tokens),
                    "logprobs": list(sequence.logprobs),
                    "text": protocol.decode(list(sequence.tokens)).strip(),
                    "finish_reason": sequence.finish_reason,
                    "seed": request.seed,
                }
            )
    return table_from_rows(rows, SAMPLES)


def _replies_from_samples(
    requests: Sequence[SampleRequest], samples: pa.Table, round_index: int
) -> list[list[SampledSequence]]:
    rows = {(row["question_index"], row["group_index"]): row for row in samples.to_pylist()}
    expected = {(r.question_index, g) for r in requests for g in r.group_indices}
    if set(rows) != expected:
        raise StaleInputError(
            f"round {round_index}: samples.parquet holds branches {sorted(rows)} but the state asks for "
            f"{sorted(expected)}; re-run its SampleRound"
        )
    replies = []
    for request in requests:
        sequences = []
        for group_index in request.group_indices:
            row = rows[(request.question_index, group_index)]
            if row["seed"] != request.seed or row["prompt_tokens"] != list(request.prompt_tokens):
                raise StaleInputError(
                    f"round {round_index}: samples for question {request.question_index} branch {group_index} were "
                    "drawn from another prompt or seed; re-run its SampleRound"
                )
            sequences.append(
                SampledSequence(tuple(row["completion_tokens"]), tuple(row["logprobs"]), row["finish_reason"])
            )
        replies.append(sequences)
    return replies


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
    requests = plan_requests(trajectories, protocol, config, step)  # the same plan SampleRound made
    pendings = apply_samples(
        trajectories, requests, _replies_from_samples(requests, samples, round_index), protocol, config
    )
    apply_results(pendings, sandbox.run_many([p.code for p in pendings]), sandbox, protocol, config)
    return table_from_rows([observation_row(t, step, round_index) for t in live], OBSERVATIONS)


def observation_row(trajectory: Trajectory, step: int, round_index: int) -> dict:
    sampled = len(trajectory.turns) == round_index + 1
    turn = trajectory.turns[-1] if sampled else None
    call = turn.tool_call if turn else None
    return {
        "step": step,
        "round": round_index,
        "question_index": trajectory.question_index,
        "group_index": trajectory.group_index,
        "kind": turn.kind if turn else None,
        "code": call.code if call else None,
        "call_id": call.call_id if call else None,
        "exec_status": call.status if call else None,
        "exec_seconds": call.seconds if call else None,
        "tool_content": call.content if call else None,
        "next_prompt_tokens": trajectory.next_prompt_tokens,
        "code_calls": trajectory.code_calls,
        "turns": len(trajectory.turns),
        "done": trajectory.done,
        "stop_reason": trajectory.stop_reason,
        "final_text": trajectory.final_text if trajectory.done else None,
    }


def scored_table(trajectories: Sequence[Trajectory], step: int, keep_limit: int | None = None) -> pa.Table:
    """ScoreTrajectories: the end of the step (`end_step`) once the last round's files say every trajectory
    has ended."""
    live = [t for t in trajectories if not t.done]
    if live:
        raise StaleInputError(
            f"{len(live)} trajectories are still live after the last round; the round files are incomplete"
        )
    return trajectories_table(end_step(trajectories, keep_limit), step)


def trajectories_table(trajectories: Sequence[Trajectory], step: int) -> pa.Table:
    rows = []
    for t in trajectories:
        sequence = trajectory_sequence(t)
        rows.append(
            {
                "step": step,
                "question_index": t.question_index,
                "group_index": t.group_index,
                "example_id": t.example.id,
                "data_source": t.example.data_source,
                "answer": t.example.answer,
                "num_turns": len(t.turns),
                "code_calls": t.code_calls,
                "code_calls_ok": sum(turn.tool_call is not None and turn.tool_call.status == "ok" for turn in t.turns),
                "stop_reason": t.stop_reason,
                "final_text": t.final_text,
                "extracted_answer": t.extracted_answer,
                "valid_format": t.valid_format,
                "correct": t.correct,
                "reward": t.reward,
                "advantage": t.advantage,
                "kept": t.kept,
                "trajectory_tokens": len(sequence.tokens),
                "sampled_tokens": sum(sequence.is_action),
            }
        )
    return table_from_rows(rows, TRAJECTORIES)


def datums_table(trajectories: Sequence[Trajectory], scored: pa.Table, step: int, trainer_max_tokens: int) -> pa.Table:
    """BuildDatums: the replayed trajectories of the groups ScoreTrajectories kept, with the advantages it
    assigned."""
    rows = {(row["question_index"], row["group_index"]): row for row in scored.to_pylist()}
    for trajectory in trajectories:
        row = rows[(trajectory.question_index, trajectory.group_index)]
        trajectory.advantage, trajectory.kept = row["advantage"], row["kept"]
    ordered = sorted((t for t in trajectories if t.kept), key=lambda t: (t.question_index, t.group_index))
    rows = [
        {
            "step": step,
            "question_index": d.question_index,
            "group_index": d.group_index,
            "input_tokens": d.input_tokens,
            "target_tokens": d.target_tokens,
            "old_logprobs": d.old_logprobs,
            "advantages": d.advantages,
            "loss_mask": d.loss_mask,
            "num_tokens": d.num_tokens,
        }
        for d in build_datums(ordered, trainer_max_tokens)
    ]
    return table_from_rows(rows, DATUMS)


# One-line summaries of each stage's output, for the log.


def describe_prompts(prompts: pa.Table) -> str:
    tokens = sum(len(t) for t in prompts.column("prompt_tokens").to_pylist())
    return f"{prompts.num_rows} questions, {tokens} prompt tokens"


def describe_samples(samples: pa.Table) -> str:
    if not samples.num_rows:
        return "no rows (no trajectory was live)"
    tokens = sum(len(t) for t in samples.column("completion_tokens").to_pylist())
    return f"{samples.num_rows} sequences, {tokens} sampled tokens"


def describe_observations(observations: pa.Table) -> str:
    if not observations.num_rows:
        return "no rows (no trajectory was live)"
    statuses = [s for s in observations.column("exec_status").to_pylist() if s]
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
    tokens = sum(datums.column("num_tokens").to_pylist())
    loss_tokens = sum(sum(m) for m in datums.column("loss_mask").to_pylist())
    return f"{datums.num_rows} {kind}, {tokens} tokens, {loss_tokens} loss tokens"
