"""Per-step metrics: one row gathered from the files of a training step, written to
step=NNNN/metrics.parquet, printed as one line, and logged to the run's tracker."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from retool.files.atomic import write_text_atomically
from retool.files.tables import OBSERVATIONS, TRAJECTORIES, read_table, write_table_atomically
from retool.recoveries import CAUSES
from retool.rollout.scoring import zero_variance_groups
from retool.rollout.state import REFUSED, STOP_REASONS
from retool.training.record import StepMetrics

# The stages of a training step, by the names their wall times are recorded under (the pipeline's tasks, and
# BuildDatums: the datums' join that TrainStep runs while it trains): every step's metrics has a seconds_<stage>
# column for each, 0 for a stage that did not run in that command.
ROLLOUT_STAGES = (
    "Prompts", "SampleRound", "ExecuteRound", "ScoreShard", "ScoreTrajectories", "ShardDatums", "BuildDatums"
)  # fmt: skip
TRAINING_STAGE = "TrainStep"


def record_stage_seconds(
    timings: Path, task_id: str, stage: str, seconds: float, parquet_seconds: float, recovered: dict[str, int]
) -> None:
    """Wall time of one finished task's run(), the part of it spent reading and writing Parquet, when it ended
    (Unix time: which stages overlapped) and the faults it survived by cause (retool.recoveries), as one file in
    the step's folder of timings."""
    entry = {"stage": stage, "seconds": seconds, "parquet_seconds": parquet_seconds, "ended": time.time()}
    entry |= {"recovered": recovered} if recovered else {}
    write_text_atomically(timings / f"{task_id}.json", json.dumps(entry))


def stage_timings(timings: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(timings.glob("*.json"))]


def stage_seconds(timings: Path) -> dict[str, float]:
    totals: Counter[str] = Counter()
    for entry in stage_timings(timings):
        totals[entry["stage"]] += entry["seconds"]
    return dict(totals)


def stage_recoveries(timings: Path) -> dict[str, int]:
    """The step's `retries_<cause>` columns: the faults its stages survived, summed over their tasks."""
    totals = Counter({cause: 0 for cause in CAUSES})
    for entry in stage_timings(timings):
        totals.update(entry.get("recovered", {}))
    return {f"retries_{cause}": count for cause, count in totals.items()}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


METRICS_COLUMNS = ("kind", "exec_status", "exec_seconds")  # of observations.parquet: what step_metrics reads


def write_step_metrics(
    out: Path,
    step: int,
    trajectories: Path,
    observations: Sequence[Path],
    timings: Path,
    training: StepMetrics,
    **extra,
) -> dict:
    """The step's metrics.parquet, from its files (its trajectories, every round's observations and its stages'
    timings), the update's figures and `extra` columns; returns its row."""
    seconds = stage_seconds(timings)
    row = step_metrics(
        step,
        read_table(trajectories, TRAJECTORIES),
        pa.concat_tables([read_table(path, OBSERVATIONS, METRICS_COLUMNS) for path in observations]),
        training,
        {**{stage: seconds.get(stage, 0.0) for stage in ROLLOUT_STAGES}, TRAINING_STAGE: training.seconds},
    )
    row.update(stage_recoveries(timings) | extra)
    write_table_atomically(pa.Table.from_pylist([row]), out)
    return row


def step_metrics(
    step: int, trajectories: pa.Table, observations: pa.Table, training: StepMetrics, seconds: dict[str, float]
) -> dict:
    rows = trajectories.to_pylist()
    valid = [r for r in rows if r["valid_format"]]
    turns = [r for r in observations.to_pylist() if r["kind"] is not None]
    calls = [r for r in turns if r["exec_status"] not in (None, REFUSED)]  # calls the sandbox ran
    attempted = [r for r in turns if r["kind"] in ("tool", "invalid")]
    metrics = {
        "step": step,
        "trajectories": len(rows),
        "reward_mean": _mean([r["reward"] for r in rows]),
        "correct": _mean([float(r["correct"]) for r in rows]),
        "format": _mean([float(r["valid_format"]) for r in rows]),
        "valid_accuracy": _mean([float(r["correct"]) for r in valid]),  # correct among answers in a valid format
        "sampled_tokens_correct": _mean([float(r["sampled_tokens"]) for r in rows if r["correct"]]),
        "sampled_tokens_wrong": _mean([float(r["sampled_tokens"]) for r in rows if not r["correct"]]),
        "turns": _mean([float(r["num_turns"]) for r in rows]),
        "code_calls": _mean([float(r["code_calls"]) for r in rows]),
        "trajectory_tokens": _mean([float(r["trajectory_tokens"]) for r in rows]),
        "valid_tool_call_rate": _mean([float(r["kind"] == "tool") for r in attempted]),
        "zero_variance_group_rate": zero_variance_groups((r["question_index"], r["reward"]) for r in rows)
        / max(1, len({r["question_index"] for r in rows})),
        "groups_drawn": len({r["question_index"] for r in rows}),
        "groups_kept": len({r["question_index"] for r in rows if r["kept"]}),
        # Steps between the policy that sampled and the one trained (0: on-policy; NaN: not recorded)
        "staleness": _mean([float(step - 1 - r["policy_step"]) for r in rows if r["policy_step"] is not None]),
        "sandbox_calls": len(calls),
        "sandbox_ok_rate": _mean([float(r["exec_status"] == "ok") for r in calls]),
        "sandbox_error_rate": _mean([float(r["exec_status"] == "error") for r in calls]),
        "sandbox_timeout_rate": _mean([float(r["exec_status"] == "timeout") for r in calls]),
        "sandbox_seconds_mean": _mean([r["exec_seconds"] for r in calls]),
        "sandbox_seconds_max": max((r["exec_seconds"] for r in calls), default=float("nan")),
    }
    metrics.update({f"stop_{reason}": sum(r["stop_reason"] == reason for r in rows) for reason in STOP_REASONS})
    training_fields = asdict(training)
    metrics.update(
        {f"train_{name}": value for name, value in training_fields.items() if name not in ("trajectories", "seconds")}
    )
    metrics["train_skipped"] = bool(training.skipped)
    metrics.update({f"seconds_{stage}": stage_time for stage, stage_time in seconds.items()})
    return metrics


def describe_step(metrics: dict) -> str:
    stops = ", ".join(
        f"{reason} {metrics[f'stop_{reason}']}" for reason in STOP_REASONS if metrics.get(f"stop_{reason}")
    )
    return (
        f"step {metrics['step']}: reward {metrics['reward_mean']:+.3f}, correct {metrics['correct']:.3f}, format "
        f"{metrics['format']:.3f}, correct of valid {metrics['valid_accuracy']:.3f}, turns {metrics['turns']:.2f}, "
        f"code calls {metrics['code_calls']:.2f}, sandbox ok {metrics['sandbox_ok_rate']:.2f}, sampled tokens "
        f"{metrics['sampled_tokens_correct']:.0f} correct / {metrics['sampled_tokens_wrong']:.0f} wrong, "
        f"groups kept {metrics['groups_kept']} of {metrics['groups_drawn']} (zero-variance "
        f"{metrics['zero_variance_group_rate']:.2f}), stops: {stops or 'none'}\n"
        f"  update: {metrics['train_updates']} optimizer steps on {metrics['train_datums']} datums, loss "
        f"{metrics['train_loss']:+.4f}, entropy {metrics['train_entropy']:.3f}, KL(before||after) k1 "
        f"{metrics['train_kl_k1']:.2e} k3 {metrics['train_kl_k3']:.2e}"
        + (f", KL to the RL base {kl:.2e}" if (kl := metrics.get("train_kl_reference")) else "")
        + f", clipped {metrics['train_clip_fraction']:.3f}, "
        f"ratio outside the clip range after {metrics['train_ratio_outside_clip']:.3f}, staleness "
        f"{metrics['staleness']:.0f}, importance weight {metrics['train_importance_weight']:.3f} "
        f"({metrics['train_importance_limited']:.3f} limited)"
        + (" (update skipped)" if metrics["train_skipped"] else "")
    )
