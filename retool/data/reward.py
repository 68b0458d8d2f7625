"""Outcome reward: +1 when the last \\boxed{} in the final text equals the reference answer, else -1. The seed's rule
(docs/layout.md, "Departures from the seed"): the last `\\boxed{` decides, and equivalence is math_verify's."""

from __future__ import annotations

import atexit
import concurrent.futures
import re
import threading
from dataclasses import dataclass

from math_verify import parse, verify

TAIL_CHARACTERS = 300  # only the end of the text can hold the final answer
VERIFY_TIMEOUT_SECONDS = 5


@dataclass(frozen=True)
class Score:
    reward: float  # +1 correct, -1 otherwise
    valid_format: bool  # a complete \boxed{...} was found
    correct: bool  # the boxed answer is equivalent to the reference
    extracted_answer: str | None  # the content of the last \boxed{}, if any


BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{` in `text`, up to its balancing brace; None without one, or when that last one is
    never closed (an earlier box does not stand in for it)."""
    start = text.rfind(BOXED)
    if start == -1:
        return None
    depth, position = 1, start + len(BOXED)
    while position < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        position += 1
    return text[start + len(BOXED) : position - 1].strip() if depth == 0 else None


_INTEGER = re.compile(r"-?[0-9]+")  # an integer math_verify reads as itself


def _equivalent(extracted: str, reference: str, timeout: int | None) -> bool:
    """math_verify's verdict, parsed with its default extraction (LaTeX and plain expressions), the gold first."""
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    guess = parse(f"${extracted}$", parsing_timeout=timeout)
    return bool(verify(gold, guess, timeout_seconds=timeout))


# math_verify's own timeouts use SIGALRM, which only the main thread may set; elsewhere the
# comparison runs in a helper process that can be abandoned when it hangs.
_helper: concurrent.futures.ProcessPoolExecutor | None = None
_helper_lock = threading.Lock()


def _equivalent_off_main_thread(extracted: str, reference: str) -> bool:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = concurrent.futures.ProcessPoolExecutor(max_workers=1)
        future = _helper.submit(_equivalent, extracted, reference, None)
    try:
        return future.result(timeout=VERIFY_TIMEOUT_SECONDS)
    except concurrent.futures.TimeoutError:
        with _helper_lock:
            for process in list(getattr(_helper, "_processes", {}).values()):
                process.kill()
            _helper.shutdown(wait=False, cancel_futures=True)
            _helper = None
        return False


@atexit.register
def _stop_helper() -> None:
    if _helper is not None:
        _helper.shutdown(wait=False, cancel_futures=True)


def answers_match(extracted: str, reference: str) -> bool:
    """Whether math_verify finds the two equivalent. The one shortcut accepts only what it accepts: the same integer
    written alike (the common case, with no symbolic comparison)."""
    extracted, reference = extracted.strip(), reference.strip()
    if extracted == reference and _INTEGER.fullmatch(extracted):
        return True
    try:
        if threading.current_thread() is threading.main_thread():
            return _equivalent(extracted, reference, VERIFY_TIMEOUT_SECONDS)
        return _equivalent_off_main_thread(extracted, reference)
    except Exception:  # math_verify raises on pathological inputs; they are simply wrong
        return False


def score_answer(final_text: str, reference: str) -> Score:
    extracted = last_boxed(final_text[-TAIL_CHARACTERS:])
    if extracted is None:
        return Score(reward=-1.0, valid_format=False, correct=False, extracted_answer=None)
    correct = bool(extracted) and answers_match(extracted, reference)
    return Score(reward=1.0 if correct else -1.0, valid_format=True, correct=correct, extracted_answer=extracted)
