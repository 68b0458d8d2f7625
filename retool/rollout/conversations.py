"""Cold-start conversations and rollouts, each as the other: a conversation replayed through the rollout's own
state machine (the assistant's text as the sampled completion, the recorded output as the observation), so that an
SFT sequence is token for token what a rollout with the same turns produces and its loss mask covers exactly the
tokens the model would have emitted; and a run's correct trajectories as conversations, turn by turn, in the
project's layout (what rejection-sampling fine-tuning trains on)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy
import pyarrow as pa

from retool.config.rollout import RolloutConfig
from retool.data.conversations import Conversation, SolutionTurn
from retool.data.examples import MathExample
from retool.files.tables import SFT_EXAMPLES, table_from_rows
from retool.protocol.chat import ChatProtocol
from retool.protocol.tool_calls import neutralise, tool_call_text
from retool.rollout.datums import build_datum, trajectory_sequence
from retool.rollout.state import Trajectory, apply_samples, finish_advance, plan_requests, start_trajectories
from retool.sampling.contract import SampledSequence
from retool.sandbox.observation import ExecutionResult


def assistant_text(turn: SolutionTurn, tool_format: str) -> str:
    return turn.text if turn.code is None else tool_call_text(turn.code, tool_format, turn.text.strip())


def replay_conversation(conversation: Conversation, protocol: ChatProtocol, config: RolloutConfig) -> Trajectory | None:
    """The trajectory a rollout produces when the model writes exactly these turns and the tool
    answers with the recorded output; None when it does not fit the rollout's budgets."""
    config = replace(config, group_size=1)
    example = MathExample(conversation.id, conversation.question, conversation.answer, conversation.data_source)
    (trajectory,) = start_trajectories([example], protocol, config)
    for turn in conversation.turns:
        requests = plan_requests([trajectory], protocol, config, step=0)
        tokens = protocol.encode(assistant_text(turn, protocol.tool_format))
        if turn.code is None or not protocol.stop_at_tool_call:
            tokens.append(protocol.end_of_turn_token)  # the turn ends on the end-of-turn token, as the model ends it
        if not requests or len(tokens) > requests[0].max_tokens:
            return None
        sequence = SampledSequence(tuple(tokens), (0.0,) * len(tokens), "stop")
        pendings = apply_samples([trajectory], requests, [[sequence]], protocol, config)
        if turn.code is None or not pendings:
            break
        # The recorded output is the observation the model read, as its sandbox wrote it ("" when nothing printed).
        output = turn.output or ""
        result = ExecutionResult("ok", output, "", 0.0, 0)
        finish_advance(pendings[0], result, neutralise(output, protocol.forbidden_strings), protocol, config)
    fits = trajectory.stop_reason == "answer" and len(trajectory.turns) == len(conversation.turns)
    return trajectory if fits else None


def sft_examples_table(
    conversations: Sequence[Conversation], protocol: ChatProtocol, config: RolloutConfig
) -> tuple[pa.Table, int]:
    """The SFT examples, one row per conversation that fits the run's budgets and turn limits (a
    rollout could not have produced the others), and how many did not fit."""
    rows = []
    for conversation in conversations:
        trajectory = replay_conversation(conversation, protocol, config)
        if trajectory is None:
            continue
        trajectory.advantage = 1.0  # build_datum puts it on exactly the tokens the model emitted
        datum = build_datum(trajectory, config.trainer_max_tokens)
        untrained = {number for number, turn in enumerate(conversation.turns) if not turn.trained}
        if untrained:  # turns kept as context only: their tokens leave the loss
            turn_of = trajectory_sequence(trajectory).turn_of[1:]
            datum = replace(datum, loss_mask=datum.loss_mask & ~numpy.isin(turn_of, sorted(untrained)))
        rows.append(
            {
                "example_id": conversation.id,
                "line": conversation.line,
                "num_turns": len(trajectory.turns),
                "code_calls": trajectory.code_calls,
                "input_tokens": datum.input_tokens,
                "target_tokens": datum.target_tokens,
                "loss_mask": datum.loss_mask,
                "num_tokens": datum.num_tokens,
            }
        )
    return table_from_rows(rows, SFT_EXAMPLES), len(conversations) - len(rows)


def solution_of(trajectory: Trajectory, step: int, decode: Callable[[list[int]], str]) -> Conversation:
    """The conversation a trajectory is: the text before each call (the call rendered again from its code), the
    observation as the model saw it, and the final answer as sampled (`decode`: its tokens, without special
    tokens, so the end of turn is the template's again)."""
    turns = []
    for turn in trajectory.turns:
        if turn.tool_call is not None:
            before_call = turn.text.partition("<tool_call>")[0].strip()
            turns.append(SolutionTurn(before_call, turn.tool_call.code, turn.tool_call.content))
        else:
            turns.append(SolutionTurn(decode(turn.completion_tokens)))
    example = trajectory.example
    return Conversation(
        f"{example.id}@step{step}.{trajectory.group_index}",
        0,
        example.question,
        example.answer,
        tuple(turns),
        example.data_source,
    )
