"""Outcome reward: +1 when the last \\boxed{} in the final text equals the reference answer, else -1."""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from dataclasses import dataclass

from math_verify import parse, verify
from math_verify.parser import LatexExtractionConfig

TAIL_CHARACTERS = 300  # only the end of the text can hold the final answer
VERIFY_TIMEOUT_SECONDS = 5


@dataclass(frozen=True)
class Score:
    reward: float  # +1 correct, -1 otherwise
    valid_format: bool  # a complete \boxed{...} was found
    correct: bool  # the boxed answer is equivalent to the reference
    extracted_answer: str | None  # the content of the last \boxed{}, if any


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} (or \\fbox{...}) in `text`, or None."""
    for marker in ("\\boxed{", "\\fbox{"):
        start = text.rfind(marker)
        while start != -1:
            depth, position = 1, start + len(marker)
            while position < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[position], 0)
                position += 1
            if depth == 0:
                return text[start + len(marker) : position - 1].strip()
            start = text.rfind(marker, 0, start)  # unbalanced: try the one before
    return None


def _normalise(answer: str) -> str:
    return answer.replace(" ", "").replace("$", "").rstrip(".").lstrip("+")


def _equivalent(extracted: str, reference: str, timeout: int | None) -> bool:
    gold = parse(f"${reference}$", [LatexExtractionConfig()], parsing_timeout=timeout)
    guess = parse(f"${extracted}$", [LatexExtractionConfig()], parsing_timeout=timeout)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=timeout))


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
    if _normalise(extracted) == _normalise(reference):
        return True  # the common case needs no symbolic comparison
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
