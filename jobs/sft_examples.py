"""SFTExamples: the cold-start conversations rendered through the rollout's protocol -> sft/examples.parquet."""

from __future__ import annotations

from pathlib import Path

from retool.config.settings import RunSettings, SettingsError
from retool.data.conversations import read_conversations
from retool.files.tables import write_table_atomically
from retool.rollout.conversations import sft_examples_table
from retool.rollout.stage_tables import describe_datums
from retool.run.shared import protocol_for


def sft_examples(out: Path, settings: RunSettings) -> str:
    """Reads the conversations of `[cold_start] data`; those over the budgets or turn limits are left out."""
    path = settings.cold_start.data
    table, skipped = sft_examples_table(read_conversations(path), protocol_for(settings.model), settings.rollout)
    if not table.num_rows:
        raise SettingsError(f"setting [cold_start] data = {path!r}: no conversation fits the run's budgets")
    write_table_atomically(table, out)
    left_out = f" ({skipped} conversations over the budgets or turn limits, left out)" if skipped else ""
    return describe_datums(table, kind="SFT examples") + left_out
