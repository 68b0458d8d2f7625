"""Scripted policies a pipeline process can load by name ([sampler] engine = scripted:tests.policies:NAME)."""

from __future__ import annotations

from functools import lru_cache

from retool.data.examples import read_examples
from retool.files.layout import RunFolder
from retool.files.tables import PROMPTS, read_table
from retool.rollout.rows import example_of
from retool.run.shared import protocol_for
from retool.sampling.scripted import ScriptedSampler
from tests.helpers import scripted, tool_call_text


def drawn_examples(settings, step):
    """The questions training step `step` rolled out, as its prompts.parquet records them (whatever the draw)."""
    path = RunFolder(settings.run_dir).step(step).prompts
    return [example_of(row) for row in read_table(path, PROMPTS).sort_by("question_index").to_pylist()]


def answer_asked(settings, prompt: str) -> str:
    """The reference answer of the training question `prompt` asks, found by its text (the longest that it holds);
    "?" for any other (an evaluation's). It reads only the data file, so a stage run alone answers alike."""
    asked = [question for question in _answers(settings.data.train) if question in prompt]
    return _answers(settings.data.train)[max(asked, key=len)] if asked else "?"


@lru_cache(maxsize=8)
def _answers(train: str) -> dict[str, str]:
    return {example.question: example.answer for example in read_examples(train)}


def branching_tools(settings):
    """Branch (q + g) % 3 runs that many tool calls, then answers; even branches correctly (a question of the
    training data; any other gets "?")."""
    protocol = protocol_for(settings.model)

    def choose(question, group, turn, step, prompt):
        if turn < (question + group) % 3:
            return tool_call_text(f"print({question} * 10 + {turn})\n{question} ** {turn + 2}", protocol.tool_format)
        return f"So the result is \\boxed{{{answer_asked(settings, prompt) if group % 2 == 0 else -1}}}."

    return ScriptedSampler(scripted(protocol, choose))


def some_groups_agree(settings):
    """Question q: all branches right when q % 4 == 0, all wrong when q % 4 == 1, mixed otherwise (even
    branches right); one tool call first."""
    protocol = protocol_for(settings.model)

    def choose(question, group, turn, step, prompt):
        if turn == 0:
            return tool_call_text(f"print({question})", protocol.tool_format)
        right = question % 4 == 0 or (question % 4 > 1 and group % 2 == 0)
        return f"So the result is \\boxed{{{answer_asked(settings, prompt) if right else -1}}}."

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
