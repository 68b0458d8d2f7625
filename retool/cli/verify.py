"""`python -m retool verify runs/NAME`: the run checked from its own files, under the settings it froze: every
(question, branch) once in each stage's file, each round's prompt the one before extended by the completion and the
observation, budgets and stop reasons, the observations, rewards and advantages, the datums against the samples, the
checkpoints. One line per rule with what it checked and the first row that broke it; the findings in
RUN/verify.parquet; exit status 0 only when every rule holds (docs/run-folder.md, "Checking a run")."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import polars as pl

from retool.cli.export_sft import step_list
from retool.config.settings import SettingsError
from retool.data.examples import DataError
from retool.evaluation.health import health_by_step, health_warnings
from retool.files.layout import RunFolder
from retool.files.tables import TableError, write_table_atomically
from retool.verify.run import verify_run

FINDINGS_FILE = "verify.parquet"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m retool verify", description=__doc__)
    parser.add_argument("run", type=Path, help="run folder, e.g. runs/cpu-default")
    parser.add_argument("--steps", type=step_list, help="training steps, e.g. 0,2-4 (default: every scored step)")
    parser.add_argument("--out", type=Path, help=f"the findings' Parquet file (default: RUN/{FINDINGS_FILE})")
    parser.add_argument("--health", action="store_true", help="the run's health by step instead, with its warnings")
    args = parser.parse_args()
    if args.health:
        return print_health(args.run, parser)
    started = time.perf_counter()
    try:
        report = verify_run(args.run, args.steps or ())
    except (SettingsError, DataError, TableError) as error:
        parser.exit(2, f"python -m retool verify: {error}\n")
    for line in report.lines():
        print(line)
    out = args.out or RunFolder(args.run).path / FINDINGS_FILE
    write_table_atomically(report.table(), out)
    verdict = "every rule holds" if report.holds else "BROKEN: see the lines above"
    print(f"{args.run}: {verdict} ({time.perf_counter() - started:.1f} s); findings -> {out}")
    return 0 if report.holds else 1


def print_health(run: Path, parser: argparse.ArgumentParser) -> int:
    """The health table (retool/evaluation/health.py), then a line per collapse; exit 1 when any."""
    if not RunFolder(run).config.is_file():
        parser.exit(2, f"python -m retool verify: {run}: not a run folder (it holds no config.json)\n")
    table = health_by_step(run)
    shown = {"tbl_rows": -1, "tbl_cols": -1, "tbl_width_chars": 10_000, "float_precision": 3}
    with pl.Config(
        **shown, tbl_formatting="ASCII_MARKDOWN", tbl_hide_column_data_types=True, tbl_hide_dataframe_shape=True
    ):
        print(table)
    warnings = health_warnings(table)
    for warning in warnings:
        print(f"WARNING {warning}")
    print(f"{run}: {len(warnings)} warning(s) over {table.height} step(s)")
    return 1 if warnings else 0


if __name__ == "__main__":
    raise SystemExit(main())
