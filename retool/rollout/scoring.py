"""The end of a step, once every trajectory has ended: rewards, advantages within each question's group, and
which groups train."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from retool.data.reward import score_answer

if TYPE_CHECKING:
    from retool.rollout.state import Trajectory


def score_trajectory(trajectory: Trajectory) -> None:
    score = score_answer(trajectory.final_text, trajectory.example.answer)
    trajectory.reward, trajectory.valid_format, trajectory.correct, trajectory.extracted_answer = (
        score.reward,
        score.valid_format,
        score.correct,
        score.extracted_answer,
    )


def assign_group_advantages(trajectories: Sequence[Trajectory]) -> None:
    """A = R - mean(R of the same question in this step). Every reward must already be set."""
    unscored = [t for t in trajectories if t.reward is None]
    if unscored:
        raise ValueError(
            f"{len(unscored)} trajectories have no reward yet; score every trajectory before computing advantages"
        )
    groups: dict[int, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        groups[trajectory.question_index].append(trajectory)
    for group in groups.values():
        mean = sum(t.reward for t in group) / len(group)
        for trajectory in group:
            trajectory.advantage = trajectory.reward - mean


def keep_groups(trajectories: Sequence[Trajectory], limit: int | None) -> None:
    """Dynamic sampling (DAPO): with a `limit`, only the groups whose answers differ in correctness
    train, the first `limit` of them in question order; the others are drawn but not kept. Correctness,
    not reward: a group that differs only in a shaped part of the reward has nothing to teach about the
    answer. Without a limit every group is kept."""
    groups: dict[int, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        groups[trajectory.question_index].append(trajectory)
    kept = 0
    for _, group in sorted(groups.items()):
        mixed = len({t.correct for t in group}) > 1
        keep = limit is None or (mixed and kept < limit)
        kept += keep
        for trajectory in group:
            trajectory.kept = keep


def end_step(trajectories: Sequence[Trajectory], keep_limit: int | None = None) -> list[Trajectory]:
    """Once every trajectory has ended: every reward first, then advantages within each question's group, then
    which groups train (with a `keep_limit`, dynamic sampling). Returns them in (question, branch) order."""
    ordered = sorted(trajectories, key=lambda t: (t.question_index, t.group_index))
    for trajectory in ordered:
        score_trajectory(trajectory)
    assign_group_advantages(ordered)
    keep_groups(ordered, keep_limit)
    return ordered


def zero_variance_groups(question_rewards: Iterable[tuple[int, float]]) -> int:
    """Questions whose whole group got the same reward: advantage 0 everywhere, no learning signal.
    Takes (question_index, reward) pairs."""
    rewards: dict[int, set[float]] = defaultdict(set)
    for question_index, reward in question_rewards:
        rewards[question_index].add(reward)
    return sum(1 for values in rewards.values() if len(values) == 1)
