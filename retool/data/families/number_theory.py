"""Problem families of number theory: remainders, divisors, primes, gcd and lcm (roles: retool.data.families)."""

from __future__ import annotations

import math
import random

import sympy

from retool.data.problems import Problem, forgot_import


def modular_power(rng: random.Random) -> Problem:
    base, exponent, modulus = rng.randint(2, 999), rng.randint(10**5, 10**9), rng.randint(10**3, 10**6)
    question = rng.choice(
        [
            f"What is the remainder when ${base}^{{{exponent}}}$ is divided by ${modulus}$?",
            f"Compute ${base}^{{{exponent}}} \\bmod {modulus}$.",
            f"Find the remainder of ${base}^{{{exponent}}}$ modulo ${modulus}$.",
        ]
    )
    return Problem(
        question,
        str(pow(base, exponent, modulus)),
        rng.choice(["The exponent is huge, so I will use modular exponentiation.", "I will use pow with a modulus."]),
        f"print(pow({base}, {exponent}, {modulus}))",
        f"print(pow({base}, {exponent} {modulus}))",
        "I left out a comma. Let me fix the call.",
    )


def lcm_of_numbers(rng: random.Random) -> Problem:
    a, b, c = rng.sample(range(6, 400), 3)
    question = rng.choice(
        [
            f"What is the least common multiple of ${a}$, ${b}$ and ${c}$?",
            f"Find $\\operatorname{{lcm}}({a}, {b}, {c})$.",
            f"What is the smallest positive integer divisible by each of ${a}$, ${b}$ and ${c}$?",
        ]
    )
    code = f"import math\nprint(math.lcm({a}, {b}, {c}))"
    return forgot_import(question, math.lcm(a, b, c), "I will use math.lcm.", code)


def gcd_of_pair(rng: random.Random) -> Problem:
    factor = rng.randint(2, 500)
    a, b = factor * rng.randint(2, 900), factor * rng.randint(2, 900)
    question = rng.choice(
        [
            f"What is the greatest common divisor of ${a}$ and ${b}$?",
            f"Find $\\gcd({a}, {b})$.",
            f"What is the largest positive integer that divides both ${a}$ and ${b}$?",
        ]
    )
    return forgot_import(question, math.gcd(a, b), "I will use math.gcd.", f"import math\nprint(math.gcd({a}, {b}))")


def divisor_count(rng: random.Random) -> Problem:
    number = rng.randint(1000, 500_000)
    question = rng.choice(
        [
            f"How many positive divisors does ${number}$ have?",
            f"Find the number of positive integers that divide ${number}$.",
            f"How many positive integers $d$ divide ${number}$?",
        ]
    )
    count = "print(sum(1 for d in range(1, {}) if {} % d == 0))"
    return Problem(
        question,
        str(sympy.divisor_count(number)),
        "I will test every candidate divisor with a loop.",
        count.format(f"{number} + 1", number),
        count.format(number, number),
        f"range() stops before {number}, so {number} itself was not counted. Let me fix the range.",
    )


def largest_prime_factor(rng: random.Random) -> Problem:
    number = rng.randint(10_000, 10**9)
    question = rng.choice(
        [f"What is the largest prime factor of ${number}$?", f"Find the greatest prime that divides ${number}$."]
    )
    code = f"import sympy\nprint(max(sympy.factorint({number})))"
    return forgot_import(question, max(sympy.factorint(number)), "I will factor the number with sympy.", code)


def next_prime(rng: random.Random) -> Problem:
    number = rng.randint(1000, 10**7)
    question = rng.choice(
        [f"What is the smallest prime greater than ${number}$?", f"Find the first prime number after ${number}$."]
    )
    code = f"import sympy\nprint(sympy.nextprime({number}))"
    return forgot_import(question, sympy.nextprime(number), "sympy.nextprime finds it.", code)


def distinct_prime_factors(rng: random.Random) -> Problem:
    number = rng.randint(10_000, 10**9)
    question = rng.choice(
        [
            f"How many distinct prime factors does ${number}$ have?",
            f"How many different primes divide ${number}$?",
        ]
    )
    code = f"import sympy\nprint(len(sympy.factorint({number})))"
    return forgot_import(question, len(sympy.factorint(number)), "sympy.factorint lists the prime factors.", code)


def lcm_of_range(rng: random.Random) -> Problem:
    last = rng.randint(10, 40)
    question = rng.choice(
        [
            f"What is the least common multiple of $1, 2, \\ldots, {last}$?",
            f"What is the smallest positive integer divisible by every integer from $1$ to ${last}$?",
        ]
    )
    code = f"import math\nprint(math.lcm(*range(1, {last} + 1)))"
    return forgot_import(question, math.lcm(*range(1, last + 1)), "I will use math.lcm over the range.", code)
