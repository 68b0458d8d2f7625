"""The shipped synthetic data sets, made from the problem families of retool.data.families:

  synthetic_sft.jsonl    worked solutions of the `sft` families (the cold start), whose code and output
                         come from the project's sandbox; a share first make a mistake and correct it
  synthetic_train.jsonl  RL questions: the `rl` families and new problems of the `sft` families
  synthetic_eval.jsonl   held-out questions, never trained on: new problems of the training families
                         ("in-family") and problems of the `held-out` families, which no training file has

`python -m retool synthetic` writes all three; every problem is a pure function of its seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from retool.data.examples import MathExample
from retool.data.families import FAMILIES, families_of
from retool.data.problems import Problem

SOURCE_PREFIX = "synthetic/"  # data_source of a synthetic problem: synthetic/<family>
SFT_SEED, TRAIN_SEED, EVAL_SEED, MISTAKE_SEED = 1, 2, 3, 4  # one random stream per file, so files never share a draw


def data_source(family: str) -> str:
    return SOURCE_PREFIX + family


def family_of(source: str) -> str | None:
    """The family a data_source names, or None for data that is not synthetic."""
    return source[len(SOURCE_PREFIX) :] if source.startswith(SOURCE_PREFIX) else None


def generate_problems(
    count: int, seed: int, families: Sequence[str], exclude: frozenset[str] = frozenset()
) -> list[tuple[str, Problem]]:
    """`count` (family, problem) pairs cycling through `families`, none with a question in `exclude` or
    asked twice; the same seed gives the same problems."""
    if not families:
        raise ValueError("generate_problems needs at least one family")
    rng = random.Random(seed)
    seen, problems = set(exclude), []
    for index in range(count):
        family = families[index % len(families)]
        for _ in range(1000):
            problem = FAMILIES[family][1](rng)
            if problem.question not in seen:
                break
        else:
            raise ValueError(f"family {family} has run out of new questions")
        seen.add(problem.question)
        problems.append((family, problem))
    return problems


def examples_of(problems: Sequence[tuple[str, Problem]], prefix: str) -> list[MathExample]:
    return [
        MathExample(f"{prefix}-{index:05d}", problem.question, problem.answer, data_source(family))
        for index, (family, problem) in enumerate(problems)
    ]


def generate(count: int, seed: int, prefix: str, families: Sequence[str] | None = None) -> list[MathExample]:
    """Questions only, `count` of them over `families` (default: every training family)."""
    return examples_of(generate_problems(count, seed, families or families_of("sft", "rl")), prefix)


def training_questions(count: int) -> list[MathExample]:
    """The RL training set: the rl families and the sft families, in turn."""
    return examples_of(generate_problems(count, TRAIN_SEED, families_of("rl") + families_of("sft")), "train")


def evaluation_questions(
    per_training_family: int, per_held_out_family: int, trained: frozenset[str] = frozenset()
) -> list[MathExample]:
    """Questions of every training family and of every held-out family, none of them in `trained` (the
    training files' questions), alternating between the two kinds so that the file's first N questions
    (`--limit N`) hold both."""
    training_families, held_out_families = families_of("sft", "rl"), families_of("held-out")
    in_family = generate_problems(per_training_family * len(training_families), EVAL_SEED, training_families, trained)
    held_out = generate_problems(per_held_out_family * len(held_out_families), EVAL_SEED + 1, held_out_families)
    order = [pair for both in zip(in_family, held_out) for pair in both]
    shorter = min(len(in_family), len(held_out))
    return examples_of(order + in_family[shorter:] + held_out[shorter:], "eval")


def solution_traces(
    problems: Sequence[tuple[str, Problem]], ids: Sequence[str], sandbox, mistake_share: float, seed: int
):
    """A worked solution per problem, as cold-start conversations: a line of reasoning, a code call,
    the sandbox's real output, and the \\boxed{} answer; a `mistake_share` of them first run a wrong
    attempt, see its error or wrong result, and correct it with a second call (a mistake that happens
    to print the right answer is left out). The wrong attempt is context only ("weight": 0): the cold
    start teaches the correction, not the mistake."""
    from retool.data.conversations import Conversation, SolutionTurn

    rng = random.Random(seed)
    with_mistake = [rng.random() < mistake_share for _ in problems]
    endings = [rng.choice(ENDINGS) for _ in problems]
    codes = [code for _, problem in problems for code in (problem.mistake, problem.code)]
    outputs = [sandbox.observation(result) for result in sandbox.run_many(codes)]
    conversations = []
    for number, ((family, problem), id_, wrong, ending) in enumerate(zip(problems, ids, with_mistake, endings)):
        mistake_output, output = outputs[2 * number], outputs[2 * number + 1]
        if output.strip() != problem.answer:
            raise RuntimeError(f"the solution of {id_} printed {output!r}, not {problem.answer}")
        turns = []
        if wrong and mistake_output.strip() != problem.answer:
            turns.append(SolutionTurn(problem.plan, problem.mistake, mistake_output, trained=False))
            turns.append(SolutionTurn(problem.correction, problem.code, output))
        else:
            turns.append(SolutionTurn(problem.plan, problem.code, output))
        turns.append(SolutionTurn(ending.format(answer=problem.answer)))
        conversation = Conversation(
            id_, number + 1, problem.question, problem.answer, tuple(turns), data_source(family)
        )
        conversations.append(conversation)
    return conversations


ENDINGS = (
    "The code printed {answer}, so the answer is $\\boxed{{{answer}}}$.",
    "The output is {answer}. The answer is $\\boxed{{{answer}}}$.",
    "So the answer is $\\boxed{{{answer}}}$.",
)


def write_traces(path: Path, count: int, mistake_share: float) -> list:
    """Cold-start conversations: `count` worked solutions of the sft families."""
    from retool.config.sandbox import SandboxConfig
    from retool.data.conversations import conversation_row
    from retool.files.atomic import write_text_atomically
    from retool.sandbox.call import Sandbox

    problems = generate_problems(count, SFT_SEED, families_of("sft"))
    sandbox = Sandbox(SandboxConfig(timeout_seconds=30.0, cpu_seconds=30))
    try:
        ids = [f"sft-{index:05d}" for index in range(count)]
        conversations = solution_traces(problems, ids, sandbox, mistake_share, MISTAKE_SEED)
    finally:
        sandbox.close()
    rows = (json.dumps(conversation_row(c), ensure_ascii=False) + "\n" for c in conversations)
    write_text_atomically(path, "".join(rows))
    return conversations
