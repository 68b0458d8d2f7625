"""Questions users ask of a run folder, as polars queries (lazy scans; each returns a DataFrame)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from retool.files.layout import METRICS_FILE, OBSERVATIONS_FILE, SUMMARY_FILE, TRAJECTORIES_FILE, RunFolder
from retool.rollout.state import REFUSED


def _scan(paths: list[Path]) -> pl.LazyFrame | None:
    return pl.scan_parquet(paths, hive_partitioning=True) if paths else None


def _empty(**schema) -> pl.DataFrame:
    return pl.DataFrame(schema={name: dtype for name, dtype in schema.items()})


def metrics_by_step(run: str | Path) -> pl.DataFrame:
    """One row per training step: the columns of step=NNNN/metrics.parquet."""
    paths = RunFolder(Path(run)).step_files(METRICS_FILE)
    if not paths:
        return _empty(step=pl.Int64)
    # One row a step; steps written before a column was added lack it (null there).
    metrics = pl.concat([pl.read_parquet(path) for path in paths], how="diagonal_relaxed").sort("step")
    old_name = {"degenerate_group_rate": "zero_variance_group_rate"}  # in the metrics of runs made before it changed
    return metrics.rename({k: v for k, v in old_name.items() if k in metrics.columns})


def tool_success_by_round(run: str | Path) -> pl.DataFrame:
    """Per step and round: calls run, and the share that ended ok, in error, or timed out."""
    scan = _scan(RunFolder(Path(run)).round_files(OBSERVATIONS_FILE))
    if scan is None:
        return _empty(step=pl.Int32, round=pl.Int32, calls=pl.UInt32)
    return (
        scan.filter(pl.col("call_id").is_not_null() & (pl.col("exec_status") != REFUSED))
        .group_by("step", "round")
        .agg(
            pl.len().alias("calls"),
            (pl.col("exec_status") == "ok").mean().alias("ok_rate"),
            (pl.col("exec_status") == "error").mean().alias("error_rate"),
            (pl.col("exec_status") == "timeout").mean().alias("timeout_rate"),
            pl.col("exec_seconds").mean().alias("seconds_mean"),
        )
        .sort("step", "round")
        .collect()
    )


def sandbox_error_kinds(run: str | Path, up_to_step: int | None = None) -> pl.DataFrame:
    """Failed calls (of steps up to `up_to_step`, None: all) by the exception named on the last line of their
    output (Timeout for timeouts)."""
    scan = _scan(RunFolder(Path(run)).round_files(OBSERVATIONS_FILE))
    if scan is None:
        return _empty(error=pl.String, calls=pl.UInt32)
    steps = pl.col("step") <= up_to_step if up_to_step is not None else pl.lit(True)
    return (
        scan.filter(pl.col("exec_status").is_in(["error", "timeout"]) & steps)
        .with_columns(
            pl.when(pl.col("exec_status") == "timeout")
            .then(pl.lit("Timeout"))
            .otherwise(
                pl.col("tool_content")
                .str.extract_all(r"\b([A-Z]\w*(?:Error|Exception|Exit|Interrupt))\b")
                .list.last()
                .fill_null("other")
            )
            .alias("error")
        )
        .group_by("error")
        .agg(pl.len().alias("calls"))
        .sort("calls", "error", descending=[True, False])
        .collect()
    )


def length_distributions(run: str | Path) -> pl.DataFrame:
    """Per step: quantiles of trajectory length, of the model's own tokens, and of turns."""
    scan = _scan(RunFolder(Path(run)).step_files(TRAJECTORIES_FILE))
    if scan is None:
        return _empty(step=pl.Int32)
    columns = ("trajectory_tokens", "sampled_tokens", "num_turns")
    return (
        scan.group_by("step")
        .agg(
            *[  # interpolated, as numpy's default: the median of 370 and 387 is 378.5, not one of them
                pl.col(c).quantile(q, interpolation="linear").alias(f"{c}_p{int(q * 100)}")
                for c in columns
                for q in (0.1, 0.5, 0.9)
            ],
            *[pl.col(c).max().alias(f"{c}_max") for c in columns],
        )
        .sort("step")
        .collect()
    )


def trajectory_lengths(run: str | Path) -> pl.DataFrame:
    """One row per trajectory: its step and its length in tokens (prompt, turns and observations)."""
    scan = _scan(RunFolder(Path(run)).step_files(TRAJECTORIES_FILE))
    if scan is None:
        return _empty(step=pl.Int32, trajectory_tokens=pl.Int64)
    return scan.select("step", "trajectory_tokens").sort("step").collect()


def solve_rates(run: str | Path) -> pl.DataFrame:
    """Per question (example_id) and step: the share of its group that was correct."""
    scan = _scan(RunFolder(Path(run)).step_files(TRAJECTORIES_FILE))
    if scan is None:
        return _empty(example_id=pl.String, step=pl.Int32, solve_rate=pl.Float64)
    return (
        scan.group_by("example_id", "step")
        .agg(pl.col("correct").mean().alias("solve_rate"), pl.len().alias("samples"))
        .sort("example_id", "step")
        .collect()
    )


def worst_trajectories(run: str | Path, count: int = 10, up_to_step: int | None = None) -> pl.DataFrame:
    """Wrong trajectories (of steps up to `up_to_step`, None: all) that cost the most tokens, with how they
    ended: the ones to read first."""
    scan = _scan(RunFolder(Path(run)).step_files(TRAJECTORIES_FILE))
    if scan is None:
        return _empty(step=pl.Int32)
    steps = pl.col("step") <= up_to_step if up_to_step is not None else pl.lit(True)
    return (
        scan.filter(~pl.col("correct") & steps)
        .sort(["trajectory_tokens", "step", "question_index", "group_index"], descending=[True, False, False, False])
        .select(
            "step",
            "question_index",
            "group_index",
            "example_id",
            "stop_reason",
            "num_turns",
            "code_calls",
            "trajectory_tokens",
            "extracted_answer",
            "answer",
            "final_text",
        )
        .head(count)
        .collect()
    )


def eval_by_checkpoint(run: str | Path) -> pl.DataFrame:
    """Every evaluation summary of the run: data set, mode, checkpoint step (-1 = base or the cold start),
    metrics, `evaluation` (its folder, e.g. `synthetic_eval-1a2b3c4d5e/retool-n4`: data and sampling), and
    `position`, the policy's place in training order (base -2, cold start -1, then steps)."""
    paths = RunFolder(Path(run)).evaluation_files(SUMMARY_FILE)
    if not paths:
        return _empty(evaluation=pl.String, dataset=pl.String, mode=pl.String, step=pl.Int64, position=pl.Int64)
    evals = pl.concat(
        [
            pl.read_parquet(path).with_columns(evaluation=pl.lit(f"{path.parents[2].name}/{path.parents[1].name}"))
            for path in paths
        ],
        how="diagonal_relaxed",
    )
    is_sft = pl.col("policy") == "sft" if "policy" in evals.columns else pl.lit(False)
    position = pl.when(pl.col("step") >= 0).then(pl.col("step")).when(is_sft).then(-1).otherwise(-2)
    checkpoint = pl.when(position == -2).then(pl.lit("base")).when(position == -1).then(pl.lit("SFT"))
    checkpoint = checkpoint.otherwise(pl.format("step {}", pl.col("step")))
    limit = pl.col("questions_limit") if "questions_limit" in evals.columns else pl.lit(None)
    questions = (
        pl.when(limit.fill_null(0) > 0)
        .then(pl.format("first {}", pl.col("questions")))
        .otherwise(pl.format("all {}", pl.col("questions")))
    )
    return evals.with_columns(
        position.alias("position"), checkpoint.alias("checkpoint"), questions.alias("questions_asked")
    ).sort("evaluation", "position")
