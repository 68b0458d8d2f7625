"""`python -m retool report runs/NAME`: plots and a short Markdown summary of a run, and its newest step's
trajectories as a page the summary links."""

from __future__ import annotations

import argparse
from pathlib import Path

from retool.evaluation.report import make_report
from retool.evaluation.viewer import PageFiles, write_page
from retool.files.layout import TRAJECTORIES_FILE, VIEW, RunFolder
from retool.run.setup import recorded_settings
from retool.run.shared import token_decoder


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m retool report", description=__doc__)
    parser.add_argument("run", type=Path, help="run folder, e.g. runs/cpu-default")
    parser.add_argument("--out", type=Path, help="folder for the plots and report.md (default: RUN/report)")
    args = parser.parse_args()
    if not RunFolder(args.run).config.is_file():
        parser.error(f"{args.run}: no such run folder (a run folder holds the config.json its first command wrote)")
    out = args.out or RunFolder(args.run).report()
    scored = RunFolder(args.run).steps_with(TRAJECTORIES_FILE)
    if scored:  # the newest step's trajectories as a page beside the report, which links it
        out.mkdir(parents=True, exist_ok=True)
        decode = token_decoder(recorded_settings(args.run).model)
        last = PageFiles.of(RunFolder(args.run).step(max(scored)))
        write_page(last, f"{args.run.name}: step {max(scored)}", decode, out / VIEW)
    print(make_report(args.run, out, view=VIEW if scored else ""))


if __name__ == "__main__":
    main()
