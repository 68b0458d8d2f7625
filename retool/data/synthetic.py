"""The shipped synthetic data sets, made from the problem families of retool.data.families:

  synthetic_sft.jsonl    worked solutions of the `sft` families (the cold start), whose code and output
                         come from the project's sandbox; a share first make a mistake and correct it
  synthetic_train.jsonl  RL questions: the `rl` families and new problems of the `sft` families in turn (and with
                         `--more-rl N`, N more of the `rl` families, none of them an evaluation question)
  synthetic_eval.jsonl   held-out questions, never trained on: new problems of the `sft` and `rl` families
                         and problems of the `held-out` families, which no training file has

`python -m retool synthetic` writes all three; every problem is a pure function of its seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path

from retool.data.examples import MathExample
from retool.data.families import FAMILIES, families_of
from retool.data.problems import Problem

SOURCE_PREFIX = "synthetic/"  # data_source of a synthetic problem: synthetic/<family>
SFT_SEED, TRAIN_SEED, EVAL_SEED, MISTAKE_SEED, MORE_RL_SEED = 1, 2, 3, 4, 5  # one random stream per draw


def data_source(family: str) -> str:
    return SOURCE_PREFIX + family


def family_of(source: str) -> str | None:
    """The family a data_source names, or None for data that is not synthetic."""
    return source[len(SOURCE_PREFIX) :] if source.startswith(SOURCE_PREFIX) else None


def generate_problems(
    count: int, seed: int, families: Sequence[str], exclude: frozenset[str] = frozenset(), fill: bool = False
) -> list[tuple[str, Problem]]:
    """`count` (family, problem) pairs cycling through `families`, none with a question in `exclude` or
    asked twice; the same seed gives the same problems. `fill`: a family out of new questions leaves the cycle and
    the others make up the count (else it is an error)."""
    if not families:
        raise ValueError("generate_problems needs at least one family")
    rng = random.Random(seed)
    seen, problems, cycle = set(exclude), [], list(families)
    while len(problems) < count:
        family = cycle[len(problems) % len(cycle)]
        for _ in range(1000):
            problem = FAMILIES[family][1](rng)
            if problem.question not in seen:
                break
        else:
            if not fill or len(cycle) == 1:
                raise ValueError(f"family {family} has run out of new questions")
            cycle.remove(family)
            continue
        seen.add(problem.question)
        problems.append((family, problem))
    return problems


def examples_of(problems: Sequence[tuple[str, Problem]], prefix: str, first: int = 0) -> list[MathExample]:
    return [
        MathExample(f"{prefix}-{index:05d}", problem.question, problem.answer, data_source(family))
        for index, (family, problem) in enumerate(problems, first)
    ]


def generate(count: int, seed: int, prefix: str, families: Sequence[str] | None = None) -> list[MathExample]:
    """Questions only, `count` of them over `families` (default: every training family)."""
    return examples_of(generate_problems(count, seed, families or families_of("sft", "rl")), prefix)


def training_questions(count: int) -> list[MathExample]:
    """The RL training set's first part: the rl families and the sft families, in turn."""
    return examples_of(generate_problems(count, TRAIN_SEED, families_of("rl") + families_of("sft")), "train")


def more_rl_questions(count: int, first: int, drawn: frozenset[str]) -> list[MathExample]:
    """`count` more questions of the rl families, none in `drawn` (every other file's questions, the evaluation
    set's too), numbered from `first`; a family out of new questions leaves the others to make up the count.
    Drawn after the evaluation set, so that set is the same with them or without."""
    return examples_of(generate_problems(count, MORE_RL_SEED, families_of("rl"), drawn, True), "train", first)


def evaluation_questions(
    per_sft_family: int, per_rl_family: int, per_held_out_family: int, trained: frozenset[str] = frozenset()
) -> list[MathExample]:
    """New questions of every family, `per_..._family` of each of a role (a family with fewer new ones left, the
    others of its role more), none of them in `trained` (the training files' questions), the three roles in turn
    so that the file's first N questions (`--limit N`) hold each."""
    roles = [
        generate_problems(per_family * len(families_of(role)), EVAL_SEED + offset, families_of(role), trained, True)
        for role, per_family, offset in (
            ("sft", per_sft_family, 0),
            ("rl", per_rl_family, 2),
            ("held-out", per_held_out_family, 1),
        )
    ]
    return examples_of([pair for turn in zip_longest(*roles) for pair in turn if pair is not None], "eval")


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
