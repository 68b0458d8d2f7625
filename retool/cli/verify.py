"""`python -m retool verify runs/NAME`: the run checked from its own files, under the settings it froze: every
(question, branch) once in each stage's file, each round's prompt the one before extended by the completion and the
observation, budgets and stop reasons, the observations, rewards and advantages, the datums against the samples, the
checkpoints. One line per rule with what it checked and the first row that broke it; the findings in
RUN/verify.parquet; exit status 0 only when every rule holds (docs/run-folder.md, "Checking a run")."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from retool.cli.export_sft import step_list
from retool.config.settings import SettingsError
from retool.data.examples import DataError
from retool.files.layout import RunFolder
from retool.files.tables import TableError, write_table_atomically
from retool.verify.run import verify_run

FINDINGS_FILE = "verify.parquet"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m retool verify", description=__doc__)
    parser.add_argument("run", type=Path, help="run folder, e.g. runs/cpu-default")
    parser.add_argument("--steps", type=step_list, help="training steps, e.g. 0,2-4 (default: every scored step)")
    parser.add_argument("--out", type=Path, help=f"the findings' Parquet file (default: RUN/{FINDINGS_FILE})")
    args = parser.parse_args()
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


if __name__ == "__main__":
    raise SystemExit(main())
