"""A trajectory in the rollout's Parquet files and back: each kind of row is written and read side by side, so
the two cannot drift apart (datums are written column by column: datums.py). The columns are the schemas of
retool/files/tables.py (tests/test_rows.py holds each mapping to its schema, column for column)."""

from __future__ import annotations

import numpy

from retool.data.examples import MathExample
from retool.data.frontier import Draw
from retool.protocol.chat import ChatProtocol
from retool.rollout.state import AssistantTurn, ToolCall, Trajectory
from retool.sampling.contract import SampledSequence, SampleRequest

# prompts.parquet: one question of the step and its first model input


def prompt_row(step: int, question_index: int, draw: Draw, prompt_tokens: list[int]) -> dict:
    example = draw.example
    return {
        "step": step,
        "question_index": question_index,
        "example_id": example.id,
        "question": example.question,
        "answer": example.answer,
        "data_source": example.data_source,
        "prompt_tokens": prompt_tokens,
        "pass_rate": draw.pass_rate,
        "draw_weight": draw.weight,
        "draw_reason": draw.reason,
    }


def example_of(row: dict) -> MathExample:
    return MathExample(row["example_id"], row["question"], row["answer"], row["data_source"])


# samples.parquet: one sampled turn of one branch


def sample_row(
    step: int,
    round_index: int,
    request: SampleRequest,
    group_index: int,
    sequence: SampledSequence,
    text: str,
    policy_step: int,
) -> dict:
    """`policy_step`: the RL step whose checkpoint the sampler was given (-1: the RL base)."""
    return {
        "step": step,
        "round": round_index,
        "question_index": request.question_index,
        "group_index": group_index,
        "prompt_tokens": list(request.prompt_tokens),
        "completion_tokens": list(sequence.tokens),
        "logprobs": list(sequence.logprobs),
        "text": text,
        "finish_reason": sequence.finish_reason,
        "seed": request.seed,
        "policy_step": policy_step,
    }


def turn_of(row: dict) -> AssistantTurn:
    """The turn as recorded before it was parsed (its kind and call come from the round's observations). A row
    read without the token columns gives a turn without tokens, and with their lengths where it has them."""
    return AssistantTurn(
        row.get("prompt_tokens"), row.get("completion_tokens"), row.get("logprobs"), row["text"], row["finish_reason"],
        row["seed"], prompt_length=row.get("prompt_length"), completion_length=row.get("completion_length"),
    )  # fmt: skip


def sequence_of(row: dict) -> SampledSequence:
    """The sampler's reply as the row keeps it."""
    tokens, logprobs = (numpy.asarray(row[name]).tolist() for name in ("completion_tokens", "logprobs"))  # or views
    return SampledSequence(tuple(tokens), tuple(logprobs), row["finish_reason"])


# observations.parquet: a branch's state after one round


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


def restore_observation(trajectory: Trajectory, row: dict, protocol: ChatProtocol) -> None:
    """The state `observation_row` recorded, put back on a trajectory whose round's turn is already appended."""
    if row["kind"] is not None:
        turn = trajectory.turns[-1]
        turn.kind = row["kind"]
        if row["call_id"] is not None:
            turn.tool_call = ToolCall(
                row["call_id"], row["code"], row["exec_status"], row["exec_seconds"], row["tool_content"]
            )
            if not row["done"]:  # executed and appended
                trajectory.messages.append(protocol.tool_message(row["tool_content"], row["call_id"]))
    trajectory.code_calls = row["code_calls"]
    trajectory.next_prompt_tokens = row.get("next_prompt_tokens")  # read from the last round only (see replay)
    if row["done"]:
        trajectory.done, trajectory.stop_reason, trajectory.final_text = True, row["stop_reason"], row["final_text"]


# trajectories.parquet: a finished trajectory, scored (read back by `restore_score`)


def trajectory_row(trajectory: Trajectory, step: int, policy_step: int) -> dict:
    """From the turns' lengths: scoring replays no token (ShardDatums checks that each prompt extends the last)."""
    return {
        "step": step,
        "question_index": trajectory.question_index,
        "group_index": trajectory.group_index,
        "example_id": trajectory.example.id,
        "data_source": trajectory.example.data_source,
        "answer": trajectory.example.answer,
        "num_turns": len(trajectory.turns),
        "code_calls": trajectory.code_calls,
        "code_calls_ok": trajectory.valid_code_calls(),
        "stop_reason": trajectory.stop_reason,
        "final_text": trajectory.final_text,
        "extracted_answer": trajectory.extracted_answer,
        "valid_format": trajectory.valid_format,
        "correct": trajectory.correct,
        "reward": trajectory.reward,
        "shaped_reward": trajectory.shaped_reward,
        "advantage": trajectory.advantage,
        "kept": trajectory.kept,
        "masked": trajectory.masked,
        "trajectory_tokens": trajectory.num_tokens(),
        "sampled_tokens": trajectory.sampled_tokens(),
        "policy_step": policy_step,
    }


def restore_score(trajectory: Trajectory, row: dict) -> None:
    """What the datums need of a trajectory's score: its advantage, whether its group trains and whether the loss
    leaves it out."""
    trajectory.advantage, trajectory.kept, trajectory.masked = row["advantage"], row["kept"], bool(row["masked"])


# datums.parquet: one trajectory as the trainer's token rows
