"""Analysis queries and the report, on a real two-step run folder with an evaluation."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import luigi
import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest
from PIL import Image

import pipeline.tasks
import retool.sampling.engines
from retool.evaluation.analysis import (
    eval_by_checkpoint,
    length_distributions,
    metrics_by_step,
    sandbox_error_kinds,
    solve_rates,
    tool_success_by_round,
    worst_trajectories,
)
from retool.evaluation.report import (
    PLOTS,
    make_report,
    plot_diagnostics,
    plot_eval,
    plot_lengths,
    plot_reward,
    plot_sandbox,
    plot_tool_use,
)
from retool.run.shared import protocol_for
from retool.sampling.scripted import ScriptedSampler
from tests.helpers import scripted, tool_call_text
from tests.pipeline_helpers import TRAIN, batch

BUILT: dict[str, Path] = {}  # the fixture's run as built, once per session: each test gets its own copy


@pytest.fixture
def two_step_run(configure, monkeypatch, tmp_path_factory):
    """Two training steps, a report, and evaluations of the base model and of step 1. Branch 1
    divides by zero, branch 2 prints, even branches answer correctly."""
    settings = configure("report", trainer=TRAIN)
    if "run" in BUILT:  # the same files, modification times kept, in this test's own folder
        shutil.copytree(BUILT["run"], settings.run_dir)
        return settings
    protocol = protocol_for(settings.model)

    def choose(question, group, turn, step):
        if turn == 0 and group in (1, 2):
            return tool_call_text("1 / 0" if group == 1 else "print(6 * 7)", protocol.tool_format)
        examples = batch(settings, step) if step >= 0 else []
        answer = examples[question].answer if question < len(examples) else "?"  # evaluations: any answer
        return f"\\boxed{{{answer if group % 2 == 0 else -1}}}"

    monkeypatch.setattr(
        retool.sampling.engines,
        "sampler_for",
        lambda s, policy=None, shard=0, in_memory=None: ScriptedSampler(scripted(protocol_for(s.model), choose)),
    )
    tasks = [
        pipeline.Report(step=1),
        pipeline.Evaluate(step=-1, dataset=settings.data.train, n=2),
        pipeline.Evaluate(step=1, dataset=settings.data.train, n=2),
    ]
    assert luigi.build(tasks, local_scheduler=True, workers=1, log_level="WARNING")
    BUILT["run"] = tmp_path_factory.mktemp("two-step-run") / "report"
    shutil.copytree(settings.run_dir, BUILT["run"])
    return settings


def test_analysis_answers_its_questions(two_step_run):
    run = two_step_run.run_dir
    metrics = metrics_by_step(run)
    assert metrics["step"].to_list() == [0, 1] and {"reward_mean", "train_loss", "sandbox_ok_rate"} <= set(
        metrics.columns
    )
    assert all(metrics["train_kl_k3"] > 0) and all(metrics["train_entropy"] > 0)  # every update's drift
    assert metrics["valid_accuracy"].to_list() == pytest.approx([2 / 3, 2 / 3])  # branches 0 and 2 of 3 answer right
    assert metrics["groups_kept"].to_list() == metrics["groups_drawn"].to_list() == [3, 3]
    calls = tool_success_by_round(run)
    assert calls["calls"].sum() == sum(metrics["sandbox_calls"].to_list())
    errors = sandbox_error_kinds(run)
    assert errors.to_dicts() == [{"error": "ZeroDivisionError", "calls": 6}]  # branch 1 of 3 questions, 2 steps
    assert calls["ok_rate"].to_list() == [0.5, 0.5]
    assert length_distributions(run)["step"].to_list() == [0, 1]
    assert solve_rates(run)["samples"].sum() == 18
    assert 0 < worst_trajectories(run, 4).height <= 4
    evals = eval_by_checkpoint(run)
    assert evals["step"].to_list() == [-1, 1] and set(evals["mode"].to_list()) == {"retool"}


def test_report_writes_every_plot(two_step_run):
    folder = two_step_run.run_dir / "report" / "step=0001"
    report = (folder / "report.md").read_text()
    for name in PLOTS:
        with Image.open(folder / name) as image:
            assert image.size[0] > 500 and image.size[1] > 300
        assert f"({name})" in report
    page = (folder / "trajectories.html").read_text()  # step 1's trajectories, linked from the report
    assert "(trajectories.html)" in report and page.count('<section class="trajectory') == 3 * 3
    again = make_report(two_step_run.run_dir)  # the command-line form writes to runs/NAME/report
    assert again.parent == two_step_run.run_dir / "report" and all((again.parent / name).exists() for name in PLOTS)


NAN = float("nan")


def _has_values(line) -> bool:
    return any(math.isfinite(value) for value in line.get_ydata())


def _check_shows_data_or_says_why(figure) -> None:
    """Every panel draws a value or holds a note; every legend entry names a line that has a value."""
    for axis in figure.axes:
        drawn = any(_has_values(line) for line in axis.lines) or axis.patches
        assert drawn or any(text.get_text() for text in axis.texts), axis.get_title()
    for legend in [axis.get_legend() for axis in figure.axes if axis.get_legend()] + figure.legends:
        lines = {line.get_label(): line for axis in figure.axes for line in axis.lines}
        for entry in legend.get_texts():
            assert _has_values(lines[entry.get_text()]), f"legend entry {entry.get_text()!r} has no line"


def test_every_plot_has_data_or_says_why_not():
    """A run whose model never called the tool, and two evaluations of one checkpoint (n=1: Average@1 equals
    Pass@1), then a run folder with nothing in it yet."""
    metrics = pl.DataFrame(
        {
            "step": [0],
            "reward_mean": [-1.0],
            "correct": [0.0],
            "format": [0.0],
            "valid_tool_call_rate": [NAN],
            "code_calls": [0.0],
            "turns": [1.0],
            "sandbox_ok_rate": [NAN],
            "sandbox_error_rate": [NAN],
            "sandbox_timeout_rate": [NAN],
        }
    )
    evals = pl.DataFrame(
        {
            "evaluation": ["a-0123456789/retool-n1", "b-9876543210/plain-n1"],
            "position": [0, 0],
            "average_at_n": [0.25, 0.25],
            "pass_at_n": [0.25, 0.25],
            "format": [1.0, 1.0],
        }
    )
    lengths = pl.DataFrame({"step": [0, 0], "trajectory_tokens": [90, 120]})
    errors = pl.DataFrame(schema={"error": pl.String, "calls": pl.UInt32})
    empty = {"metrics": metrics.clear(), "evals": evals.clear(), "lengths": lengths.clear()}
    for metrics, evals, lengths in ((metrics, evals, lengths), tuple(empty.values())):
        figures = [
            plot_reward(metrics),
            plot_diagnostics(metrics),
            plot_tool_use(metrics),
            plot_sandbox(metrics, errors),
            plot_lengths(lengths),
            plot_eval(evals),
        ]
        for figure in figures:
            _check_shows_data_or_says_why(figure)
            plt.close(figure)


def test_stop_reasons_are_one_panel_of_those_that_occurred_and_checkpoints_are_named():
    metrics = pl.DataFrame(
        {"step": [0, 1], "stop_answer": [3, 4], "stop_max_code_calls": [1, 0], "stop_invalid": [0, 0]}
    )
    figure = plot_diagnostics(metrics)
    (stops,) = [axis for axis in figure.axes if axis.get_title() == "Stop reasons"]
    assert [entry.get_text() for entry in stops.get_legend().get_texts()] == ["answer", "max_code_calls"]
    assert stops.get_title(loc="left").startswith("never: invalid, max_turns")
    plt.close(figure)
    evals = pl.DataFrame({"evaluation": ["a/retool-n1"] * 3, "position": [-2, -1, 3], "average_at_n": [0.1, 0.2, 0.3]})
    figure = plot_eval(evals)
    assert [label.get_text() for label in figure.axes[0].get_xticklabels()] == ["base", "SFT", "step 3"]
    plt.close(figure)


def test_a_run_without_tool_calls_says_so():
    metrics = pl.DataFrame({"step": [0], "valid_tool_call_rate": [NAN], "code_calls": [0.0], "turns": [1.0]})
    figure = plot_tool_use(metrics)
    rate, counts = figure.axes
    assert [text.get_text() for text in rate.texts] == ["no tool calls"] and not rate.get_legend()
    assert [entry.get_text() for entry in counts.get_legend().get_texts()] == ["code calls", "assistant turns"]
    plt.close(figure)


def test_a_report_of_step_n_draws_steps_up_to_n_and_names_each_checkpoint(two_step_run, tmp_path):
    report = make_report(two_step_run.run_dir, tmp_path / "step0", step=0).read_text()
    training = report.split("## Training")[1].split("## Sandbox")[0]
    assert "| 0 |" in training and "| 1 |" not in training
    evaluation = report.split("## Evaluation")[1].split("## Worst")[0]
    assert "| base |" in evaluation and "step 1" not in evaluation  # the step-1 checkpoint is after step 0
    full = make_report(two_step_run.run_dir, tmp_path / "step1", step=1).read_text()
    assert "| base |" in full and "| step 1 |" in full and "| all 332 |" in full  # every question of the data set asked
    assert " ± " in full.split("## Evaluation")[1].split("| step 1 |")[1].split("\n")[0]  # Average@N with its interval
    (table,) = two_step_run.run_dir.glob("eval/*/*/checkpoint=step0001")
    (table.parent / "before_after-step=0001.md").write_text("| group | policy |\n")
    linked = make_report(two_step_run.run_dir, tmp_path / "linked", step=1).read_text()
    link = re.search(r"paired intervals: \[[^]]*\]\(([^)]*)\)", linked).group(1)
    assert (tmp_path / "linked" / link).resolve() == (table.parent / "before_after-step=0001.md").resolve()
    assert "before_after" not in make_report(two_step_run.run_dir, tmp_path / "early", step=0).read_text()
    assert "train_loss" not in full.split("## Training")[1].split("| step |")[1].split("\n")[0]


def test_quantiles_are_interpolated_and_rates_and_counts_have_their_own_axes(two_step_run):
    lengths = pl.read_parquet(two_step_run.run_dir / "step=0000" / "trajectories.parquet")["trajectory_tokens"]
    table = length_distributions(two_step_run.run_dir)
    assert table["trajectory_tokens_p50"][0] == pytest.approx(float(np.median(lengths.to_numpy())))  # not nearest
    figure = plot_tool_use(metrics_by_step(two_step_run.run_dir))
    rate, counts = figure.axes
    assert [line.get_label() for line in rate.lines] == ["valid tool-call rate"] and rate.get_ylim()[1] <= 1.1
    assert {line.get_label() for line in counts.lines} == {"code calls", "assistant turns"}
    plt.close(figure)


def test_the_report_task_is_built_again_when_an_evaluation_it_shows_is_newer(two_step_run):
    report_task = pipeline.Report(step=1)
    assert not report_task.complete()  # the fixture's evaluations ran after it
    assert luigi.build([report_task], local_scheduler=True, workers=1, log_level="WARNING")
    assert report_task.complete()
    summary = next((two_step_run.run_dir / "eval").glob("*/*/checkpoint=step0001/summary.parquet"))
    summary.touch()
    assert not report_task.complete()
    assert luigi.build([report_task], local_scheduler=True, workers=1, log_level="WARNING")
    assert report_task.complete()
    assert not pipeline.Report(step=0).complete()  # never built
