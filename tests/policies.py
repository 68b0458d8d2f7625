"""Scripted policies a pipeline process can load by name ([sampler] engine = scripted:tests.policies:NAME)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from retool.files.layout import RunFolder
from retool.files.tables import PROMPTS, read_table
from retool.rollout.rows import example_of
from retool.run.shared import protocol_for
from retool.sampling.scripted import ScriptedSampler
from tests.helpers import scripted, tool_call_text


def drawn_examples(settings, step):
    """The questions training step `step` rolls out, as its prompts.parquet records them (whatever the draw)."""
    path = RunFolder(settings.run_dir).step(step).prompts
    return _examples_in(path, path.stat().st_mtime_ns) if path.exists() else []


@lru_cache(maxsize=64)
def _examples_in(path: Path, _version: int) -> list:
    return [example_of(row) for row in read_table(path, PROMPTS).sort_by("question_index").to_pylist()]


def branching_tools(settings):
    """Branch (q + g) % 3 runs that many tool calls, then answers; even branches correctly (the step's questions;
    an evaluation's get "?")."""
    protocol = protocol_for(settings.model)

    def choose(question, group, turn, step):
        if turn < (question + group) % 3:
            return tool_call_text(f"print({question} * 10 + {turn})\n{question} ** {turn + 2}", protocol.tool_format)
        examples = drawn_examples(settings, step) if step >= 0 else []
        answer = examples[question].answer if question < len(examples) else "?"  # an evaluation: any answer
        return f"So the result is \\boxed{{{answer if group % 2 == 0 else -1}}}."

    return ScriptedSampler(scripted(protocol, choose))


def some_groups_agree(settings):
    """Question q: all branches right when q % 4 == 0, all wrong when q % 4 == 1, mixed otherwise (even
    branches right); one tool call first."""
    protocol = protocol_for(settings.model)

    def choose(question, group, turn, step):
        if turn == 0:
            return tool_call_text(f"print({question})", protocol.tool_format)
        right = question % 4 == 0 or (question % 4 > 1 and group % 2 == 0)
        answer = drawn_examples(settings, step)[question].answer
        return f"So the result is \\boxed{{{answer if right else -1}}}."

    return ScriptedSampler(scripted(protocol, choose))


def slow_branching_tools(settings):
    """branching_tools, at 5 ms a sampled token: a round takes long enough for several workers to share."""
    sampler = branching_tools(settings)
    sampler.seconds_per_token = 0.005
    return sampler


def paced_branching_tools(settings):
    """branching_tools at 50 ms a sampled token, as a remote model might sample: waiting, not computing."""
    sampler = branching_tools(settings)
    sampler.seconds_per_token = 0.05
    return sampler
