"""`python -m retool export-sft runs/NAME`: the correct trajectories of a run's training steps as cold-start
conversations in the project's layout (rejection-sampling fine-tuning data); `--cold-start-data FILE` of
another run trains on them. Evaluations are never exported: their questions are held out."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from retool.config.settings import RunSettings, SettingsError
from retool.data.conversations import conversation_from_row, conversation_row, write_conversations
from retool.data.examples import DataError
from retool.files import layout
from retool.files.layout import RunFolder
from retool.files.tables import TRAJECTORIES, read_table
from retool.rollout.conversations import sft_examples_table, solution_of
from retool.rollout.replay import replay_shards
from retool.run.setup import recorded_settings
from retool.run.shared import protocol_for


@dataclass(frozen=True)
class Exported:
    steps: tuple[int, ...]  # the training steps read
    trajectories: int  # their trajectories
    conversations: int  # the correct ones, written
    unreadable: int  # correct, but refused by the cold start's reader (e.g. an answer holding a tool tag): left out
    exact: int  # of those written, rendered by the cold start to exactly the sampled token sequence

    def describe(self, out: Path) -> str:
        left_out = f"; {self.unreadable} left out that the cold start would refuse" if self.unreadable else ""
        others = " (the others differ in how their text tokenizes, not in their text)"
        return (
            f"{out}: {self.conversations} correct trajectories of {self.trajectories} from steps "
            f"{', '.join(map(str, self.steps))}{left_out}; {self.exact} of {self.conversations} render to the sampled "
            f"tokens exactly{others if self.exact < self.conversations else ''}"
        )


def trained_steps(settings: RunSettings) -> list[int]:
    """The training steps whose trajectories are scored."""
    return RunFolder(settings.run_dir).steps_with(layout.TRAJECTORIES_FILE)


def export_stage(settings: RunSettings, steps: Sequence[int], out: Path) -> Exported:
    """Writes the correct trajectories of training steps `steps` to `out` (JSONL, the project's layout)."""
    conversations, sampled, total, unreadable = [], {}, 0, 0
    protocol, rollout = protocol_for(settings.model), settings.rollout
    for step in steps:
        folder = RunFolder(settings.run_dir).step(step)
        scores = read_table(folder.trajectories, TRAJECTORIES).to_pylist()
        correct = {(row["question_index"], row["group_index"]) for row in scores if row["correct"]}
        total += len(scores)
        rounds = [folder.rounds(shard, rollout.rounds) for shard in range(rollout.shards)]
        for trajectory in replay_shards(folder.prompts, rounds, protocol, rollout):
            if (trajectory.question_index, trajectory.group_index) not in correct:
                continue
            conversation = solution_of(trajectory, step, protocol.decode)
            try:  # what the cold start will read: a conversation it would refuse is not written
                conversation_from_row(conversation_row(conversation), 0, conversation.id, conversation.id)
            except DataError:
                unreadable += 1
                continue
            conversations.append(conversation)
            sampled[conversation.id] = trajectory.token_ids()
    if not conversations:
        raise DataError(f"{settings.run_dir}: steps {', '.join(map(str, steps))} have no correct trajectory to export")
    rendered, _ = sft_examples_table(conversations, protocol, settings.rollout)
    exact = sum(
        row["input_tokens"] + row["target_tokens"][-1:] == sampled[row["example_id"]] for row in rendered.to_pylist()
    )
    write_conversations(conversations, out)
    return Exported(tuple(steps), total, len(conversations), unreadable, exact)


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
