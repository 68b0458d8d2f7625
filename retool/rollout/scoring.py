"""The end of a step, once every trajectory has ended: rewards, advantages within each question's group, and
which groups train."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from retool.config.reward import RewardConfig
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


ENDED_BY_THE_MODEL = ("answer", "invalid")  # stop reasons of a trajectory that no budget stopped


def shaped_reward(trajectory: Trajectory, reward: RewardConfig, max_tokens: int) -> float:
    """The reward the advantage is computed from: correctness (+1 / -1) with the [reward] section's terms."""
    shaped = trajectory.reward
    if not trajectory.correct and reward.wrong_answer_call_credit:
        # verl's ReTool recipe: a wrong answer that tried the tool scores a little above -1, at most the cap
        shaped = min(reward.wrong_answer_cap, shaped + reward.wrong_answer_call_credit * trajectory.code_calls)
    shaped += reward.valid_call_bonus * trajectory.valid_code_calls()
    if reward.overlong == "penalty":
        shaped += overlong_penalty(trajectory.num_tokens(), max_tokens, reward.overlong_buffer_tokens)
    return shaped


def overlong_penalty(tokens: int, budget: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to `buffer` tokens before the budget, then down linearly to -1 at it."""
    return -min(max(tokens - (budget - buffer), 0) / buffer, 1.0)


def assign_group_advantages(trajectories: Sequence[Trajectory]) -> None:
    """A = R - mean(R of the same question in this step), R the shaped reward. Every reward must already be set."""
    unscored = [t for t in trajectories if t.shaped_reward is None]
    if unscored:
        raise ValueError(
            f"{len(unscored)} trajectories have no reward yet; score every trajectory before computing advantages"
        )
    groups: dict[int, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        groups[trajectory.question_index].append(trajectory)
    for group in groups.values():
        mean = sum(t.shaped_reward for t in group) / len(group)
        for trajectory in group:
            trajectory.advantage = trajectory.shaped_reward - mean


def keep_groups(trajectories: Sequence[Trajectory], limit: int | None) -> None:
    """Marks each trajectory's group kept or not (`kept_questions`)."""
    kept = kept_questions([(t.question_index, t.correct) for t in trajectories], limit)
    for trajectory in trajectories:
        trajectory.kept = kept is None or trajectory.question_index in kept


def kept_questions(answers: Iterable[tuple[int, bool]], limit: int | None) -> set[int] | None:
    """Dynamic sampling (DAPO): with a `limit`, only the groups whose answers differ in correctness
    train, the first `limit` of them in question order; the others are drawn but not kept. Correctness,
    not reward: a group that differs only in a shaped part of the reward has nothing to teach about the
    answer. Without a limit every group is kept (None). `answers`: (question, correct) of each trajectory."""
    if limit is None:
        return None
    outcomes: dict[int, set[bool]] = defaultdict(set)
    for question, correct in answers:
        outcomes[question].add(bool(correct))
    mixed = [question for question, seen in sorted(outcomes.items()) if len(seen) > 1]
    return set(mixed[:limit])


def end_step(
    trajectories: Sequence[Trajectory],
    keep_limit: int | None = None,
    reward: RewardConfig = RewardConfig(),
    max_tokens: int = 0,
) -> list[Trajectory]:
    """Once every trajectory has ended: every reward first (shaped by `reward`; `max_tokens`: the trajectory budget
    its overlong penalty counts from), then advantages within each question's group, then which groups train
    (with a `keep_limit`, dynamic sampling) and which trajectories the loss leaves out ([reward] overlong = mask).
    Returns them in (question, branch) order."""
    ordered = sorted(trajectories, key=lambda t: (t.question_index, t.group_index))
    for trajectory in ordered:
        score_trajectory(trajectory)
        trajectory.shaped_reward = shaped_reward(trajectory, reward, max_tokens)
        trajectory.masked = reward.overlong == "mask" and trajectory.stop_reason not in ENDED_BY_THE_MODEL
    assign_group_advantages(ordered)
    keep_groups(ordered, keep_limit)
    return ordered


def trained_groups(rows: Iterable[dict]) -> tuple[int, int]:
    """Of a step's trajectories (trajectories.parquet's rows): those of the groups that train (kept, not masked),
    and how many of those groups got one reward throughout (the reward their advantages came from; files written
    before shaping hold correctness only)."""
    trained = [row for row in rows if row["kept"] and not row["masked"]]
    rewards = [
        (row["question_index"], row["reward"] if row["shaped_reward"] is None else row["shaped_reward"])
        for row in trained
    ]
    return len(trained), zero_variance_groups(rewards)


def zero_variance_groups(question_rewards: Iterable[tuple[int, float]]) -> int:
    """Questions whose whole group got the same reward: advantage 0 everywhere, no learning signal.
    Takes (question_index, reward) pairs."""
    rewards: dict[int, set[float]] = defaultdict(set)
    for question_index, reward in question_rewards:
        rewards[question_index].add(reward)
    return sum(1 for values in rewards.values() if len(values) == 1)
