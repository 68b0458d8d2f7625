"""The summary stages: a training step's metrics, an evaluation's scores, and the before/after table
of a run's evaluations with its report."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.atomic import write_text_atomically
from jobs.evaluation import before_after_markdown, paired_difference, summarize_eval
from jobs.metrics import describe_step, export_tensorboard, metrics_table, stage_seconds, step_metrics
from jobs.report import make_report
from jobs.runs import EvalSpec, content_hash
from jobs.sandbox import Sandbox
from jobs.tables import OBSERVATIONS, TRAJECTORIES, read_table, write_table_atomically
from jobs.trainer_config import StepMetrics


def metrics_stage(folder: Path, run_dir: Path, step: int, training: StepMetrics, sandbox: Sandbox) -> str:
    """Writes step=NNNN/metrics.parquet (and TensorBoard scalars when available); returns its line."""
    observations = [
        read_table(path, OBSERVATIONS) for path in sorted(folder.glob("shard=*/round=*/observations.parquet"))
    ]
    metrics = step_metrics(
        step,
        read_table(folder / "trajectories.parquet", TRAJECTORIES),
        pa.concat_tables(observations),
        training,
        stage_seconds(folder),
    )
    metrics["sandbox_containment"] = sandbox.containment.describe()
    write_table_atomically(metrics_table(metrics), folder / "metrics.parquet")
    export_tensorboard(run_dir / "tensorboard", metrics)
    return describe_step(metrics)


def evaluate_stage(trajectories: pa.Table, evaluation: EvalSpec, step: int, out: str | Path) -> dict:
    policy = ("sft" if evaluation.sft else "base") if step < 0 else f"step {step}"
    summary = {
        "dataset": evaluation.dataset,
        "dataset_sha256": content_hash(evaluation.dataset),  # the leading digits, as in the folder's name
        "questions_limit": evaluation.limit,
        "temperature": evaluation.temperature,
        "top_p": evaluation.top_p,
        "mode": evaluation.mode,
        "step": step,
        "policy": policy,
        **summarize_eval(trajectories, evaluation.n),
    }
    write_table_atomically(pa.Table.from_pylist([summary]), out)
    return summary


def before_after_stage(run_dir: Path, evaluations: list[tuple[str, Path]], out: Path, report: Path) -> str:
    """The before/after table of a run's evaluations (label, evaluation folder; the first is the
    reference of the paired differences, the last the final policy), written to `out`; then the
    run's report, evaluations included, under `report`. Returns the table."""
    summaries = [(label, pq.read_table(folder / "summary.parquet").to_pylist()[0]) for label, folder in evaluations]
    trajectories = {label: read_table(folder / "trajectories.parquet", TRAJECTORIES) for label, folder in evaluations}
    (final, _), earlier = evaluations[-1], evaluations[:-1]
    differences = [
        (f"{final} - {label}", paired_difference(trajectories[label], trajectories[final])) for label, _ in earlier
    ]
    table = before_after_markdown(summaries, differences)
    write_text_atomically(out, table)
    make_report(run_dir, report)
    return table
