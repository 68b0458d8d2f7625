"""`python -m retool view runs/NAME [--step N | --eval FOLDER] [--out FILE]`: a step's or an evaluation's
trajectories as one HTML page that opens from disk (retool/evaluation/viewer.py): the turns, reward and
advantage of each, and its tokens by role with the ones the loss trains on marked."""

from __future__ import annotations

import argparse
from pathlib import Path

from retool.config.settings import SettingsError
from retool.data.examples import DataError
from retool.evaluation.viewer import PageFiles, write_page
from retool.files import layout
from retool.files.layout import RunFolder, StepFolder
from retool.run.setup import recorded_settings
from retool.run.shared import token_decoder


def folder_to_view(run: Path, step: int | None, evaluation: str | None) -> StepFolder:
    """The step's folder (default: the newest scored step), or an evaluation's checkpoint folder under RUN/eval."""
    folder = RunFolder(run)
    if evaluation is not None:
        found = StepFolder(run / "eval" / evaluation)
        if not found.trajectories.is_file():
            scored = [
                str(p.parent.relative_to(run / "eval")) for p in folder.evaluation_files(layout.TRAJECTORIES_FILE)
            ]
            raise DataError(f"{run}: no evaluation {evaluation!r}; evaluated: {', '.join(scored) or 'none'}")
        return found
    scored = folder.steps_with(layout.TRAJECTORIES_FILE)
    if not scored or (step is not None and step not in scored):
        raise DataError(
            f"{run}: no scored trajectories of step {step}; scored: {', '.join(map(str, scored)) or 'none'}"
        )
    return folder.step(step if step is not None else max(scored))


def write_view(run: Path, folder: StepFolder, out: Path) -> int:
    """Writes the page of the trajectories in `folder`; returns how many it shows."""
    decode = token_decoder(recorded_settings(run).model)
    return write_page(PageFiles.of(folder), f"{run.name}: {folder.path.relative_to(run)}", decode, out)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m retool view", description=__doc__)
    parser.add_argument("run", type=Path, help="run folder, e.g. runs/cpu-default")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="training step (default: the newest scored)")
    which.add_argument("--eval", help="an evaluation's checkpoint folder under RUN/eval, e.g. "
                       "synthetic_eval-2caba87255/retool-n2-first32/checkpoint=step0003")  # fmt: skip
    parser.add_argument("--out", type=Path, help=f"HTML file to write (default: {layout.VIEW} in the shown folder)")
    args = parser.parse_args()
    try:
        folder = folder_to_view(args.run, args.step, args.eval)
        out = args.out or folder.path / layout.VIEW
        shown = write_view(args.run, folder, out)
    except (SettingsError, DataError) as error:
        parser.exit(2, f"python -m retool view: {error}\n")
    print(f"{out}: {shown} trajectories (open it in a browser; no server needed)")
    return 0
