"""Per-process state of a pipeline worker: the checked run, its protocol, sandbox and round files."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from jobs.protocol import ChatProtocol, load_tokenizer
from jobs.sandbox import Sandbox
from jobs.settings import RunSettings, check_machine, freeze, resolve_model
from jobs.stages import RoundFiles
from jobs.tables import OBSERVATIONS, SAMPLES, read_table


@lru_cache(maxsize=None)
def prepare_run(settings: RunSettings) -> None:
    """Once per process and run: fail early on settings this machine cannot run, then freeze them."""
    check_machine(settings)
    freeze(settings)


@lru_cache(maxsize=4)
def protocol_for(settings: RunSettings) -> ChatProtocol:
    tokenizer = load_tokenizer(resolve_model(settings.model))
    return ChatProtocol(tokenizer, tool_format=settings.tool_format, chat_template=settings.chat_template or None)


@lru_cache(maxsize=4)
def sandbox_for(settings: RunSettings) -> Sandbox:
    return Sandbox(settings.sandbox_config(), forbidden_strings=protocol_for(settings).forbidden_strings)


def round_dir(settings: RunSettings, step: int, shard: int, round_index: int) -> Path:
    return settings.run_dir / f"step={step:04d}" / f"shard={shard:02d}" / f"round={round_index:02d}"


def read_round_files(settings: RunSettings, step: int, shard: int, rounds: int) -> list[RoundFiles]:
    """The samples and observations of the first `rounds` rounds of one shard."""
    files = []
    for round_index in range(rounds):
        folder = round_dir(settings, step, shard, round_index)
        files.append(RoundFiles(read_table(folder / "samples.parquet", SAMPLES), read_table(folder / "observations.parquet", OBSERVATIONS)))
    return files
