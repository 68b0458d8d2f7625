"""Evaluation summaries: Average@N, Pass@N, unbiased pass@k, format rate and tool use, with 95 %
confidence intervals, from a trajectories table of an eval rollout (group size N per question)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import pyarrow as pa

from jobs.rollout import STOP_REASONS

EVAL_MODES = ("retool", "text-only")
Z_95 = 1.959964


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples is correct, from n samples of
    which c are correct: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal-approximation 95 % interval (0 for fewer than two values)."""
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, Z_95 * math.sqrt(variance / len(values))


def summarize_eval(trajectories: pa.Table, n: int) -> dict:
    """One row of eval metrics. Question-level means (Average@N, pass@k) take their interval over
    questions, since the N samples of one question are not independent."""
    rows = trajectories.to_pylist()
    by_question: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        by_question[row["question_index"]].append(row)
    if any(len(group) != n for group in by_question.values()):
        raise ValueError(f"every question needs exactly n={n} trajectories")
    correct_counts = [sum(r["correct"] for r in group) for group in by_question.values()]
    summary: dict = {"questions": len(by_question), "generations": len(rows), "n": n}
    summary["average_at_n"], summary["average_at_n_ci"] = mean_ci([c / n for c in correct_counts])
    summary["pass_at_n"] = sum(c > 0 for c in correct_counts) / len(correct_counts) if correct_counts else float("nan")
    for k in range(1, n + 1):
        summary[f"pass_at_{k}"], summary[f"pass_at_{k}_ci"] = mean_ci([pass_at_k(n, c, k) for c in correct_counts])
    for name, column in (("format", "valid_format"), ("code_calls", "code_calls"), ("turns", "num_turns")):
        summary[name], summary[f"{name}_ci"] = mean_ci([float(r[column]) for r in rows])
    for reason in STOP_REASONS:
        summary[f"stop_{reason}"] = sum(r["stop_reason"] == reason for r in rows)
    return summary


def describe_eval(summary: dict) -> str:
    n = summary["n"]
    return (
        f"Average@{n} {summary['average_at_n']:.3f} ± {summary['average_at_n_ci']:.3f}, Pass@{n} {summary['pass_at_n']:.3f}, "
        f"Format {summary['format']:.3f}, code calls {summary['code_calls']:.2f}, turns {summary['turns']:.2f} "
        f"over {summary['questions']} questions"
    )
