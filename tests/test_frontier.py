"""The frontier draw ([data] draw = frontier): a step's questions by the pass rates earlier steps' files show."""

from __future__ import annotations

import luigi
import pytest

from retool.config.settings import RunSettings, SettingsError, training_stage
from retool.data.examples import MathExample
from retool.data.frontier import disagreement, frontier_draw
from retool.files.tables import PROMPTS, read_table
from retool.run.shared import history_steps, step_draws

FAMILIES = ("solved", "unsolved", "frontier")  # every sample right, none right, half right


def pool(per_family: int = 30) -> list[MathExample]:
    return [
        MathExample(f"{family}-{i}", f"question {i} of {family}", "1", family)
        for family in FAMILIES
        for i in range(per_family)
    ]


def history(samples_per_family: int = 40) -> list[dict]:
    """Outcomes of earlier steps on the first question of each family."""
    right = {"solved": lambda i: True, "unsolved": lambda i: False, "frontier": lambda i: i % 2 == 0}
    return [
        {"example_id": f"{family}-0", "data_source": family, "correct": right[family](i)}
        for family in FAMILIES
        for i in range(samples_per_family)
    ]


def test_the_draw_is_the_same_on_the_same_files_and_differs_by_step():
    first = frontier_draw(pool(), history(), 12, 4, 0.05, (0, 5))
    assert first == frontier_draw(pool(), history(), 12, 4, 0.05, (0, 5))
    assert [d.example for d in first] != [d.example for d in frontier_draw(pool(), history(), 12, 4, 0.05, (0, 6))]
    assert len({d.example.id for d in first}) == 12  # without replacement


def test_questions_whose_groups_disagree_are_drawn_most():
    frontier = sum(
        draw.example.data_source == "frontier"
        for step in range(20)
        for draw in frontier_draw(pool(), history(), 12, 4, 0.05, (0, step))
    )
    # Weights: frontier 1 - 2 / 16 = 0.875; solved and unsolved at (41/42 or 1/42): 0.09 each: ~83 % frontier.
    assert frontier / (20 * 12) > 0.7


def test_a_question_s_own_outcomes_count_before_its_family_s():
    outcomes = [{"example_id": "frontier-0", "data_source": "frontier", "correct": True} for _ in range(8)]
    outcomes += [{"example_id": "frontier-1", "data_source": "frontier", "correct": i % 2 == 0} for i in range(8)]
    draws = {d.example.id: d for d in frontier_draw(pool(3), outcomes, 9, 4, 0.05, (0, 1))}
    seen, unseen = draws["frontier-0"], draws["frontier-2"]
    assert seen.pass_rate == pytest.approx((8 + 2 * 13 / 18) / 10)  # 8 of 8, and the family's 12/16 as 2 samples
    assert unseen.pass_rate == pytest.approx(13 / 18) and seen.weight < unseen.weight
    assert seen.reason == "question 8/8 right, family 12/16 right"
    assert draws["solved-0"].pass_rate == 0.5 and draws["solved-0"].reason == "family unseen: 1/2"
    assert draws["solved-0"].weight == pytest.approx(disagreement(0.5, 4))


def test_the_floor_keeps_every_question_drawable():
    solved = [{"example_id": f"solved-{i}", "data_source": "solved", "correct": True} for i in range(3)] * 100
    draws = frontier_draw(pool(3)[:3], solved, 3, 4, 0.05, (0, 1))
    assert {d.weight for d in draws} == {0.05} and len(draws) == 3


def test_a_step_reads_the_newest_finished_steps_and_draws_shuffled_without_them():
    settings = RunSettings().changed(data={"draw": "frontier", "frontier_steps": 3})

    def steps(settings, step):
        return list(history_steps(training_stage(settings, step)))

    assert steps(settings, 0) == [] and steps(settings, 5) == [2, 3, 4]
    lagged = settings.changed(rollout={"max_staleness": 1})
    assert steps(lagged, 5) == [1, 2, 3]  # step 4 still samples while step 5 does
    shuffled = RunSettings().changed(data={"draw": "shuffled"})
    assert steps(shuffled, 5) == []  # the shuffled walk reads nothing
    with pytest.raises(SettingsError, match=r"\[data\] draw"):
        RunSettings().changed(data={"draw": "hard"})


def test_prompts_record_the_draw_and_a_rerun_draws_the_same(configure, monkeypatch):
    from jobs.prompts import outcomes_of
    from pipeline import Prompts, ScoreTrajectories
    from tests.pipeline_helpers import build, step_dir, tool_policy

    settings = configure("frontier", data={"draw": "frontier", "questions_per_step": 4})
    assert Prompts(step=1).requires()["history"] == [ScoreTrajectories(step=0)]
    assert build(settings, 0, tool_policy(settings), monkeypatch)
    assert luigi.build([Prompts(step=1)], local_scheduler=True, workers=1, log_level="WARNING")
    first = read_table(step_dir(settings, 1) / "prompts.parquet", PROMPTS)
    assert set(read_table(step_dir(settings, 0) / "prompts.parquet", PROMPTS)["draw_reason"].to_pylist()) == {
        "the shuffled walk"
    }
    assert all(rate is not None and 0 < rate < 1 for rate in first["pass_rate"].to_pylist())
    assert all("right" in reason or "unseen" in reason for reason in first["draw_reason"].to_pylist())
    outcomes = outcomes_of(step_dir(settings, 0) / "trajectories.parquet")
    (step_dir(settings, 1) / "prompts.parquet").unlink()
    assert luigi.build([Prompts(step=1)], local_scheduler=True, workers=1, log_level="WARNING")
    assert read_table(step_dir(settings, 1) / "prompts.parquet", PROMPTS).equals(first)
    assert step_draws(settings, 1, None, []) != step_draws(settings, 1, None, outcomes)
