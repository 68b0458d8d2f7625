"""Problem families of arithmetic: expressions, powers, polynomials, sums of terms (roles: retool.data.families)."""

from __future__ import annotations

import math
import random

from retool.data.problems import Problem, dropped_parenthesis, forgot_import


def arithmetic_expression(rng: random.Random) -> Problem:
    a, b, c, d = rng.randint(12, 999), rng.randint(12, 999), rng.randint(2, 99), rng.randint(100, 9999)
    latex, code, value = rng.choice(
        [
            (f"{a} \\times {b} - {d}", f"{a} * {b} - {d}", a * b - d),
            (f"({a} + {b}) \\times {c}", f"({a} + {b}) * {c}", (a + b) * c),
            (f"{a} \\times {b} + {c} \\times {d}", f"{a} * {b} + {c} * {d}", a * b + c * d),
        ]
    )
    question = rng.choice([f"Compute ${latex}$.", f"What is the value of ${latex}$?", f"Evaluate ${latex}$."])
    plan = rng.choice(["I will let Python do the arithmetic.", "I will evaluate the expression with code."])
    return dropped_parenthesis(question, value, plan, f"print({code})")


def power_value(rng: random.Random) -> Problem:
    base = rng.randint(3, 19)
    exponent = rng.randint(int(12 / math.log10(base)), int(30 / math.log10(base)))
    question = rng.choice(
        [
            f"What is ${base}^{{{exponent}}}$?",
            f"Compute ${base}^{{{exponent}}}$ exactly.",
            f"Evaluate ${base}^{{{exponent}}}$.",
        ]
    )
    plan = "The number is too large to multiply out by hand, so I will compute it exactly with Python."
    return dropped_parenthesis(question, base**exponent, plan, f"print({base} ** {exponent})")


def sum_of_powers(rng: random.Random) -> Problem:
    limit, power = rng.randint(20, 2000), rng.choice([2, 3])
    question = rng.choice(
        [
            f"What is $1^{power} + 2^{power} + \\cdots + {limit}^{power}$?",
            f"Find the sum of the {'squares' if power == 2 else 'cubes'} of the integers from $1$ to ${limit}$.",
        ]
    )
    code = f"print(sum(k**{power} for k in range(1, {limit} + 1)))"
    answer = sum(k**power for k in range(1, limit + 1))
    return dropped_parenthesis(question, answer, "I will add up the powers with a loop.", code)


def product_remainder(rng: random.Random) -> Problem:
    a, b, c = (rng.randint(1000, 99_999) for _ in range(3))
    modulus = rng.randint(7, 9999)
    question = rng.choice(
        [
            f"What is the remainder when ${a} \\times {b} \\times {c}$ is divided by ${modulus}$?",
            f"Compute ${a} \\cdot {b} \\cdot {c} \\bmod {modulus}$.",
        ]
    )
    code = f"print({a} * {b} * {c} % {modulus})"
    return dropped_parenthesis(question, a * b * c % modulus, "I will multiply and reduce with code.", code)


def triangular_number(rng: random.Random) -> Problem:
    index = rng.randint(100, 100_000)
    question = rng.choice(
        [
            f"What is the ${index}$-th triangular number $1 + 2 + \\cdots + {index}$?",
            f"Compute the sum of all integers from $1$ to ${index}$.",
        ]
    )
    code = f"print(sum(range(1, {index} + 1)))"
    return dropped_parenthesis(question, index * (index + 1) // 2, "I will add the integers with sum and range.", code)


def factorial_value(rng: random.Random) -> Problem:
    number = rng.randint(12, 40)
    question = rng.choice(
        [
            f"What is ${number}!$?",
            f"Compute ${number}!$ exactly.",
            f"What is the product $1 \\times 2 \\times \\cdots \\times {number}$?",
        ]
    )
    code = f"import math\nprint(math.factorial({number}))"
    return forgot_import(question, math.factorial(number), "I will compute the factorial with math.factorial.", code)


def sum_of_range(rng: random.Random) -> Problem:
    low = rng.randint(10, 5000)
    high = low + rng.randint(100, 100_000)
    question = rng.choice(
        [
            f"What is the sum of all integers from ${low}$ to ${high}$?",
            f"Compute ${low} + {low + 1} + \\cdots + {high}$.",
        ]
    )
    code = f"print(sum(range({low}, {high} + 1)))"
    return dropped_parenthesis(question, sum(range(low, high + 1)), "I will add the integers with sum and range.", code)
