"""A synthetic problem and its worked solution, and the mistakes many families share."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

MONTHS = "January February March April May June July August September October November December".split()


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # exact, as the code prints it
    plan: str  # the solution's line of reasoning before its code
    code: str  # code that prints the answer
    mistake: str  # a plausible wrong first attempt: an error, or code that prints a wrong result
    correction: str  # what the solver says after seeing the mistake's output


def forgot_import(question: str, answer: object, plan: str, code: str) -> Problem:
    """The mistake of code whose first line imports: the import left out (a NameError)."""
    module = code.split("\n", 1)[0].split()[1]
    return Problem(
        question,
        str(answer),
        plan,
        code,
        code.split("\n", 1)[1],
        f"I forgot to import {module}. Let me add the import.",
    )


def dropped_parenthesis(question: str, answer: object, plan: str, code: str) -> Problem:
    """The mistake of a one-line print: its closing parenthesis left out (a SyntaxError)."""
    return Problem(question, str(answer), plan, code, code[:-1], "I missed a closing parenthesis. Let me fix it.")


def date_text(day: date) -> str:
    return f"{MONTHS[day.month - 1]} {day.day}, {day.year}"
