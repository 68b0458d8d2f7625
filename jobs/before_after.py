"""BeforeAfter: the before/after table of a run's evaluations of one data set (base model, cold start, the last
RL checkpoint), by the role of the questions' families (sft, rl, held-out) -> before-after table, then the run's
report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from retool.config.settings import RunSettings
from retool.data.conversations import read_conversations
from retool.data.examples import read_examples
from retool.evaluation.report import report_with_page
from retool.evaluation.scores import before_after_markdown, paired_difference, question_groups, summarize_eval
from retool.evaluation.viewer import PageFiles
from retool.files.atomic import write_text_atomically
from retool.files.tables import TRAJECTORIES, read_table
from retool.run.shared import token_decoder


def training_sources(settings: RunSettings) -> tuple[frozenset[str], frozenset[str]]:
    """The data sources (a synthetic problem's family) of the run's cold-start conversations and of its RL data."""
    rl = frozenset(example.data_source for example in read_examples(settings.data.train))
    if not settings.cold_start.data:
        return frozenset(), rl
    return frozenset(conversation.data_source for conversation in read_conversations(settings.cold_start.data)), rl


def before_after(
    evaluations: Sequence[tuple[str, Path]],
    n: int,
    out: Path,
    report: Path,
    settings: RunSettings,
    step: int,
    page: PageFiles,
) -> str:
    """`evaluations`: (label, trajectories.parquet) of each policy, the last the final one, compared with each earlier
    one question by question; `n`: samples per question. Then the run's report of steps up to `step`, evaluations
    included, under `report`, with the page of step `step`'s trajectories drawn from `page`. Returns the table."""
    trajectories = {label: read_table(path, TRAJECTORIES) for label, path in evaluations}
    (final, _), earlier = evaluations[-1], evaluations[:-1]
    groups = []
    for group, final_part in question_groups(trajectories[final], *training_sources(settings)).items():
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
    report_with_page(report, settings, step, page, token_decoder(settings.model))
    return "\n" + table
