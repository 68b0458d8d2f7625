"""The synthetic problem families and their roles. Each family draws its numbers and its wording from a
random generator and returns the question, the exact answer (computed by the family, not by the
solution's code) and a worked solution (see retool.data.problems).

Roles: `sft` families make the cold start's worked solutions. `rl` families appear only among the RL
training questions: each asks one step beyond an sft family (a sum over any range, a count instead of a
sum, the lcm of a whole range, a factorial itself), which the cold-start policy solves only sometimes
(17-25 % of its samples, 2.5 % for the lcm of a range), so that RL has groups of mixed correctness to learn
from. `held-out` families appear in no training file, so the evaluation can tell whether the skill carries
over to kinds of problems never seen: they ask what no training family asks (a gcd, a sum of squares, the
digits of a power, a largest prime factor, the remainder of a product), though their code uses idioms the
training families use too (math.lcm, sums over a range, len(str(...)), sympy.factorint, %).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from retool.data.families import arithmetic as arithmetic
from retool.data.families import counting as counting
from retool.data.families import digits as digits
from retool.data.families import number_theory as number_theory
from retool.data.problems import Problem

ROLES = ("sft", "rl", "held-out")
_ROLES: dict[str, list[Callable[[random.Random], Problem]]] = {
    "sft": [
        arithmetic.arithmetic_expression,
        arithmetic.power_value,
        arithmetic.triangular_number,
        number_theory.modular_power,
        number_theory.lcm_of_numbers,
        number_theory.divisor_count,
        number_theory.next_prime,
        number_theory.distinct_prime_factors,
        digits.digit_sum_range,
        digits.digit_sum_of_factorial,
        digits.factorial_digit_count,
        digits.base_representation,
        counting.sum_of_multiples,
        counting.committee_count,
        counting.days_between,
        counting.linear_recurrence,
    ],
    "rl": [
        arithmetic.factorial_value,
        arithmetic.sum_of_range,
        number_theory.lcm_of_range,
        counting.multiples_count,
    ],
    "held-out": [
        number_theory.gcd_of_pair,
        arithmetic.sum_of_powers,
        digits.digit_count_of_power,
        number_theory.largest_prime_factor,
        arithmetic.product_remainder,
    ],
}
FAMILIES: dict[str, tuple[str, Callable[[random.Random], Problem]]] = {
    family.__name__: (role, family) for role, families in _ROLES.items() for family in families
}


def families_of(*roles: str) -> list[str]:
    """The families with one of these roles, in their declared order."""
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown family roles {sorted(unknown)}; choose from {ROLES}")
    return [name for name, (role, _) in FAMILIES.items() if role in roles]
