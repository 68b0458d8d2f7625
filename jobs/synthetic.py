"""Synthetic problems where running code helps, with exact answers, and worked solutions that use the
code interpreter (the cold-start data).

`python -m jobs.synthetic` writes the shipped train and eval sets under data/; `--traces` also writes
data/synthetic_sft.jsonl, solutions whose tool outputs come from running their code in the sandbox.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jobs.data import MathExample, write_examples


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    plan: str  # the solution's line of reasoning before its code
    code: str  # code that prints the answer
    mistake: str  # a plausible wrong first attempt: an error, or code that prints a wrong result
    correction: str  # what the solver says after seeing the mistake's output


def modular_power(rng: random.Random) -> Problem:
    base, exponent, modulus = rng.randint(2, 999), rng.randint(10**5, 10**9), rng.randint(10**3, 10**6)
    question = f"What is the remainder when ${base}^{{{exponent}}}$ is divided by ${modulus}$?"
    return Problem(
        question,
        pow(base, exponent, modulus),
        "The exponent is huge, so I will use modular exponentiation.",
        f"print(pow({base}, {exponent}, {modulus}))",
        f"print(pow({base}, {exponent} {modulus}))",
        "I left out a comma. Let me fix the call.",
    )


def conditional_count(rng: random.Random) -> Problem:
    limit = rng.randint(10**4, 10**6)
    a, b = rng.sample([3, 4, 5, 6, 7, 9, 11, 13], 2)
    c = rng.choice([2, 10, 17, 19])
    question = (
        f"How many integers $n$ with $1 \\le n \\le {limit}$ are divisible by ${a}$ or by ${b}$, "
        f"but not divisible by ${c}$?"
    )
    answer = sum(1 for n in range(1, limit + 1) if (n % a == 0 or n % b == 0) and n % c != 0)
    count = f"sum(1 for n in range(1, {limit} + 1) if (n % {a} == 0 or n % {b} == 0){{}})"
    return Problem(
        question,
        answer,
        "I will count the integers in the range with a loop.",
        f"print({count.format(f' and n % {c} != 0')})",
        f"print({count.format('')})",
        f"That count still includes the multiples of {c}. Let me exclude them.",
    )


def digit_sum_range(rng: random.Random) -> Problem:
    low = rng.randint(1, 5000)
    high = low + rng.randint(1000, 200_000)
    question = f"Find the sum of the digits of all the integers from ${low}$ to ${high}$ inclusive."
    total = "print(sum(sum(int(d) for d in str(n)) for n in range({}, {})))"
    return Problem(
        question,
        sum(sum(map(int, str(n))) for n in range(low, high + 1)),
        "I will add up the digits of every integer in the range.",
        total.format(low, f"{high} + 1"),
        total.format(low, high),
        f"range() stops before {high}, which must be included. Let me fix the range.",
    )


def linear_recurrence(rng: random.Random) -> Problem:
    p, q = rng.randint(1, 9), rng.randint(1, 9)
    first, second = rng.randint(0, 9), rng.randint(1, 9)
    index, modulus = rng.randint(50, 5000), rng.choice([1000, 9973, 10007, 10**6 + 3])
    question = (
        f"A sequence satisfies $a_1 = {first}$, $a_2 = {second}$ and $a_n = {p}a_{{n-1}} + {q}a_{{n-2}}$ "
        f"for $n \\ge 3$. What is the remainder when $a_{{{index}}}$ is divided by ${modulus}$?"
    )
    previous, current = first, second
    for _ in range(index - 2):
        previous, current = current, p * current + q * previous
    loop = f"a, b = {first}, {second}\nfor _ in range({index} - 2):\n    a, b = b, ({p} * b + {q} * a){{}}\nprint(b)"
    return Problem(
        question,
        (current if index > 1 else first) % modulus,
        "I will iterate the recurrence, reducing modulo the divisor.",
        loop.format(f" % {modulus}"),
        loop.format("").replace("print(b)", "print(b % 10**6, len(str(b)))"),
        f"I forgot to reduce modulo {modulus}; that printed the last digits of a huge number. Let me reduce at every "
        "step.",
    )


def small_arithmetic(rng: random.Random) -> Problem:
    """Easy enough for a 135M model to get right sometimes: gives the CPU default a learning signal."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    if rng.random() < 0.5:
        return Problem(
            f"What is ${a} + {b}$?",
            a + b,
            "I will add the numbers.",
            f"print({a} + {b})",
            f"print({a} + {b}",
            "I missed a parenthesis.",
        )
    return Problem(
        f"What is ${a} \\times {b}$?",
        a * b,
        "I will multiply the numbers.",
        f"print({a} * {b})",
        f"print({a} * {b}",
        "I missed a parenthesis.",
    )


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "small_arithmetic": small_arithmetic,
    "modular_power": modular_power,
    "conditional_count": conditional_count,
    "digit_sum_range": digit_sum_range,
    "linear_recurrence": linear_recurrence,
}
EASY = ["small_arithmetic"]  # kept out of the default mix


def generate_problems(count: int, seed: int, kinds: list[str] | None = None) -> list[tuple[str, Problem]]:
    """`count` (kind, problem) pairs cycling through the kinds; the same seed gives the same problems."""
    rng = random.Random(seed)
    kinds = kinds or [kind for kind in GENERATORS if kind not in EASY]
    return [(kinds[index % len(kinds)], GENERATORS[kinds[index % len(kinds)]](rng)) for index in range(count)]


def generate(count: int, seed: int, prefix: str, kinds: list[str] | None = None) -> list[MathExample]:
    return [
        MathExample(f"{prefix}-{index:05d}", problem.question, str(problem.answer), f"synthetic/{kind}")
        for index, (kind, problem) in enumerate(generate_problems(count, seed, kinds))
    ]


def solution_traces(
    problems: Sequence[tuple[str, Problem]], ids: Sequence[str], sandbox, mistake_share: float, seed: int
):
    """A worked solution per problem, as cold-start conversations: a line of reasoning, a code call,
    the sandbox's real output, and the \\boxed{} answer; a `mistake_share` of them first run a wrong
    attempt, see its error or wrong result, and correct it with a second call."""
    from jobs.cold_start import Conversation, SolutionTurn

    rng = random.Random(seed)
    with_mistake = [rng.random() < mistake_share for _ in problems]
    codes = [
        code for (_, p), wrong in zip(problems, with_mistake) for code in ([p.mistake] if wrong else []) + [p.code]
    ]
    outputs = iter(sandbox.observation(result) for result in sandbox.run_many(codes))
    conversations = []
    for line, ((_, problem), id_, wrong) in enumerate(zip(problems, ids, with_mistake), start=1):
        turns = []
        if wrong:
            turns.append(SolutionTurn(problem.plan, problem.mistake, next(outputs)))
        turns.append(SolutionTurn(problem.correction if wrong else problem.plan, problem.code, next(outputs)))
        if turns[-1].output.strip() != str(problem.answer):
            raise RuntimeError(f"the solution of {id_} printed {turns[-1].output!r}, not {problem.answer}")
        turns.append(
            SolutionTurn(f"The code printed {problem.answer}, so the answer is $\\boxed{{{problem.answer}}}$.")
        )
        conversations.append(Conversation(id_, line, problem.question, str(problem.answer), tuple(turns)))
    return conversations


def write_traces(path: Path, count: int, seed: int, mistake_share: float) -> None:
    """Cold-start conversations for the first `count` problems of the shipped training set."""
    import json

    from jobs.atomic import write_text_atomically
    from jobs.cold_start import conversation_row
    from jobs.sandbox import Sandbox, SandboxConfig

    problems = generate_problems(count, seed=1)  # the training set's problems (see main)
    sandbox = Sandbox(SandboxConfig(timeout_seconds=30.0, cpu_seconds=30))
    try:
        conversations = solution_traces(
            problems, [f"train-{i:05d}" for i in range(count)], sandbox, mistake_share, seed
        )
    finally:
        sandbox.close()
    write_text_atomically(
        path, "".join(json.dumps(conversation_row(c), ensure_ascii=False) + "\n" for c in conversations)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.synthetic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("data"), help="folder for the data files (default: data)")
    parser.add_argument("--train", type=int, default=512, help="problems in synthetic_train.jsonl")
    parser.add_argument(
        "--eval", type=int, default=64, help="problems in synthetic_eval.jsonl (held out from training)"
    )
    parser.add_argument(
        "--traces",
        type=int,
        default=0,
        help="also write worked solutions of the first N training problems "
        "to synthetic_sft.jsonl, running their code in the sandbox",
    )
    parser.add_argument(
        "--mistake-share", type=float, default=0.25, help="share of solutions that correct a wrong first call"
    )
    args = parser.parse_args()
    write_examples(generate(args.train, seed=1, prefix="train"), args.out / "synthetic_train.jsonl")
    write_examples(generate(args.eval, seed=2, prefix="eval"), args.out / "synthetic_eval.jsonl")
    write_examples(generate(128, seed=3, prefix="easy", kinds=EASY), args.out / "synthetic_easy.jsonl")
    print(f"wrote {args.train} train, {args.eval} eval and 128 easy problems under {args.out}/")
    if args.traces:
        write_traces(args.out / "synthetic_sft.jsonl", args.traces, seed=4, mistake_share=args.mistake_share)
        print(f"wrote {args.traces} worked solutions to {args.out / 'synthetic_sft.jsonl'}")


if __name__ == "__main__":
    main()
