import threading

import pytest

from retool.data.reward import last_boxed, score_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{\\sqrt{x^{2}}} ok", "\\sqrt{x^{2}}"),
        ("\\boxed{7} and an unclosed \\boxed{8", None),  # the last \\boxed{ decides (docs/layout.md, departures)
        ("no box here", None),
        ("\\fbox{5}", None),
    ],
)
def test_the_last_boxed_decides(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "reference", "correct"),
    [
        ("The answer is \\boxed{204}.", "204", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
        ("\\boxed{205}", "204", False),
        ("\\boxed{}", "204", False),
    ],
)
def test_equivalence(text, reference, correct):
    score = score_answer(text, reference)
    assert score.correct is correct
    assert score.valid_format is True
    assert score.reward == (1.0 if correct else -1.0)


def test_missing_box_is_invalid_format():
    score = score_answer("I think it is 204", "204")
    assert (score.reward, score.valid_format, score.correct, score.extracted_answer) == (-1.0, False, False, None)


def test_only_the_last_300_characters_count():
    text = "\\boxed{204}" + " filler" * 100
    assert score_answer(text, "204").valid_format is False


def test_scoring_works_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(score_answer("\\boxed{\\frac{2}{4}}", "0.5")))
    thread.start()
    thread.join()
    assert results[0].correct
