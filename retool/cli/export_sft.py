"""`python -m retool export-sft runs/NAME`: the correct trajectories of a run's training steps as cold-start
conversations in the project's layout (rejection-sampling fine-tuning data); `--cold-start-data FILE` of
another run trains on them. Evaluations are never exported: their questions are held out."""

from __future__ import annotations

import argparse
from pathlib import Path

from retool.config.settings import SettingsError
from retool.data.examples import DataError
from retool.files.layout import RunFolder
from retool.run.setup import recorded_settings
from retool.stages.export import export_stage, trained_steps


def step_list(text: str) -> list[int]:
    """'0,2-4' -> [0, 2, 3, 4]."""
    steps = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            steps += range(int(first), int(last or first) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected steps like 0,2-4, got {text!r}") from None
    return sorted(set(steps))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m retool export-sft", description=__doc__)
    parser.add_argument("run", type=Path, help="run folder, e.g. runs/cpu-default")
    parser.add_argument("--steps", type=step_list, help="training steps, e.g. 0,2-4 (default: every scored step)")
    parser.add_argument("--out", type=Path, help="JSONL file to write (default: RUN/exported-sft.jsonl)")
    args = parser.parse_args()
    try:
        settings = recorded_settings(args.run)
        scored = trained_steps(settings)
        steps = args.steps or scored
        missing = [step for step in steps if step not in scored]
        if not steps or missing:
            raise DataError(
                f"{args.run}: no scored trajectories for step(s) {', '.join(map(str, missing)) or 'any'}; "
                f"scored: {', '.join(map(str, scored)) or 'none'}"
            )
        out = args.out or RunFolder(args.run).exported_sft
        print(export_stage(settings, steps, out).describe(out))
    except (SettingsError, DataError) as error:
        parser.exit(2, f"python -m retool export-sft: {error}\n")


if __name__ == "__main__":
    main()
