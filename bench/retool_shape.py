"""A ReTool-shaped step at no cost: a scripted sampler whose trajectories have the lengths, turns, tool calls and
stop reasons of `Shape`, and a sandbox stand-in that returns what the real one prints for the scripted code."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from retool.config.rollout import seed_field
from retool.config.sandbox import SandboxConfig
from retool.config.settings import RunSettings
from retool.protocol.tool_calls import tool_call_text
from retool.run.shared import protocol_for, step_examples
from retool.sampling.contract import SampleRequest
from retool.sampling.scripted import ScriptedSampler
from retool.sandbox.observation import ExecutionResult, observation_text


@dataclass(frozen=True)
class Shape:
    """A trajectory as the script draws it, per branch from (question, branch): ReTool's published runs on a small
    scale (their trajectories run to 8-16k tokens; `turn_tokens` scales every turn)."""

    call_weights: tuple[float, ...] = (0.15, 0.25, 0.25, 0.15, 0.1, 0.1)  # P(k tool calls before the last turn)
    turn_tokens: int = 320  # median tokens of an assistant turn (log-normal)
    turn_sigma: float = 0.5  # log-normal sigma of a turn's length
    output_items: int = 12  # median numbers a tool call prints (a few tokens each)
    invalid: float = 0.05  # the last turn neither calls nor answers
    overlong: float = 0.05  # the last turn runs past max_assistant_tokens without an answer
    keeps_calling: float = 0.10  # calls until max_code_calls ends it


SHAPE = Shape()  # what the script draws from: `bench scale` sets it per step (forked workers inherit it)


@dataclass(frozen=True)
class Branch:
    calls: int  # tool calls before the last turn
    turn_lengths: tuple[int, ...]  # tokens of each turn's reasoning, before its call or answer
    outputs: tuple[int, ...]  # numbers each call prints
    ending: str  # answer | invalid | overlong | keeps_calling
    correct: bool  # an answer turn gives the reference answer


@lru_cache(maxsize=None)
def branch_of(question: int, branch: int, shape: Shape) -> Branch:
    rng = random.Random(question * 1_000_003 + branch)
    skill = random.Random(question).random()  # the question's pass rate: groups of every mix
    calls = rng.choices(range(len(shape.call_weights)), shape.call_weights)[0]
    lengths = tuple(max(8, int(rng.lognormvariate(math.log(shape.turn_tokens), shape.turn_sigma))) for _ in range(8))
    outputs = tuple(max(1, int(rng.lognormvariate(math.log(shape.output_items), 0.8))) for _ in range(8))
    ending = rng.choices(
        ("answer", "invalid", "overlong", "keeps_calling"),
        (1 - shape.invalid - shape.overlong - shape.keeps_calling, shape.invalid, shape.overlong, shape.keeps_calling),
    )[0]
    return Branch(calls, lengths, outputs, ending, rng.random() < skill)


@lru_cache(maxsize=2)
def script_material(settings: RunSettings) -> tuple[list[str], list[int]]:
    """The step's reference answers, and the reasoning tokens: the training questions' text encoded (as varied as
    text; a repeated sentence would compress). Made before Luigi forks its workers, which inherit them."""
    answers = [example.answer for example in step_examples(settings, 0)]
    return answers, protocol_for(settings.model).encode("\n".join(Path(settings.data.train).read_text().splitlines()))


def retool_shaped_policy(settings: RunSettings) -> ScriptedSampler:
    """Turn t of a branch: reasoning of its drawn length, then a call (`print` of its drawn count of numbers) while
    it has calls left, else its ending. Tokens come from slices of encodings made once: the script costs little."""
    protocol = protocol_for(settings.model)
    answers, filler = script_material(settings)
    limit = settings.rollout.max_assistant_tokens + 1
    stop = protocol.stop_token_ids[0]
    logprobs = [-0.5] * (limit + 512)
    encode = lru_cache(maxsize=None)(lambda text: tuple(protocol.encode(text)))

    def script(request: SampleRequest, index: int):
        question, group, turn = request.question_index, request.group_indices[index], seed_field(request.seed, "turn")
        plan = branch_of(question, group, SHAPE)
        start = (question * 7919 + group * 104729 + turn * 1299709) % (len(filler) - limit)
        reasoning = filler[start : start + min(plan.turn_lengths[turn], limit - 64)]  # room for the call or answer
        if turn < plan.calls or plan.ending == "keeps_calling":
            code = f"print(' '.join(str(i) for i in range({plan.outputs[turn]})))"
            ending = encode(tool_call_text(code, protocol.tool_format, "Let me compute."))
        elif plan.ending == "overlong":
            reasoning, ending = filler[start : start + limit], ()
        elif plan.ending == "invalid":
            ending = encode(" I am not sure how to finish.")
        else:
            answer = answers[question] if plan.correct else "-1"
            ending = encode(f" So the answer is \\boxed{{{answer}}}.")
        tokens = [*reasoning, *ending, stop]
        return tokens, logprobs[: len(tokens)]

    return ScriptedSampler(script, keep_requests=False)


class PrintingSandbox:
    """Stands in for the sandbox: returns what the real one prints for the script's code, at no cost."""

    CODE = re.compile(r"range\((\d+)\)")

    def run_many(self, codes):
        return [self.run_code(code) for code in codes]

    def run_code(self, code: str) -> ExecutionResult:
        count = int(self.CODE.search(code).group(1))
        return ExecutionResult("ok", " ".join(str(i) for i in range(count)) + "\n", "", 0.0, 0)

    def observation(self, result: ExecutionResult) -> str:
        return observation_text(result, SandboxConfig())

    def prewarm(self) -> None:
        pass
