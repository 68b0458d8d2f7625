"""Per-process state of a pipeline worker: the checked run, its protocol, sandbox and round files."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.atomic import write_text_atomically
from jobs.evaluation import before_after_markdown, paired_difference, summarize_eval
from jobs.metrics import describe_step, export_tensorboard, metrics_table, stage_seconds, step_metrics
from jobs.protocol import ChatProtocol, load_tokenizer
from jobs.report import make_report
from jobs.runs import EvalSpec, step_folder
from jobs.sandbox import Sandbox, SandboxConfig
from jobs.settings import RunSettings, check_machine, check_training, freeze, resolve_model
from jobs.stages import RoundFiles
from jobs.tables import OBSERVATIONS, SAMPLES, TRAJECTORIES, read_table, write_table_atomically
from jobs.trainer_config import StepMetrics


@lru_cache(maxsize=None)
def prepare_run(settings: RunSettings) -> None:
    """Once per process and run: fail early on settings this machine cannot run, then freeze them."""
    check_training(settings)
    check_machine(settings)
    freeze(settings)
    if settings.use_tools:
        sandbox_for(settings).prewarm()  # before Luigi forks task processes: they all use its zygote


def protocol_for(settings: RunSettings) -> ChatProtocol:
    kwargs = json.dumps(settings.template_kwargs(), sort_keys=True)
    return _protocol(settings.model, settings.tool_format, settings.chat_template, settings.use_tools, kwargs)


@lru_cache(maxsize=4)
def _protocol(model: str, tool_format: str, chat_template: str, use_tools: bool, template_kwargs: str) -> ChatProtocol:
    """One per tokenizer and template (loading a tokenizer takes most of a second), shared by runs."""
    return ChatProtocol(
        load_tokenizer(resolve_model(model)),
        tool_format=tool_format,
        chat_template=chat_template or None,
        tools=use_tools,
        template_kwargs=json.loads(template_kwargs),
    )


def sandbox_for(settings: RunSettings) -> Sandbox:
    return _sandbox(settings.sandbox_config(), protocol_for(settings).forbidden_strings)


@lru_cache(maxsize=4)
def _sandbox(config: SandboxConfig, forbidden_strings: tuple[str, ...]) -> Sandbox:
    """One per sandbox configuration, so its pre-warmed servers serve every task of the process."""
    return Sandbox(config, forbidden_strings=forbidden_strings)


def round_dir(step_folder: Path, shard: int, round_index: int) -> Path:
    return step_folder / f"shard={shard:02d}" / f"round={round_index:02d}"


def read_round_files(step_folder: Path, shard: int, rounds: int) -> list[RoundFiles]:
    """The samples and observations of the first `rounds` rounds of one shard."""
    files = []
    for round_index in range(rounds):
        folder = round_dir(step_folder, shard, round_index)
        files.append(
            RoundFiles(
                read_table(folder / "samples.parquet", SAMPLES),
                read_table(folder / "observations.parquet", OBSERVATIONS),
            )
        )
    return files


def metrics_stage(settings: RunSettings, step: int, training: StepMetrics) -> str:
    """Writes step=NNNN/metrics.parquet (and TensorBoard scalars when available); returns its line."""
    folder = step_folder(settings, step)
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
    metrics["sandbox_containment"] = sandbox_for(settings).containment.describe()
    write_table_atomically(metrics_table(metrics), folder / "metrics.parquet")
    export_tensorboard(settings.run_dir / "tensorboard", metrics)
    return describe_step(metrics)


def evaluate_stage(trajectories: pa.Table, evaluation: EvalSpec, step: int, out: str | Path) -> dict:
    policy = ("sft" if evaluation.sft else "base") if step < 0 else f"step {step}"
    summary = {
        "dataset": evaluation.dataset,
        "mode": evaluation.mode,
        "step": step,
        "policy": policy,
        **summarize_eval(trajectories, evaluation.n),
    }
    write_table_atomically(pa.Table.from_pylist([summary]), out)
    return summary


def before_after_stage(settings: RunSettings, evaluations: list[tuple[str, Path]], out: Path, report: Path) -> str:
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
    make_report(settings.run_dir, report)
    return table
