"""PNG plots and a short Markdown summary of a run: `python -m retool report runs/NAME`."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from itertools import cycle
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from retool.config.settings import RunSettings  # noqa: E402
from retool.evaluation.analysis import (  # noqa: E402
    eval_by_checkpoint,
    length_distributions,
    metrics_by_step,
    sandbox_error_kinds,
    trajectory_lengths,
    worst_trajectories,
)
from retool.evaluation.health import health_by_step, health_warnings
from retool.evaluation.viewer import PageFiles, write_page  # noqa: E402
from retool.files.atomic import write_text_atomically  # noqa: E402
from retool.files.layout import REPORT, VIEW, RunFolder  # noqa: E402
from retool.rollout.state import STOP_REASONS  # noqa: E402

PLOTS = ("reward.png", "diagnostics.png", "tool_use.png", "sandbox.png", "lengths.png", "eval.png")
STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", "-"), ("P", "--"))  # coinciding lines stay apart


def _has_values(values: list) -> bool:
    return any(value is not None and math.isfinite(value) for value in values)


def _note(axis: Axes, lines: list[str]) -> None:
    """Says on the plot why a series or the whole panel has nothing to draw."""
    if not lines:
        return
    empty = not axis.lines and not axis.patches
    axis.text(
        0.5 if empty else 0.02,
        0.5 if empty else 0.97,
        "\n".join(lines),
        ha="center" if empty else "left",
        va="center" if empty else "top",
        transform=axis.transAxes,
        fontsize="medium" if empty else "small",
        color="dimgray",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
    )


def _draw_series(axis: Axes, metrics: pl.DataFrame, columns: dict[str, str], empty_because: str) -> None:
    """One line per metrics column (label -> column) that has a value; a column with none is named in a
    note, not left in the legend as an entry without a line."""
    steps = _column(metrics, "step")
    series = {label: _column(metrics, column) for label, column in columns.items()}
    drawn = {label: values for label, values in series.items() if steps and _has_values(values)}
    for (label, values), (marker, linestyle) in zip(drawn.items(), cycle(STYLES)):
        axis.plot(steps, values, marker=marker, linestyle=linestyle, label=label)
    if steps:
        axis.set_xticks(sorted(set(steps)))
    if drawn:
        axis.legend(loc="best")
    missing = [f"{label}: none ({empty_because})" for label in series if label not in drawn]
    _note(axis, ["no training step yet"] if not steps else missing if drawn else [empty_because])
    axis.grid(alpha=0.3)


def _per_step(metrics: pl.DataFrame, columns: dict[str, str], empty_because: str, size=(7, 4), **axis_set) -> Figure:
    """A figure of metrics columns by training step."""
    figure, axis = plt.subplots(figsize=size, layout="constrained")
    _draw_series(axis, metrics, columns, empty_because)
    axis.set(xlabel="training step", **axis_set)
    return figure


def _column(frame: pl.DataFrame, name: str) -> list:
    return frame[name].to_list() if name in frame.columns else [float("nan")] * frame.height


def plot_reward(metrics: pl.DataFrame) -> Figure:
    columns = {"reward mean (±1)": "reward_mean", "correct": "correct", "valid \\boxed{} format": "format"}
    return _per_step(
        metrics, columns, "not recorded", title="Reward, accuracy and format", ylabel="value", ylim=(-1.05, 1.05)
    )


DIAGNOSTICS = (  # panel title, y label, series (label -> metrics column)
    ("Entropy of the policy on its sampled tokens", "nats", {"entropy": "train_entropy"}),
    (
        "KL between the policy before and after the update",
        "KL (nats per token)",
        {"k1": "train_kl_k1", "k3": "train_kl_k3"},
    ),
    (
        "PPO clip",
        "share of loss tokens",
        {"clip active in the loss": "train_clip_fraction", "ratio outside the range after": "train_ratio_outside_clip"},
    ),
    (
        "Answers",
        "rate",
        {"correct of valid answers": "valid_accuracy", "valid \\boxed{} format": "format", "correct": "correct"},
    ),
    (
        "Sampled tokens per trajectory",
        "tokens",
        {"correct": "sampled_tokens_correct", "wrong": "sampled_tokens_wrong"},
    ),
    ("Question groups per step", "groups", {"drawn": "groups_drawn", "kept (trained on)": "groups_kept"}),
    (
        "Off-policy samples ([rollout] max_staleness, [trainer] correction)",
        "value",
        {
            "staleness (steps)": "staleness",
            "importance weight (mean)": "train_importance_weight",
            "weight truncated or dropped (share)": "train_importance_limited",
        },
    ),
)


def plot_diagnostics(metrics: pl.DataFrame) -> Figure:
    """What an RL user reads every step: entropy, how far each update moved the policy, the clip, answer
    quality, the lengths of correct and wrong trajectories, how many groups trained, how off-policy the samples
    were; stop reasons apart."""
    figure, axes = plt.subplots(3, 3, figsize=(15, 12), layout="constrained")
    for axis, (title, ylabel, columns) in zip(axes.flat, DIAGNOSTICS):
        _draw_series(axis, metrics, columns, "not recorded")
        axis.set(title=title, xlabel="training step", ylabel=ylabel)
    # One panel of the stop reasons that occurred; the others named in a line, not drawn as lines at zero.
    seen = [reason for reason in STOP_REASONS if any(v == v and v for v in _column(metrics, f"stop_{reason}"))]
    stops = axes.flat[len(DIAGNOSTICS)]
    _draw_series(stops, metrics, {reason: f"stop_{reason}" for reason in seen}, "no trajectory yet")
    stops.set(title="Stop reasons", xlabel="training step", ylabel="trajectories")
    never = [reason for reason in STOP_REASONS if reason not in seen]
    if never and seen:
        stops.set_title(f"never: {', '.join(never)}", loc="left", fontsize="x-small", y=-0.25, color="dimgray")
    for unused in axes.flat[len(DIAGNOSTICS) + 1 :]:
        figure.delaxes(unused)
    return figure


def plot_tool_use(metrics: pl.DataFrame) -> Figure:
    """The valid-call rate on a 0-1 axis of its own; calls and turns per trajectory, counts, beside it."""
    figure, (rate, counts) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    _draw_series(rate, metrics, {"valid tool-call rate": "valid_tool_call_rate"}, "no tool calls")
    rate.set(title="Tool calls that parse", xlabel="training step", ylabel="share of calls", ylim=(-0.05, 1.05))
    _draw_series(counts, metrics, {"code calls": "code_calls", "assistant turns": "turns"}, "no tool calls")
    counts.set(title="Per trajectory", xlabel="training step", ylabel="mean count", ylim=(0, None))
    return figure


def plot_sandbox(metrics: pl.DataFrame, errors: pl.DataFrame) -> Figure:
    figure, (rates, kinds) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    outcomes = {outcome: f"sandbox_{outcome}_rate" for outcome in ("ok", "error", "timeout")}
    _draw_series(rates, metrics, outcomes, "no sandbox calls")
    rates.set(title="Sandbox outcome rates", xlabel="training step", ylabel="share of calls", ylim=(-0.05, 1.05))
    if errors.height:
        names = [_shortened(name, 28) for name in errors["error"].to_list()]
        kinds.barh(names[::-1], errors["calls"].to_list()[::-1], color="tab:red", height=0.5)
    _note(kinds, [] if errors.height else ["no failed calls"])
    kinds.set(title="Failed calls by error", xlabel="calls")
    return figure


def _shortened(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def plot_lengths(lengths: pl.DataFrame) -> Figure:
    figure, axis = plt.subplots(figsize=(7, 4), layout="constrained")
    steps = sorted(lengths["step"].unique().to_list())
    if steps:
        by_step = [lengths.filter(pl.col("step") == step)["trajectory_tokens"].to_list() for step in steps]
        axis.boxplot(by_step, tick_labels=[str(step) for step in steps])
    _note(axis, [] if steps else ["no trajectories yet"])
    axis.set(title="Trajectory length", xlabel="training step", ylabel="tokens (prompt + turns + observations)")
    axis.grid(alpha=0.3)
    return figure


EVAL_METRICS = (("average_at_n", "Average@n"), ("pass_at_n", "Pass@n"), ("format", "Format"))


def plot_eval(evals: pl.DataFrame) -> Figure:
    """One panel per metric, one line per evaluation (data file and sampling), so that no two series of
    the same evaluation sit on each other (Average@1 equals Pass@1)."""
    figure, axes = plt.subplots(1, 3, figsize=(13, 4.5), sharey=True, layout="constrained")
    groups = list(evals.group_by("evaluation", maintain_order=True)) if evals.height else []
    ticks = sorted(set(evals["position"].to_list()))
    for axis, (column, title) in zip(axes, EVAL_METRICS):
        for ((name,), group), (marker, linestyle) in zip(groups, cycle(STYLES)):
            axis.plot(
                group["position"].to_list(), _column(group, column), marker=marker, linestyle=linestyle, label=name
            )
        axis.set_xticks(ticks, [{-2: "base", -1: "SFT"}.get(t, f"step {t}") for t in ticks])
        axis.set(title=title, xlabel="checkpoint", ylim=(-0.05, 1.05))
        axis.grid(alpha=0.3)
        _note(axis, [] if groups else ["no evaluation yet"])
    axes[0].set_ylabel("rate")
    if groups:
        figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", fontsize="small")
    return figure


def plot_learning_curve(metrics: pl.DataFrame) -> Figure:
    """Reward mean and zero-variance-group rate per RL step: is the policy learning, and is there signal?"""
    columns = {
        "reward mean": "reward_mean",
        "correct": "correct",
        "zero-variance-group rate": "zero_variance_group_rate",
    }
    return _per_step(metrics, columns, "not recorded", (6.4, 3.6), title="RL after the cold start", ylim=(-1.05, 1.05))


def save(figure: Figure, path: Path) -> None:
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _markdown_table(frame: pl.DataFrame, columns: list[str]) -> str:
    present = [c for c in columns if c in frame.columns]
    if not frame.height or not present:
        return "(none yet)\n"
    lines = ["| " + " | ".join(present) + " |", "|" + "---|" * len(present)]
    for row in frame.select(present).iter_rows():
        lines.append(
            "| "
            + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v).replace("\n", " ")[:80] for v in row)
            + " |"
        )
    return "\n".join(lines) + "\n"


TRAINING_COLUMNS = [  # of the report's table of training steps
    "step",
    "reward_mean",
    "correct",
    "format",
    "valid_accuracy",
    "code_calls",
    "groups_kept",
    "train_datums",
    "train_grad_norm",
    "train_entropy",
    "train_kl_k3",
    "train_clip_fraction",
    "staleness",
    "train_importance_weight",
    "train_skipped",
]


LOSS_NOTE = (  # why the table shows the gradient norm, not the loss
    "`train_loss` (kept in metrics.parquet) is the PPO objective before the update. With one on-policy update "
    "every ratio is 1, so it is minus the token-weighted mean advantage: set by how many tokens the right and "
    "the wrong trajectories have, not by learning. How far each update moved the policy is in `train_kl_k3` "
    "and `train_clip_fraction`.\n"
)


def up_to(frame: pl.DataFrame, step: int | None, column: str = "step") -> pl.DataFrame:
    return frame if step is None or column not in frame.columns else frame.filter(pl.col(column) <= step)


def make_report(run: str | Path, out: str | Path | None = None, step: int | None = None, view: str = "") -> Path:
    """Writes the plots and report.md of training steps up to `step` (None: all) and the evaluations of their
    checkpoints (and of the base and cold-start models) under `out` (default runs/NAME/report); returns report.md.
    `view`: the page of the last step's trajectories in `out` (retool/evaluation/viewer.py), linked."""
    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run folder")
    out = Path(out) if out else RunFolder(run).report()
    out.mkdir(parents=True, exist_ok=True)
    metrics, evals = up_to(metrics_by_step(run), step), up_to(eval_by_checkpoint(run), step)
    errors = sandbox_error_kinds(run, step)
    figures = (
        plot_reward(metrics),
        plot_diagnostics(metrics),
        plot_tool_use(metrics),
        plot_sandbox(metrics, errors),
        plot_lengths(up_to(trajectory_lengths(run), step)),
        plot_eval(evals),
    )
    for figure, name in zip(figures, PLOTS, strict=True):
        save(figure, out / name)
    sections = [
        f"# Run report: {run.name}\n",
        f"{counted(metrics.height, 'training step')}, {counted(evals.height, 'evaluation')}.\n",
        "## Training\n",
        "![reward](reward.png)\n",
        "![diagnostics](diagnostics.png)\n",
        "![tool use](tool_use.png)\n",
        _markdown_table(metrics, TRAINING_COLUMNS),
        LOSS_NOTE,
        "## Health\n",
        health_section(up_to(health_by_step(run), step)),
        "## Sandbox\n",
        "![sandbox](sandbox.png)\n",
        _markdown_table(errors, ["error", "calls"]),
        "## Lengths\n",
        "![lengths](lengths.png)\n",
        _markdown_table(
            up_to(length_distributions(run), step),
            ["step", "trajectory_tokens_p50", "trajectory_tokens_p90", "trajectory_tokens_max"],
        ),
        "## Evaluation\n",
        "![evaluation](eval.png)\n",
        _markdown_table(
            with_intervals(evals, ["average_at_n", "format"]),
            ["checkpoint", "dataset", "mode", "n", "questions_asked", "average_at_n", "pass_at_n", "format"],
        ),
        "± is the half-width of a 95 % interval over questions. " + before_after_links(run, out, step),
        "## Worst trajectories to read\n",
        f"Every trajectory of the last step, its turns and its tokens: [{view}]({view}).\n" if view else "",
        _markdown_table(
            worst_trajectories(run, 5, step),
            ["step", "question_index", "group_index", "stop_reason", "trajectory_tokens", "extracted_answer", "answer"],
        ),
    ]
    report = out / REPORT
    write_text_atomically(report, "\n".join(sections))
    return report


def report_with_page(
    out: Path, settings: RunSettings, step: int, page: PageFiles, decode: Callable[[int], str]
) -> Path:
    """The report of the run's steps up to `step` and of the evaluations found (`make_report`) in the folder `out`,
    with the page of step `step`'s trajectories drawn from `page` (their tokens read by `decode`), which it links."""
    out.mkdir(parents=True, exist_ok=True)
    write_page(page, f"{settings.run.name}: step {step}", decode, out / VIEW)
    return make_report(settings.run_dir, out, step, view=VIEW)


def health_section(health: pl.DataFrame) -> str:
    """The health table and its warnings (retool/evaluation/health.py), as `python -m retool verify --health`."""
    warnings = "".join(f"- **{warning}**\n" for warning in health_warnings(health)) or "No measure has collapsed.\n"
    return _markdown_table(health, list(health.columns)) + "\n" + warnings


def with_intervals(evals: pl.DataFrame, columns: list[str]) -> pl.DataFrame:
    """Each rate as "0.312 ± 0.048" where the summary has its interval (`<column>_ci`)."""
    shown = [
        pl.format("{} ± {}", pl.col(c).round(3), pl.col(f"{c}_ci").round(3)).alias(c)
        for c in columns
        if c in evals.columns and f"{c}_ci" in evals.columns
    ]
    return evals.with_columns(shown) if shown else evals


def before_after_links(run: Path, out: Path, step: int | None) -> str:
    """Links to the before/after tables (each family role apart, with paired intervals) of steps up to `step`."""
    tables = [path for made_at, path in RunFolder(run).before_after_tables() if step is None or made_at <= step]
    if not tables:
        return "The before/after table (`luigi --module pipeline BeforeAfter`) pairs them question by question.\n"
    links = ", ".join(f"[{path.parent.name} {path.stem}]({os.path.relpath(path, out)})" for path in tables)
    return f"Question by question, each family role apart, with paired intervals: {links}.\n"


def counted(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
