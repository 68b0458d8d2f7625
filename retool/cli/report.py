"""`python -m retool report runs/NAME`: plots and a short Markdown summary of a run."""

from __future__ import annotations

import argparse
from pathlib import Path

from retool.evaluation.report import make_report
from retool.files.layout import RunFolder


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m retool report", description=__doc__)
    parser.add_argument("run", type=Path, help="run folder, e.g. runs/cpu-default")
    parser.add_argument("--out", type=Path, help="folder for the plots and report.md (default: RUN/report)")
    args = parser.parse_args()
    if not RunFolder(args.run).config.is_file():
        parser.error(f"{args.run}: no such run folder (a run folder holds the config.json its first command wrote)")
    print(make_report(args.run, args.out))


if __name__ == "__main__":
    main()
