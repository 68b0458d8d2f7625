"""A run's rollouts as cold-start conversations: the correct trajectories of training steps, turn by turn,
in the project's layout (what rejection-sampling fine-tuning trains on)."""

from __future__ import annotations

from collections.abc import Callable

from retool.data.conversations import Conversation, SolutionTurn
from retool.rollout.state import Trajectory


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
