"""The summary stages: a training step's metrics, an evaluation's scores, and the before/after table
of a run's evaluations with its report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retool.config.settings import RunSettings
from retool.data.conversations import read_conversations
from retool.data.examples import read_examples
from retool.evaluation.metrics import describe_step, metrics_table, stage_seconds, step_metrics
from retool.evaluation.report import make_report
from retool.evaluation.scores import before_after_markdown, paired_difference, question_groups, summarize_eval
from retool.evaluation.spec import EvalSpec, content_hash
from retool.evaluation.tracking import Tracker, scalars
from retool.files.atomic import write_text_atomically
from retool.files.layout import StepFolder
from retool.files.tables import OBSERVATIONS, TRAJECTORIES, read_table, write_table_atomically
from retool.sandbox.call import Sandbox
from retool.training.record import StepMetrics


def metrics_stage(
    folder: StepFolder,
    tracker: Tracker,
    step: int,
    training: StepMetrics,
    sandbox: Sandbox,
    stages: Sequence[str],
    training_stage: str,
) -> str:
    """Writes the step's metrics.parquet (and logs its scalars to the run's tracker), with the wall time of each
    of the rollout's `stages` (the names their timings were recorded under) and of the training stage;
    returns its line."""
    observations = [read_table(path, OBSERVATIONS) for path in folder.all_observations()]
    seconds = stage_seconds(folder.timings)
    metrics = step_metrics(
        step,
        read_table(folder.trajectories, TRAJECTORIES),
        pa.concat_tables(observations),
        training,
        {**{stage: seconds.get(stage, 0.0) for stage in stages}, training_stage: training.seconds},
    )
    metrics["sandbox_containment"] = sandbox.containment.describe()
    write_table_atomically(metrics_table(metrics), folder.metrics)
    tracker.log(step, scalars(metrics))
    return describe_step(metrics)


def evaluate_stage(
    trajectories: pa.Table, evaluation: EvalSpec, step: int, out: str | Path, tracker: Tracker | None = None
) -> dict:
    """Writes the evaluation's summary.parquet and logs its scores to the run's tracker, under
    eval/<evaluation>/<base|sft|rl>/ at the checkpoint's step (-1 before RL)."""
    stage = ("sft" if evaluation.sft else "base") if step < 0 else "rl"
    policy = stage if step < 0 else f"step {step}"
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
    if tracker is not None:
        scores = scalars({name: value for name, value in summary.items() if name not in ("temperature", "top_p")})
        tracker.log(step, scores, prefix=f"eval/{evaluation.name}/{stage}/")
    return summary


def training_sources(settings: RunSettings) -> frozenset[str]:
    """The data sources (a synthetic problem's family) of the run's training files: RL data and cold start."""
    sources = {example.data_source for example in read_examples(settings.data.train)}
    if settings.cold_start.data:
        sources |= {conversation.data_source for conversation in read_conversations(settings.cold_start.data)}
    return frozenset(sources)


def before_after_stage(
    run_dir: Path,
    evaluations: list[tuple[str, StepFolder]],
    trained_sources: frozenset[str],
    out: Path,
    report: Path,
    step: int,
) -> str:
    """The before/after table of a run's evaluations (label, evaluation folder; the last is the final
    policy, compared with each earlier one question by question), for in-family and held-out-family
    questions apart, written to `out`; then the run's report of steps up to `step`, evaluations included,
    under `report`.
    Returns the table."""
    n = pq.read_table(evaluations[0][1].summary).column("n")[0].as_py()
    trajectories = {label: read_table(folder.trajectories, TRAJECTORIES) for label, folder in evaluations}
    (final, _), earlier = evaluations[-1], evaluations[:-1]
    groups = []
    for group, final_part in question_groups(trajectories[final], trained_sources).items():
        ids = pa.array(sorted(set(final_part.column("example_id").to_pylist())))
        parts = {
            label: table.filter(pc.is_in(table.column("example_id"), value_set=ids))
            for label, table in trajectories.items()
        }
        summaries = [(label, summarize_eval(parts[label], n)) for label, _ in evaluations]
        differences = [(f"{final} - {label}", paired_difference(parts[label], parts[final])) for label, _ in earlier]
        groups.append((group, summaries, differences))
    table = before_after_markdown(groups)
    write_text_atomically(out, table)
    make_report(run_dir, report, step)
    return table
