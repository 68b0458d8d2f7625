"""Problem families of counting, combinatorics, sequences and dates (roles: retool.data.families)."""

from __future__ import annotations

import math
import random
from datetime import date, timedelta

from retool.data.problems import Problem, date_text, dropped_parenthesis, forgot_import


def sum_of_multiples(rng: random.Random) -> Problem:
    limit = rng.randint(100, 100_000)
    a, b = rng.sample([2, 3, 4, 5, 6, 7, 9, 11], 2)
    question = rng.choice(
        [
            f"What is the sum of all positive integers less than ${limit}$ that are multiples of ${a}$ or ${b}$?",
            f"Find the sum of the positive integers below ${limit}$ divisible by ${a}$ or by ${b}$.",
        ]
    )
    code = f"print(sum(n for n in range(1, {limit}) if n % {a} == 0 or n % {b} == 0))"
    answer = sum(n for n in range(1, limit) if n % a == 0 or n % b == 0)
    return dropped_parenthesis(question, answer, "I will add up the qualifying integers with a loop.", code)


def committee_count(rng: random.Random) -> Problem:
    people, chosen = rng.randint(12, 60), rng.randint(3, 9)
    question = rng.choice(
        [
            f"In how many ways can a committee of ${chosen}$ be chosen from ${people}$ people?",
            f"Compute $\\binom{{{people}}}{{{chosen}}}$.",
            f"How many subsets with exactly ${chosen}$ elements does a set of ${people}$ elements have?",
        ]
    )
    code = f"import math\nprint(math.comb({people}, {chosen}))"
    return forgot_import(question, math.comb(people, chosen), "I will use math.comb.", code)


def days_between(rng: random.Random) -> Problem:
    start = date(1900, 1, 1) + timedelta(days=rng.randint(0, 60_000))
    end = start + timedelta(days=rng.randint(200, 20_000))
    question = rng.choice(
        [
            f"How many days are there from {date_text(start)} to {date_text(end)}?",
            f"How many days after {date_text(start)} is {date_text(end)}?",
        ]
    )
    code = (
        f"from datetime import date\nprint((date({end.year}, {end.month}, {end.day}) - "
        f"date({start.year}, {start.month}, {start.day})).days)"
    )
    return Problem(
        question,
        str((end - start).days),
        "I will subtract the two dates with the datetime module.",
        code,
        code.split("\n", 1)[1],
        "I forgot to import date from datetime. Let me add the import.",
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
        previous, current = current, (p * current + q * previous) % modulus
    loop = f"a, b = {first}, {second}\nfor _ in range({index} - 2):\n    a, b = b, ({p} * b + {q} * a){{}}\nprint(b)"
    return Problem(
        question,
        str(current % modulus),
        "I will iterate the recurrence, reducing modulo the divisor.",
        loop.format(f" % {modulus}"),
        loop.format("").replace("print(b)", "print(b % 10**6, len(str(b)))"),
        f"I forgot to reduce modulo {modulus}; that printed the last digits of a huge number. Let me reduce at every "
        "step.",
    )


def multiples_count(rng: random.Random) -> Problem:
    limit = rng.randint(1000, 10**6)
    a, b = rng.sample([2, 3, 4, 5, 6, 7, 9, 11], 2)
    question = rng.choice(
        [
            f"How many positive integers less than ${limit}$ are multiples of ${a}$ or ${b}$?",
            f"Count the positive integers below ${limit}$ divisible by ${a}$ or by ${b}$.",
        ]
    )
    code = f"print(sum(1 for n in range(1, {limit}) if n % {a} == 0 or n % {b} == 0))"
    answer = sum(1 for n in range(1, limit) if n % a == 0 or n % b == 0)
    return dropped_parenthesis(question, answer, "I will count them with a loop.", code)
