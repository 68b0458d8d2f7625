"""The [reward] section: tool-use shaping and overlong handling change the reward the advantage is computed from
and the trajectories the loss sees exactly as documented; correctness stays its own column."""

from __future__ import annotations

import pytest

from retool.config.reward import RewardConfig
from retool.config.settings import RunSettings, SettingsError
from retool.data.examples import MathExample
from retool.files.tables import TRAJECTORIES, table_from_rows
from retool.rollout.rows import trajectory_row
from retool.rollout.scoring import end_step, overlong_penalty
from retool.rollout.stage_tables import datums_table
from retool.rollout.state import AssistantTurn, ToolCall, Trajectory

EXAMPLE = MathExample("q-1", "What is 6 * 7?", "42", "arithmetic")


def trajectory(branch: int, answer: str, calls: tuple[str, ...] = (), stop: str = "answer", pad: int = 0) -> Trajectory:
    """Branch `branch`: one turn per code call (each with its status), then an answer turn of `pad` extra tokens."""
    turns, tokens = [], [1, 2]
    for n, status in enumerate(calls):
        turn = AssistantTurn(list(tokens), [3, 4], [-0.5, -0.5], "print(6 * 7)", "stop", n, "tool")
        turn.tool_call = ToolCall(f"code-0-{branch}-{n}", "print(6 * 7)", status, 0.01, "42")
        turns.append(turn)
        tokens += [3, 4, 5]  # the completion and the observation
    completion = [6] * (2 + pad)
    turns.append(AssistantTurn(list(tokens), completion, [-0.1] * len(completion), answer, "stop", 9, "answer"))
    ended = Trajectory(EXAMPLE, 0, branch, [], turns=turns, code_calls=len(calls))
    ended.end(stop, answer)
    return ended


def group() -> list[Trajectory]:
    return [
        trajectory(0, r"\boxed{42}", ("ok",)),  # right, one valid call
        trajectory(1, r"\boxed{41}", ("ok", "error")),  # wrong, two calls (one valid)
        trajectory(2, r"\boxed{41}", ("ok",) * 6),  # wrong, six calls
        trajectory(3, "no answer", ("ok", "ok"), stop="max_code_calls"),  # stopped by a budget
    ]


def rewards(reward: RewardConfig, max_tokens: int = 1000) -> list[tuple[float, float]]:
    return [(t.reward, t.shaped_reward) for t in end_step(group(), None, reward, max_tokens)]


def test_by_default_the_advantage_is_correctness_against_the_group_mean():
    ended = end_step(group())
    assert [(t.reward, t.shaped_reward) for t in ended] == [(1, 1), (-1, -1), (-1, -1), (-1, -1)]
    assert [t.advantage for t in ended] == [1.5, -0.5, -0.5, -0.5] and not any(t.masked for t in ended)
    assert not RewardConfig().shaped


def test_verl_s_tool_credit_lifts_wrong_answers_up_to_the_cap():
    shaped = rewards(RewardConfig(wrong_answer_call_credit=0.1))
    assert shaped == [(1, 1), (-1, pytest.approx(-0.8)), (-1, -0.6), (-1, pytest.approx(-0.8))]  # six calls: capped
    ended = end_step(group(), None, RewardConfig(wrong_answer_call_credit=0.1))
    mean = (1 - 0.8 - 0.6 - 0.8) / 4
    assert [t.advantage for t in ended] == pytest.approx([1 - mean, -0.8 - mean, -0.6 - mean, -0.8 - mean])
    table = table_from_rows([trajectory_row(t, 0, -1) for t in ended], TRAJECTORIES)
    assert table["reward"].to_pylist() == [1, -1, -1, -1]  # correctness kept as its own column
    assert table["shaped_reward"].to_pylist() == pytest.approx([1, -0.8, -0.6, -0.8])


def test_a_bonus_per_call_that_ran():
    shaped = rewards(RewardConfig(valid_call_bonus=0.05))
    assert shaped == [(1, 1.05), (-1, -0.95), (-1, pytest.approx(-0.7)), (-1, -0.9)]


def test_dapo_s_soft_overlong_penalty():
    assert [overlong_penalty(n, 1000, 200) for n in (700, 800, 900, 1000, 1100)] == [0, 0, -0.5, -1, -1]
    tokens = [len(t.token_ids()) for t in group()]
    budget = tokens[2] + 1  # the six-call trajectory is one token short of the budget, the others far from it
    shaped = rewards(RewardConfig(overlong="penalty", overlong_buffer_tokens=10), budget)
    assert shaped == [(1, 1), (-1, -1), (-1, pytest.approx(-1.9)), (-1, -1)]


def test_masked_trajectories_count_in_the_group_mean_but_not_in_the_loss():
    ended = end_step(group(), None, RewardConfig(overlong="mask"))
    assert [t.masked for t in ended] == [False, False, False, True]
    assert [t.advantage for t in ended] == [1.5, -0.5, -0.5, -0.5]
    scored = table_from_rows([trajectory_row(t, 0, -1) for t in ended], TRAJECTORIES)
    datums = datums_table(group(), scored, 0, -1, 4096)
    assert datums["group_index"].to_pylist() == [0, 1, 2]


def test_bad_reward_settings_are_refused_by_name():
    with pytest.raises(SettingsError, match=r"\[reward\] overlong"):
        RunSettings().changed(reward={"overlong": "drop"})
    with pytest.raises(SettingsError, match=r"\[reward\] wrong_answer_cap"):
        RunSettings().changed(reward={"wrong_answer_cap": 1.5})
