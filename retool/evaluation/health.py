"""A run's health by step: the measures that go wrong before the reward does (the model stops answering, turns that
neither call nor answer, budgets ending more trajectories, the tool no longer called, groups with no signal, the
sampler serving other weights, the policy's entropy collapsing), each step against the run's own best, with a
warning line where a measure collapses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from retool.evaluation.analysis import metrics_by_step
from retool.files.layout import OBSERVATIONS_FILE, TRAJECTORIES_FILE, RunFolder
from retool.rollout.scoring import ENDED_BY_THE_MODEL
from retool.rollout.state import STOP_REASONS

BUDGET_STOPS = [reason for reason in STOP_REASONS if reason not in ENDED_BY_THE_MODEL]


@dataclass(frozen=True)
class Collapse:
    """A measure that has collapsed at a step: its value against the run's best so far, by a factor."""

    measure: str
    higher_is_better: bool
    factor: float  # collapsed: below best / factor (or above best x factor, for a measure that is better low)
    floor: float  # ...and worse than this, so that a measure near 0 throughout warns of nothing
    rule: str  # what the warning says

    def collapsed(self, value: float, best: float) -> bool:
        if value is None or best is None or value != value or best != best:
            return False
        if self.higher_is_better:
            return value < best / self.factor and value < self.floor
        return value > best * self.factor and value > self.floor


COLLAPSES = (
    Collapse("answered", True, 2.0, 0.5, "answered share below half its best"),
    Collapse("format", True, 2.0, 0.5, "Format below half its best"),
    Collapse("tool_call_rate", True, 2.0, 0.5, "code calls a trajectory below half their best"),
    Collapse("budget_stops", False, 2.0, 0.25, "budget stops over twice their least"),
    Collapse("void_turns", False, 2.0, 0.1, "turns that neither call nor answer over twice their least"),
    Collapse("zero_variance_groups", False, 1.5, 0.75, "groups without a signal over 1.5 times their least"),
    Collapse("entropy", True, 4.0, 1.0, "entropy below a quarter of its best: the policy is collapsing"),
)


def health_by_step(run: Path) -> pl.DataFrame:
    """One row per training step: answered share, budget stops (all and by kind), void turns, code calls a trajectory,
    sandbox errors inside correct trajectories, Format, zero-variance groups, sampler gap and entropy."""
    folder = RunFolder(run)
    trajectories = [path for path in folder.step_files(TRAJECTORIES_FILE)]
    if not trajectories:
        return pl.DataFrame({"step": []}, schema={"step": pl.Int64})
    scores = pl.concat([pl.read_parquet(p) for p in trajectories], how="diagonal_relaxed")
    by_step = scores.group_by("step").agg(
        (pl.col("stop_reason") == "answer").mean().alias("answered"),
        pl.col("stop_reason").is_in(BUDGET_STOPS).mean().alias("budget_stops"),
        *[(pl.col("stop_reason") == reason).mean().alias(f"stop_{reason}") for reason in BUDGET_STOPS],
        pl.col("code_calls").mean().alias("tool_call_rate"),
        pl.col("valid_format").mean().alias("format"),
    )
    turns = pl.concat(
        [pl.read_parquet(p, columns=["step", "question_index", "group_index", "kind", "exec_status"])
         for p in folder.round_files(OBSERVATIONS_FILE)],
        how="diagonal_relaxed",
    ).filter(pl.col("kind").is_not_null())  # fmt: skip
    void = turns.group_by("step").agg((~pl.col("kind").is_in(["tool", "answer"])).mean().alias("void_turns"))
    correct = scores.filter(pl.col("correct")).select("step", "question_index", "group_index")
    errors = (
        turns.join(correct, on=["step", "question_index", "group_index"])
        .filter(pl.col("kind") == "tool")
        .group_by("step")
        .agg((pl.col("exec_status") == "error").mean().alias("errors_in_correct"))
    )
    metrics = metrics_by_step(run)
    trained = [c for c in ("zero_variance_group_rate", "train_logprob_gap", "train_entropy") if c in metrics.columns]
    names = {"zero_variance_group_rate": "zero_variance_groups", "train_logprob_gap": "sampler_gap"}
    names["train_entropy"] = "entropy"
    table = by_step.join(void, on="step", how="left").join(errors, on="step", how="left")
    if trained:
        table = table.join(metrics.select("step", *trained).rename(names, strict=False), on="step", how="left")
    return table.sort("step")


def health_warnings(table: pl.DataFrame) -> list[str]:
    """A line for each measure that has collapsed at a step, against the run's best at the steps before it."""
    warnings = []
    for collapse in COLLAPSES:
        if collapse.measure not in table.columns:
            continue
        values = table.select("step", collapse.measure).rows()
        for index, (step, value) in enumerate(values):
            before = [v for _, v in values[:index] if v is not None and v == v]
            best = (max if collapse.higher_is_better else min)(before) if before else None
            if collapse.collapsed(value, best):
                warnings.append(f"step {step}: {collapse.measure} {value:.3f} against {best:.3f}: {collapse.rule}")
    return warnings
