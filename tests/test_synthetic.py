"""The synthetic problem families and the shipped data sets made from them: exact answers, solutions whose
recorded output is what the sandbox prints, and held-out families that no training file contains."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from retool.config.sandbox import SandboxConfig
from retool.data.conversations import read_conversations
from retool.data.examples import read_examples
from retool.data.families import FAMILIES, ROLES, families_of
from retool.data.synthetic import (
    evaluation_questions,
    family_of,
    generate,
    generate_problems,
    more_rl_questions,
    training_questions,
)
from retool.sandbox.call import Sandbox
from tests.helpers import REPO

SFT, TRAIN, EVAL = (
    REPO / "data" / name for name in ("synthetic_sft.jsonl", "synthetic_train.jsonl", "synthetic_eval.jsonl")
)


def test_families_cover_many_kinds_in_three_disjoint_roles():
    roles = Counter(role for role, _ in FAMILIES.values())
    assert sum(roles.values()) >= 20 and set(roles) == set(ROLES) and roles["held-out"] >= 3
    assert sorted(families_of(*ROLES)) == sorted(FAMILIES)
    with pytest.raises(ValueError, match="unknown family roles"):
        families_of("test")


def test_problems_are_deterministic_varied_and_never_repeat_a_question():
    first, second = generate_problems(200, 5, families_of("sft")), generate_problems(200, 5, families_of("sft"))
    assert first == second
    assert len({problem.question for _, problem in first}) == 200
    for family in families_of("sft"):  # several wordings per family
        questions = [p.question for f, p in generate_problems(40, 9, [family])]
        assert len({q.split("$")[0] for q in questions}) >= 2 or family == "linear_recurrence", family
    assert {e.data_source for e in generate(8, seed=5, prefix="s")} <= {f"synthetic/{f}" for f in FAMILIES}


def test_every_family_computes_its_answer_as_its_code_prints_it():
    sandbox = Sandbox(SandboxConfig(timeout_seconds=30.0, max_workers=2))
    try:
        problems = [FAMILIES[family][1](random.Random(seed)) for family in FAMILIES for seed in (0, 1)]
        results = sandbox.run_many([p.code for p in problems] + [p.mistake for p in problems])
        outputs = [sandbox.observation(r).strip() for r in results]
    finally:
        sandbox.close()
    answers = [p.answer for p in problems]
    assert outputs[: len(problems)] == answers
    assert all(wrong != answer for wrong, answer in zip(outputs[len(problems) :], answers))  # a mistake is a mistake


def test_no_held_out_family_or_evaluation_question_is_in_a_training_file():
    held_out = set(families_of("held-out"))
    sft_sources = {family_of(c.data_source) for c in read_conversations(SFT)}
    train_sources = {family_of(e.data_source) for e in read_examples(TRAIN)}
    assert sft_sources == set(families_of("sft")) and train_sources == set(families_of("sft", "rl"))
    assert not (sft_sources | train_sources) & held_out
    trained = {c.question for c in read_conversations(SFT)} | {e.question for e in read_examples(TRAIN)}
    evaluation = read_examples(EVAL)
    assert len(evaluation) >= 256 and not {e.question for e in evaluation} & trained
    roles = {family: role for role in ROLES for family in families_of(role)}
    assert Counter(roles[family_of(e.data_source)] for e in evaluation[:63]) == {r: 21 for r in ROLES}  # any first N
    assert all(count >= 100 for count in Counter(roles[family_of(e.data_source)] for e in evaluation).values())
    assert {family_of(e.data_source) for e in evaluation} == set(FAMILIES)


def test_the_shipped_files_are_what_the_generator_writes():
    assert [e.question for e in read_examples(TRAIN)] == [
        e.question for e in training_questions(len(read_examples(TRAIN)))
    ]
    trained = frozenset({c.question for c in read_conversations(SFT)} | {e.question for e in read_examples(TRAIN)})
    assert read_examples(EVAL) == evaluation_questions(7, 25, 24, trained)


def test_more_rl_questions_leave_the_evaluation_set_as_it_was_and_avoid_it():
    first = training_questions(64)
    trained = frozenset(e.question for e in first)
    evaluation = evaluation_questions(2, 3, 2, trained)
    more = more_rl_questions(200, 64, trained | {e.question for e in evaluation})
    assert evaluation_questions(2, 3, 2, trained | {e.question for e in more}) == evaluation
    assert not {e.question for e in more} & (trained | {e.question for e in evaluation})
    assert {family_of(e.data_source) for e in more} <= set(families_of("rl"))
    assert [e.id for e in more[:2]] == ["train-00064", "train-00065"] and len({e.question for e in more}) == 200


@pytest.mark.slow
def test_every_shipped_solution_shows_what_a_fresh_sandbox_run_of_its_code_prints():
    conversations = read_conversations(SFT)
    calls = [turn for conversation in conversations for turn in conversation.turns if turn.code is not None]
    sandbox = Sandbox(SandboxConfig(timeout_seconds=30.0, cpu_seconds=30, max_workers=2))
    try:
        outputs = [sandbox.observation(result) for result in sandbox.run_many([turn.code for turn in calls])]
    finally:
        sandbox.close()
    assert [turn.output for turn in calls] == outputs
    corrected = [c for c in conversations if len(c.turns) == 3]
    assert 0.1 < len(corrected) / len(conversations) < 0.4
    assert all(c.turns[-1].code is None and f"\\boxed{{{c.answer}}}" in c.turns[-1].text for c in conversations)
