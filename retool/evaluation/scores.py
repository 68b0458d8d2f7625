"""Evaluation summaries: Average@N, Pass@N, unbiased pass@k, format rate and tool use, with 95 %
confidence intervals, from a trajectories table of an eval rollout (group size N per question)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import pyarrow as pa

from retool.rollout.state import STOP_REASONS

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
    summary["valid_accuracy"], summary["valid_accuracy_ci"] = mean_ci(  # correct among answers in a valid format
        [float(r["correct"]) for r in rows if r["valid_format"]]
    )
    summary["tool_use"], summary["tool_use_ci"] = mean_ci([float(r["code_calls"] > 0) for r in rows])  # a call ran
    summary["valid_tool_use"], summary["valid_tool_use_ci"] = mean_ci(  # a call ran without an error
        [float(r["code_calls_ok"] > 0) for r in rows]
    )
    for reason in STOP_REASONS:
        summary[f"stop_{reason}"] = sum(r["stop_reason"] == reason for r in rows)
    return summary


def describe_eval(summary: dict) -> str:
    n = summary["n"]
    return (
        f"Average@{n} {summary['average_at_n']:.3f} ± {summary['average_at_n_ci']:.3f}, Pass@{n} "
        f"{summary['pass_at_n']:.3f}, "
        f"Format {summary['format']:.3f}, code calls {summary['code_calls']:.2f}, turns {summary['turns']:.2f} "
        f"over {summary['questions']} questions"
    )


def paired_difference(before: pa.Table, after: pa.Table) -> tuple[float, float, int]:
    """Mean over questions of (after's correct rate - before's) on the questions both evaluated, with
    the half-width of its 95 % interval and the number of questions: pairing by question removes the
    spread of question difficulty from the comparison."""

    def rates(table: pa.Table) -> dict[str, float]:
        counts: dict[str, list[int]] = defaultdict(list)
        for row in table.select(["example_id", "correct"]).to_pylist():
            counts[row["example_id"]].append(int(row["correct"]))
        return {key: sum(values) / len(values) for key, values in counts.items()}

    first, second = rates(before), rates(after)
    common = sorted(set(first) & set(second))
    mean, half_width = mean_ci([second[key] - first[key] for key in common])
    return mean, half_width, len(common)


# The question groups of a before/after table: the role of a question's family (its data_source) in the run's
# training files.
SFT_FAMILIES, RL_FAMILIES, HELD_OUT = "sft families", "rl families", "held-out families"


def question_groups(
    trajectories: pa.Table, cold_start_sources: frozenset[str], rl_sources: frozenset[str]
) -> dict[str, pa.Table]:
    """The evaluation's trajectories by the role of their family: sft families (the cold start's conversations
    have it; RL may train on it too), rl families (only the RL data has it: what RL must learn by itself) and
    held-out families (no training file has it); a group without questions is left out."""
    roles = [
        SFT_FAMILIES if source in cold_start_sources else RL_FAMILIES if source in rl_sources else HELD_OUT
        for source in trajectories.column("data_source").to_pylist()
    ]
    groups = {label: trajectories.filter(pa.array([role == label for role in roles])) for label in set(roles)}
    return {label: groups[label] for label in (SFT_FAMILIES, RL_FAMILIES, HELD_OUT) if label in groups}


def _rate(mean: float, half_width: float) -> str:
    """A rate and its interval, or a dash where there was nothing to take it over."""
    return "—" if math.isnan(mean) else f"{mean:.3f} ± {half_width:.3f}"


def budget_stop_share(summary: dict) -> float:
    """The share of trajectories a budget ended (calls, turns or tokens spent), neither answered nor invalid."""
    stopped = sum(summary[f"stop_{reason}"] for reason in STOP_REASONS if reason not in ("answer", "invalid"))
    return stopped / summary["generations"] if summary["generations"] else float("nan")


def before_after_markdown(groups: list[tuple[str, list[tuple[str, dict]], list[tuple[str, tuple]]]]) -> str:
    """The comparison `make run` ends with. First the change per group of questions: the last policy minus each
    earlier one (the nearest first), paired question by question, and how Format and the budget stops moved from
    the nearest; then one row per policy; then the paired differences in words. `groups`: (label, [(policy,
    summary)], [(difference label, paired difference)]), the policies in order, the last the final one."""
    n = groups[0][1][0][1]["n"]
    differences = [difference for difference, _ in reversed(groups[0][2])]
    final, nearest = groups[0][1][-1][0], groups[0][1][-2][0]
    lines = [
        f"| questions | {' | '.join(f'{name} (Average@{n})' for name in differences)} | Format {nearest} → {final} "
        f"| budget stops {nearest} → {final} |",
        "|---" * (len(differences) + 3) + "|",
    ]
    for label, summaries, paired in groups:
        before, after = summaries[-2][1], summaries[-1][1]
        changes = " | ".join(f"{mean:+.3f} ± {half_width:.3f}" for _, (mean, half_width, _) in reversed(paired))
        lines.append(
            f"| {label} ({after['questions']}) | {changes} | {before['format']:.3f} → {after['format']:.3f} | "
            f"{budget_stop_share(before):.3f} → {budget_stop_share(after):.3f} |"
        )
    lines += [
        "",
        f"| questions | policy | Average@{n} | Pass@{n} | Format | correct of valid | valid code call | tool calls |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, summaries, _ in groups:
        for row, (policy, s) in enumerate(summaries):
            questions = f"{label} ({s['questions']})" if row == 0 else ""
            lines.append(
                f"| {questions} | {policy} | {s['average_at_n']:.3f} ± {s['average_at_n_ci']:.3f} | "
                f"{s['pass_at_n']:.3f} | {s['format']:.3f} ± {s['format_ci']:.3f} | "
                f"{_rate(s['valid_accuracy'], s['valid_accuracy_ci'])} | {s['valid_tool_use']:.3f} | "
                f"{s['code_calls']:.2f} ± {s['code_calls_ci']:.2f} |"
            )
    lines.append("")
    for label, _, paired in groups:
        for difference, (mean, half_width, questions) in paired:
            lines.append(
                f"{label}: {difference}: Average@{n} {mean:+.3f} ± {half_width:.3f} (95 % interval of the paired "
                f"difference over {questions} questions)"
            )
    return "\n".join(lines) + "\n"
