"""Synthetic problems where running code helps, with exact answers.

`python -m jobs.synthetic` writes the shipped train and eval sets under data/.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

from jobs.data import MathExample, write_examples


def modular_power(rng: random.Random) -> tuple[str, int]:
    base, exponent, modulus = rng.randint(2, 999), rng.randint(10**5, 10**9), rng.randint(10**3, 10**6)
    question = f"What is the remainder when ${base}^{{{exponent}}}$ is divided by ${modulus}$?"
    return question, pow(base, exponent, modulus)


def conditional_count(rng: random.Random) -> tuple[str, int]:
    limit = rng.randint(10**4, 10**6)
    a, b = rng.sample([3, 4, 5, 6, 7, 9, 11, 13], 2)
    c = rng.choice([2, 10, 17, 19])
    question = (
        f"How many integers $n$ with $1 \\le n \\le {limit}$ are divisible by ${a}$ or by ${b}$, "
        f"but not divisible by ${c}$?"
    )
    answer = sum(1 for n in range(1, limit + 1) if (n % a == 0 or n % b == 0) and n % c != 0)
    return question, answer


def digit_sum_range(rng: random.Random) -> tuple[str, int]:
    low = rng.randint(1, 5000)
    high = low + rng.randint(1000, 200_000)
    question = f"Find the sum of the digits of all the integers from ${low}$ to ${high}$ inclusive."
    return question, sum(sum(map(int, str(n))) for n in range(low, high + 1))


def linear_recurrence(rng: random.Random) -> tuple[str, int]:
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
    return question, (current if index > 1 else first) % modulus


def small_arithmetic(rng: random.Random) -> tuple[str, int]:
    """Easy enough for a 135M model to get right sometimes: gives the CPU default a learning signal."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    if rng.random() < 0.5:
        return f"What is ${a} + {b}$?", a + b
    return f"What is ${a} \\times {b}$?", a * b


GENERATORS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "small_arithmetic": small_arithmetic,
    "modular_power": modular_power,
    "conditional_count": conditional_count,
    "digit_sum_range": digit_sum_range,
    "linear_recurrence": linear_recurrence,
}
EASY = ["small_arithmetic"]  # kept out of the default mix


def generate(count: int, seed: int, prefix: str, kinds: list[str] | None = None) -> list[MathExample]:
    """`count` problems cycling through the kinds; the same seed always gives the same problems."""
    rng = random.Random(seed)
    kinds = kinds or [kind for kind in GENERATORS if kind not in EASY]
    examples = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        question, answer = GENERATORS[kind](rng)
        examples.append(MathExample(f"{prefix}-{index:05d}", question, str(answer), f"synthetic/{kind}"))
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("data"))
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--eval", type=int, default=64)
    args = parser.parse_args()
    write_examples(generate(args.train, seed=1, prefix="train"), args.out / "synthetic_train.jsonl")
    write_examples(generate(args.eval, seed=2, prefix="eval"), args.out / "synthetic_eval.jsonl")
    write_examples(generate(128, seed=3, prefix="easy", kinds=EASY), args.out / "synthetic_easy.jsonl")
    print(f"wrote {args.train} train, {args.eval} eval and 128 easy problems under {args.out}/")


if __name__ == "__main__":
    main()
