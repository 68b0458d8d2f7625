"""Problem families of digits and bases (roles: retool.data.families)."""

from __future__ import annotations

import math
import random

from retool.data.problems import Problem, dropped_parenthesis, forgot_import


def digit_sum_range(rng: random.Random) -> Problem:
    low = rng.randint(1, 5000)
    high = low + rng.randint(1000, 200_000)
    question = rng.choice(
        [
            f"Find the sum of the digits of all the integers from ${low}$ to ${high}$ inclusive.",
            f"If you write down every integer from ${low}$ to ${high}$, what is the sum of all the digits written?",
        ]
    )
    total = "print(sum(sum(int(d) for d in str(n)) for n in range({}, {})))"
    return Problem(
        question,
        str(sum(sum(map(int, str(n))) for n in range(low, high + 1))),
        "I will add up the digits of every integer in the range.",
        total.format(low, f"{high} + 1"),
        total.format(low, high),
        f"range() stops before {high}, which must be included. Let me fix the range.",
    )


def digit_count_of_power(rng: random.Random) -> Problem:
    base, exponent = rng.randint(2, 99), rng.randint(20, 900)
    question = rng.choice(
        [
            f"How many digits does ${base}^{{{exponent}}}$ have?",
            f"How many decimal digits are in ${base}^{{{exponent}}}$?",
        ]
    )
    code = f"print(len(str({base} ** {exponent})))"
    return dropped_parenthesis(
        question, len(str(base**exponent)), "I will compute the power and count its digits.", code
    )


def base_representation(rng: random.Random) -> Problem:
    number, base = rng.randint(100, 10**6), rng.randint(2, 9)
    question = rng.choice(
        [
            f"Write ${number}$ in base ${base}$.",
            f"What is the base-${base}$ representation of the decimal number ${number}$?",
            f"Convert ${number}$ from base $10$ to base ${base}$.",
        ]
    )
    digits, rest = "", number
    while rest:
        rest, remainder = divmod(rest, base)
        digits = str(remainder) + digits
    loop = f"n, digits = {number}, ''\nwhile n:\n    n, r = divmod(n, {base})\n    digits = {{}}\nprint(digits)"
    return Problem(
        question,
        digits,
        f"I will divide by {base} repeatedly and collect the remainders.",
        loop.format("str(r) + digits"),
        loop.format("digits + str(r)"),
        "The remainders come out from the last digit to the first, so that is reversed. Let me prepend them.",
    )


def digit_sum_of_factorial(rng: random.Random) -> Problem:
    number = rng.randint(20, 900)
    question = rng.choice([f"What is the sum of the digits of ${number}!$?", f"Find the digit sum of ${number}!$."])
    code = f"import math\nprint(sum(int(d) for d in str(math.factorial({number}))))"
    answer = sum(map(int, str(math.factorial(number))))
    return forgot_import(question, answer, "I will compute the factorial and add its digits.", code)


def factorial_digit_count(rng: random.Random) -> Problem:
    number = rng.randint(20, 1000)
    question = rng.choice([f"How many digits does ${number}!$ have?", f"How many decimal digits has ${number}!$?"])
    code = f"import math\nprint(len(str(math.factorial({number}))))"
    answer = len(str(math.factorial(number)))
    return forgot_import(question, answer, "I will compute the factorial and count its digits.", code)
