"""Scripted policies a pipeline process can load by name (sampler = scripted:tests.policies:NAME)."""

from __future__ import annotations

from jobs.runs import step_examples
from jobs.runtime import protocol_for
from jobs.sampling import ScriptedSampler
from tests.helpers import scripted, tool_call_text


def slow_tools(settings):
    """Branch (q + g) % 3 runs that many slow tool calls, then answers; even branches correctly.
    Sampling costs 4 ms a token and each call sleeps 0.3 s, so every stage takes a while."""
    protocol = protocol_for(settings)

    def choose(question, group, turn, step):
        if turn < (question + group) % 3:
            return tool_call_text(f"import time\ntime.sleep(0.3)\nprint({question} * 10 + {turn})", protocol.tool_format)
        answer = step_examples(settings, step, None)[question].answer if step >= 0 else "?"
        return f"So the result is \\boxed{{{answer if group % 2 == 0 else -1}}}."

    return ScriptedSampler(scripted(protocol, choose), seconds_per_token=0.004)
