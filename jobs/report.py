"""PNG plots and a short Markdown summary of a run: `python -m jobs.report runs/NAME`."""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402

from jobs.analysis import (
    eval_by_checkpoint,
    length_distributions,
    metrics_by_step,
    sandbox_error_kinds,
    worst_trajectories,
)  # noqa: E402
from jobs.atomic import write_text_atomically  # noqa: E402

PLOTS = ("reward.png", "tool_use.png", "sandbox.png", "lengths.png", "eval.png")
STYLES = (("o", "-"), ("s", "--"), ("^", ":"))  # lines that coincide stay distinguishable


def _lines(
    path: Path,
    title: str,
    steps: list,
    series: dict[str, list],
    ylabel: str,
    xlabel: str = "training step",
    ylim: tuple | None = None,
) -> None:
    figure, axis = plt.subplots(figsize=(7, 4), layout="constrained")
    for (label, values), (marker, linestyle) in zip(series.items(), STYLES):
        axis.plot(steps, values, marker=marker, linestyle=linestyle, label=label)
    if not steps:
        axis.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=axis.transAxes)
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ylim:
        axis.set_ylim(*ylim)
    if steps:
        axis.set_xticks(sorted(set(steps)))
        axis.legend(loc="best")
    axis.grid(alpha=0.3)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _column(frame: pl.DataFrame, name: str) -> list:
    return frame[name].to_list() if name in frame.columns else [float("nan")] * frame.height


def plot_reward(metrics: pl.DataFrame, path: Path) -> None:
    steps = _column(metrics, "step")
    _lines(
        path,
        "Reward, accuracy and format",
        steps,
        {
            "reward mean (±1)": _column(metrics, "reward_mean"),
            "correct": _column(metrics, "correct"),
            "valid \\boxed{} format": _column(metrics, "format"),
        },
        "value",
        ylim=(-1.05, 1.05),
    )


def plot_tool_use(metrics: pl.DataFrame, path: Path) -> None:
    steps = _column(metrics, "step")
    _lines(
        path,
        "Tool use per trajectory",
        steps,
        {
            "valid tool-call rate": _column(metrics, "valid_tool_call_rate"),
            "code calls": _column(metrics, "code_calls"),
            "assistant turns": _column(metrics, "turns"),
        },
        "mean",
    )


def plot_sandbox(metrics: pl.DataFrame, errors: pl.DataFrame, path: Path) -> None:
    figure, (rates, kinds) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    steps = _column(metrics, "step")
    outcomes = (("ok", "sandbox_ok_rate"), ("error", "sandbox_error_rate"), ("timeout", "sandbox_timeout_rate"))
    for (label, name), (marker, linestyle) in zip(outcomes, STYLES):
        rates.plot(steps, _column(metrics, name), marker=marker, linestyle=linestyle, label=label)
    rates.set(title="Sandbox outcome rates", xlabel="training step", ylabel="share of calls", ylim=(-0.05, 1.05))
    if steps:
        rates.set_xticks(sorted(set(steps)))
    rates.legend(loc="best")
    rates.grid(alpha=0.3)
    if errors.height:
        kinds.barh(errors["error"].to_list()[::-1], errors["calls"].to_list()[::-1], color="tab:red", height=0.5)
    else:
        kinds.text(0.5, 0.5, "no failed calls", ha="center", va="center", transform=kinds.transAxes)
    kinds.set(title="Failed calls by error", xlabel="calls")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_lengths(run: Path, path: Path) -> None:
    paths = sorted(run.glob("step=*/trajectories.parquet"))
    frame = (
        pl.concat([pl.read_parquet(p, columns=["step", "trajectory_tokens"]) for p in paths])
        if paths
        else pl.DataFrame()
    )
    figure, axis = plt.subplots(figsize=(7, 4), layout="constrained")
    if frame.height:
        steps = sorted(frame["step"].unique().to_list())
        axis.boxplot(
            [frame.filter(pl.col("step") == s)["trajectory_tokens"].to_list() for s in steps],
            tick_labels=[str(s) for s in steps],
        )
    else:
        axis.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=axis.transAxes)
    axis.set(title="Trajectory length", xlabel="training step", ylabel="tokens (prompt + turns + observations)")
    axis.grid(alpha=0.3)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_eval(evals: pl.DataFrame, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(8, 4.5), layout="constrained")
    if evals.height:
        for (dataset, mode, n), group in evals.group_by("dataset", "mode", "n", maintain_order=True):
            name = f"{Path(dataset).stem} {mode}"
            positions = group["position"].to_list()
            for (column, label), (marker, linestyle) in zip(
                (("average_at_n", f"Average@{n}"), ("pass_at_n", f"Pass@{n}"), ("format", "Format")), STYLES
            ):
                axis.plot(
                    positions, group[column].to_list(), marker=marker, linestyle=linestyle, label=f"{name} {label}"
                )
        ticks = sorted(set(evals["position"].to_list()))
        axis.set_xticks(ticks, [{-2: "base", -1: "SFT"}.get(t, str(t)) for t in ticks])
        axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    else:
        axis.text(
            0.5,
            0.5,
            "no evaluation yet (luigi --module pipeline Evaluate ...)",
            ha="center",
            va="center",
            transform=axis.transAxes,
        )
    axis.set(title="Evaluation by checkpoint", xlabel="checkpoint", ylabel="rate", ylim=(-0.05, 1.05))
    axis.grid(alpha=0.3)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_learning_curve(metrics: pl.DataFrame, path: Path) -> None:
    """Reward mean and degenerate-group rate per RL step: is the policy learning, and is there signal?"""
    figure, axis = plt.subplots(figsize=(6.4, 3.6), constrained_layout=True)
    steps = _column(metrics, "step")
    axis.plot(steps, _column(metrics, "reward_mean"), marker="o", label="reward mean")
    axis.plot(steps, _column(metrics, "correct"), marker="s", linestyle="--", label="correct")
    axis.plot(
        steps, _column(metrics, "degenerate_group_rate"), marker="^", linestyle=":", label="degenerate-group rate"
    )
    axis.set(title="RL after the cold start", xlabel="training step", ylim=(-1.05, 1.05))
    axis.legend(loc="lower right", fontsize="small")
    axis.grid(alpha=0.3)
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


def make_report(run: str | Path, out: str | Path | None = None) -> Path:
    """Writes the plots and report.md under `out` (default runs/NAME/report); returns report.md."""
    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run folder")
    out = Path(out) if out else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    metrics, evals, errors = metrics_by_step(run), eval_by_checkpoint(run), sandbox_error_kinds(run)
    plot_reward(metrics, out / "reward.png")
    plot_tool_use(metrics, out / "tool_use.png")
    plot_sandbox(metrics, errors, out / "sandbox.png")
    plot_lengths(run, out / "lengths.png")
    plot_eval(evals, out / "eval.png")
    sections = [
        f"# Run report: {run.name}\n",
        f"{counted(metrics.height, 'training step')}, {counted(evals.height, 'evaluation')}.\n",
        "## Training\n",
        "![reward](reward.png)\n",
        "![tool use](tool_use.png)\n",
        _markdown_table(
            metrics,
            [
                "step",
                "reward_mean",
                "correct",
                "format",
                "code_calls",
                "turns",
                "train_datums",
                "train_loss",
                "train_skipped",
            ],
        ),
        "## Sandbox\n",
        "![sandbox](sandbox.png)\n",
        _markdown_table(errors, ["error", "calls"]),
        "## Lengths\n",
        "![lengths](lengths.png)\n",
        _markdown_table(
            length_distributions(run),
            ["step", "trajectory_tokens_p50", "trajectory_tokens_p90", "trajectory_tokens_max"],
        ),
        "## Evaluation\n",
        "![evaluation](eval.png)\n",
        _markdown_table(evals, ["dataset", "mode", "n", "step", "average_at_n", "pass_at_n", "format"]),
        "## Worst trajectories to read\n",
        _markdown_table(
            worst_trajectories(run, 5),
            ["step", "question_index", "group_index", "stop_reason", "trajectory_tokens", "extracted_answer", "answer"],
        ),
    ]
    report = out / "report.md"
    write_text_atomically(report, "\n".join(sections))
    return report


def counted(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", type=Path, help="run folder, e.g. runs/cpu-default")
    parser.add_argument("--out", type=Path, help="folder for the plots and report.md (default: RUN/report)")
    args = parser.parse_args()
    if not (args.run / "config.json").is_file():
        parser.error(f"{args.run}: no such run folder (a run folder holds the config.json its first command wrote)")
    print(make_report(args.run, args.out))


if __name__ == "__main__":
    main()
