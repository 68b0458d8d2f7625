"""From a trajectory's turns to one token sequence with per-token training fields."""

from __future__ import annotations

from dataclasses import dataclass

from jobs.rollout import Trajectory


class PrefixError(ValueError):
    """A turn's prompt does not extend the tokens of the trajectory so far."""


@dataclass(frozen=True)
class TokenSequence:
    tokens: list[int]  # P(1) + C(1) + D(1) + C(2) + ...
    old_logprobs: list[float]  # sampler logprob on completion tokens, 0 elsewhere
    is_action: list[bool]  # True exactly on tokens the model sampled


def trajectory_sequence(trajectory: Trajectory) -> TokenSequence:
    """Joins the turns, checking that every prompt extends everything before it; the tokens each
    prompt adds (first prompt, closing, observation, next-turn prefix) are context, not actions."""
    tokens: list[int] = []
    logprobs: list[float] = []
    is_action: list[bool] = []
    for number, turn in enumerate(trajectory.turns, start=1):
        if turn.prompt_tokens[: len(tokens)] != tokens:
            raise PrefixError(
                f"trajectory (question {trajectory.question_index}, branch {trajectory.group_index}): the prompt of turn "
                f"{number} does not extend the {len(tokens)} tokens of the turns before it"
            )
        context = turn.prompt_tokens[len(tokens) :]
        tokens += context + turn.completion_tokens
        logprobs += [0.0] * len(context) + turn.logprobs
        is_action += [False] * len(context) + [True] * len(turn.completion_tokens)
    return TokenSequence(tokens, logprobs, is_action)
