"""The export stage: a run's correct rollouts written as cold-start conversations, checked by rendering them
as the cold start would."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from retool.config.settings import RunSettings
from retool.data.conversations import conversation_from_row, conversation_row, write_conversations
from retool.data.examples import DataError
from retool.files import layout
from retool.files.layout import RunFolder
from retool.files.tables import TRAJECTORIES, read_table
from retool.rollout.export import solution_of
from retool.run.context import context_for
from retool.training.cold_start import sft_examples_table


@dataclass(frozen=True)
class Exported:
    steps: tuple[int, ...]  # the training steps read
    trajectories: int  # their trajectories
    conversations: int  # the correct ones, written
    unreadable: int  # correct, but refused by the cold start's reader (e.g. an answer holding a tool tag): left out
    exact: int  # of those written, rendered by the cold start to exactly the sampled token sequence

    def describe(self, out: Path) -> str:
        left_out = f"; {self.unreadable} left out that the cold start would refuse" if self.unreadable else ""
        return (
            f"{out}: {self.conversations} correct trajectories of {self.trajectories} from steps "
            f"{', '.join(map(str, self.steps))}{left_out}; {self.exact} of {self.conversations} render to the sampled "
            "tokens exactly (the others differ in how their text tokenizes, not in their text)"
        )


def trained_steps(settings: RunSettings) -> list[int]:
    """The training steps whose trajectories are scored."""
    return RunFolder(settings.run_dir).steps_with(layout.TRAJECTORIES)


def export_stage(settings: RunSettings, steps: Sequence[int], out: Path) -> Exported:
    """Writes the correct trajectories of training steps `steps` to `out` (JSONL, the project's layout)."""
    conversations, sampled, total, unreadable = [], {}, 0, 0
    for step in steps:
        context = context_for(settings, step)
        scores = read_table(context.folder.trajectories, TRAJECTORIES).to_pylist()
        correct = {(row["question_index"], row["group_index"]) for row in scores if row["correct"]}
        total += len(scores)
        for trajectory in context.all_trajectories():
            if (trajectory.question_index, trajectory.group_index) not in correct:
                continue
            conversation = solution_of(trajectory, step, context.protocol.decode)
            try:  # what the cold start will read: a conversation it would refuse is not written
                conversation_from_row(conversation_row(conversation), 0, conversation.id, conversation.id)
            except DataError:
                unreadable += 1
                continue
            conversations.append(conversation)
            sampled[conversation.id] = trajectory.token_ids()
    if not conversations:
        raise DataError(f"{settings.run_dir}: steps {', '.join(map(str, steps))} have no correct trajectory to export")
    protocol = context_for(settings, steps[0]).protocol
    rendered, _ = sft_examples_table(conversations, protocol, settings.rollout)
    exact = sum(
        row["input_tokens"] + row["target_tokens"][-1:] == sampled[row["example_id"]] for row in rendered.to_pylist()
    )
    write_conversations(conversations, out)
    return Exported(tuple(steps), total, len(conversations), unreadable, exact)
