"""The state machine: each invariant and each edge case of the rollout's specification, one test each."""

from dataclasses import replace

import pytest

from retool.config.rollout import RolloutConfig, sample_seed, seed_field
from retool.data.examples import MathExample
from retool.rollout.datums import PrefixError, build_datum, trajectory_sequence
from retool.rollout.in_memory import rollout_in_memory
from retool.rollout.scoring import assign_group_advantages
from retool.rollout.state import (
    NO_CALLS_LEFT,
    REFUSED,
    PendingExecution,
    Trajectory,
    apply_samples,
    fit_tool_content,
    plan_requests,
    sampling_settings,
    start_trajectories,
    turn_budget,
)
from retool.sampling.contract import SampledSequence, SamplerContractError, sample_checked
from retool.sampling.scripted import ScriptedSampler
from tests.helpers import InstantSandbox, completion, scripted, tool_call_text

EXAMPLES = [MathExample("q0", "What is 2+2?", "4", "t"), MathExample("q1", "What is 3*3?", "9", "t")]
CONFIG = RolloutConfig(
    group_size=4,
    max_code_calls=2,
    max_assistant_turns=4,
    max_trajectory_tokens=2048,
    max_assistant_tokens=256,
    max_tool_response_tokens=64,
    trainer_max_tokens=4096,
)


def tool_then_answer(protocol):
    """Branch g calls the tool g times, then answers (correctly on even branches)."""
    answers = {0: "4", 1: "9"}

    def choose(question, group, turn):
        if turn < group:
            return tool_call_text(f"print({question} + {turn})", protocol.tool_format)
        return f"Done: \\boxed{{{answers[question] if group % 2 == 0 else 0}}}"

    return ScriptedSampler(scripted(protocol, choose))


def run(protocol, sampler, config=CONFIG, examples=EXAMPLES, sandbox=None, step=0):
    return rollout_in_memory(examples, sampler, sandbox or InstantSandbox(), protocol, config, step=step)


# -- invariants ---------------------------------------------------------------------------------


def test_invariant_1_completion_and_logprobs_have_equal_length(hermes):
    for trajectory in run(hermes, tool_then_answer(hermes)):
        assert all(len(t.completion_tokens) == len(t.logprobs) for t in trajectory.turns)
    broken = ScriptedSampler(lambda request, index: ([5, 6, 7], [-0.1, -0.2]))
    with pytest.raises(SamplerContractError, match="question 0, branches .* 3 tokens but 2 logprobs"):
        run(hermes, broken)


def test_invariant_2_next_prompt_is_prompt_plus_completion_plus_delta(protocol):
    for trajectory in run(protocol, tool_then_answer(protocol)):
        for before, after in zip(trajectory.turns, trajectory.turns[1:]):
            assert (
                after.prompt_tokens[: len(before.prompt_tokens) + len(before.completion_tokens)]
                == before.prompt_tokens + before.completion_tokens
            )
            delta = after.prompt_tokens[len(before.prompt_tokens) + len(before.completion_tokens) :]
            assert "<tool_response>" in protocol.tokenizer.decode(delta)


def test_invariant_3_completions_are_the_samplers_tokens(hermes):
    # Spell the answer one character per token: decodes to the same text, but is not how the
    # tokenizer would encode it. The turn must keep these exact tokens.
    text = "\\boxed{4}"
    odd_tokens = [hermes.tokenizer.convert_tokens_to_ids(ch) for ch in text]
    assert odd_tokens != hermes.encode(text)
    sampler = ScriptedSampler(lambda request, index: (odd_tokens, [-1.0] * len(odd_tokens)))
    for trajectory in run(hermes, sampler):
        assert trajectory.turns[0].completion_tokens == odd_tokens
        assert trajectory.turns[0].text == text


def test_invariant_4_every_sampled_turn_is_recorded_before_parsing(hermes):
    config = RolloutConfig(**{**CONFIG.__dict__, "max_assistant_turns": 2})
    always_tool = ScriptedSampler(
        scripted(hermes, lambda q, g, t: tool_call_text("print(1)", "hermes") if g % 2 else "<tool_call>broken")
    )
    for trajectory in run(hermes, always_tool, config):
        if trajectory.group_index % 2:  # valid calls: the last one is recorded though never run
            assert [t.kind for t in trajectory.turns] == ["tool", "tool"] and trajectory.stop_reason == "max_turns"
            assert trajectory.turns[-1].tool_call is None
        else:
            assert [t.kind for t in trajectory.turns] == ["invalid"] and trajectory.stop_reason == "invalid"


def test_invariant_5_first_round_asks_group_size_then_one_per_trajectory(hermes):
    sampler = tool_then_answer(hermes)
    run(hermes, sampler)
    first_round = [r for r in sampler.requests if seed_field(r.seed, "turn") == 0]
    assert [r.num_samples for r in first_round] == [CONFIG.group_size] * len(EXAMPLES)
    assert all(r.num_samples == 1 for r in sampler.requests if seed_field(r.seed, "turn") > 0)
    assert len(sampler.requests) == len(EXAMPLES) + sum(range(CONFIG.group_size)) * len(EXAMPLES) - len(EXAMPLES)


def test_invariant_6_only_sampled_tokens_are_actions(hermes):
    # Tool calls stop on </tool_call> without the closing token, so the delta carries the closing.
    sampler = ScriptedSampler(
        scripted(hermes, lambda q, g, t: tool_call_text("print(1)", "hermes") if t == 0 else "\\boxed{4}", close=False)
    )
    trajectory = run(hermes, sampler)[0]
    sequence = trajectory_sequence(trajectory)
    first, second = trajectory.turns
    assert sequence.tokens.tolist() == second.prompt_tokens + second.completion_tokens
    expected = [False] * len(first.prompt_tokens) + [True] * len(first.completion_tokens)
    expected += [False] * (len(second.prompt_tokens) - len(first.prompt_tokens) - len(first.completion_tokens))
    expected += [True] * len(second.completion_tokens)
    assert sequence.is_action.tolist() == expected
    assert [
        lp for lp, action in zip(sequence.old_logprobs, sequence.is_action) if action
    ] == first.logprobs + second.logprobs
    assert all(lp == 0.0 for lp, action in zip(sequence.old_logprobs, sequence.is_action) if not action)
    closing = second.prompt_tokens[len(first.prompt_tokens) + len(first.completion_tokens)]
    assert closing == hermes.stop_token_ids[0]  # the closing the model did not emit is context


def test_invariant_7_prompt_plus_completion_stays_within_budget(hermes):
    config = RolloutConfig(**{**CONFIG.__dict__, "max_trajectory_tokens": 700, "max_tool_response_tokens": 200})
    long_output = ScriptedSampler(
        scripted(
            hermes,
            lambda q, g, t: tool_call_text("print('x' * 5000)", "hermes") if t < 3 else "\\boxed{4}" + " pad" * 300,
        )
    )
    for trajectory in run(hermes, long_output, config):
        for turn in trajectory.turns:
            assert len(turn.prompt_tokens) + len(turn.completion_tokens) <= config.max_trajectory_tokens


def test_invariant_8_rewards_first_then_advantages_by_question(hermes):
    trajectories = run(hermes, tool_then_answer(hermes), examples=[EXAMPLES[0], EXAMPLES[0]])
    for question_index in (0, 1):  # the same example twice is two groups
        group = [t for t in trajectories if t.question_index == question_index]
        mean = sum(t.reward for t in group) / len(group)
        assert [t.advantage for t in group] == [t.reward - mean for t in group]
    assert [t.reward for t in trajectories[:4]] == [1.0, -1.0, 1.0, -1.0]
    assert [t.advantage for t in trajectories[:4]] == [1.0, -1.0, 1.0, -1.0]
    unscored = start_trajectories(EXAMPLES, hermes, CONFIG)
    with pytest.raises(ValueError, match="no reward yet"):
        assign_group_advantages(unscored)


# -- edge cases ---------------------------------------------------------------------------------


def pending_for(protocol, config, prompt_length):
    """A pending call whose prompt + completion is `prompt_length` tokens long."""
    messages = protocol.initial_messages("Q")
    prompt = protocol.build_prompt(messages)
    tokens, _ = completion(protocol, tool_call_text("print(1)", protocol.tool_format))
    prompt = prompt + [prompt[-1]] * (prompt_length - len(prompt) - len(tokens))
    trajectory = Trajectory(EXAMPLES[0], 0, 0, messages, prompt)
    return PendingExecution(trajectory, "print(1)", "code-0-0-1", messages, "call", prompt, tokens)


@pytest.mark.parametrize("content_length", [0, 1, 20, 65, 66, 67, 200, 5000])
@pytest.mark.parametrize("room", [0, 1, 2, 5, 30, 100])
def test_edge_1_truncation_always_terminates_and_fits(hermes, content_length, room):
    config = RolloutConfig(**{**CONFIG.__dict__, "max_trajectory_tokens": 600, "max_tool_response_tokens": 40})
    wrapper = hermes.tool_wrapper_tokens(hermes.initial_messages("Q"))
    pending = pending_for(hermes, config, 600 - wrapper - room)
    content = "".join(chr(ord("a") + i % 26) for i in range(content_length)) + "\nresult 42"
    fitted = fit_tool_content(pending, content, hermes, config)
    if fitted is None:
        assert room < hermes.count_tokens("[... truncated ...]")
        return
    text, next_prompt = fitted
    assert len(next_prompt) <= config.max_trajectory_tokens
    assert hermes.count_tokens(text) <= config.max_tool_response_tokens
    assert text == content or (
        text.startswith("[... truncated ...]")
        and (content.endswith(text.split("\n", 1)[-1]) or text == "[... truncated ...]")
    )


def test_edge_2_prompt_over_budget_still_yields_the_group(hermes):
    config = RolloutConfig(**{**CONFIG.__dict__, "max_trajectory_tokens": 300, "max_assistant_tokens": 100})
    long_question = MathExample("long", "Why? " * 400, "1", "t")
    trajectories = run(hermes, tool_then_answer(hermes), config, examples=[long_question, EXAMPLES[1]])
    assert len(trajectories) == 2 * config.group_size
    over = [t for t in trajectories if t.question_index == 0]
    assert [t.stop_reason for t in over] == ["prompt_over_budget"] * config.group_size
    assert all(t.turns == [] and t.reward == -1.0 and t.advantage == 0.0 for t in over)


def test_edge_3_exactly_filled_budget_scores_an_empty_final_text(hermes):
    # A budget so tight that after one observation no token can be generated.
    probe = start_trajectories(EXAMPLES[:1], hermes, CONFIG)[0]
    call = tool_call_text("print(1)", "hermes")
    call_tokens = len(completion(hermes, call)[0])
    wrapper = hermes.tool_wrapper_tokens(probe.messages)
    budget = len(probe.next_prompt_tokens) + call_tokens + wrapper + 16
    config = RolloutConfig(**{**CONFIG.__dict__, "max_trajectory_tokens": budget, "min_tool_response_tokens": 16})
    sampler = ScriptedSampler(scripted(hermes, lambda q, g, t: call if t == 0 else "\\boxed{4}"))
    trajectory = run(hermes, sampler, config, examples=EXAMPLES[:1], sandbox=InstantSandbox())[0]
    assert trajectory.stop_reason == "token_budget"
    assert trajectory.final_text == "" and trajectory.reward == -1.0  # the seed's: it never answered
    assert len(trajectory.turns) == 1 and trajectory.code_calls == 1


def test_edge_4_room_is_reserved_for_the_tool_wrapper(hermes):
    config = RolloutConfig(**{**CONFIG.__dict__, "max_trajectory_tokens": 1024, "max_assistant_tokens": 1024})
    trajectory = start_trajectories(EXAMPLES[:1], hermes, config)[0]
    wrapper = hermes.tool_wrapper_tokens(trajectory.messages)
    remaining = config.max_trajectory_tokens - len(trajectory.next_prompt_tokens)
    assert turn_budget(trajectory, hermes, config) == remaining - wrapper - config.min_tool_response_tokens
    last_turn = RolloutConfig(**{**config.__dict__, "max_assistant_turns": 1})
    assert turn_budget(trajectory, hermes, last_turn) == remaining  # that turn cannot call the tool anyway


def test_edge_5_rollout_context_over_trainer_context_is_rejected():
    with pytest.raises(ValueError, match="max_trajectory_tokens = 16384: must be at most trainer_max_tokens = 8192"):
        RolloutConfig(max_trajectory_tokens=16384, trainer_max_tokens=8192)


def test_edge_6_text_is_decoded_from_the_tokens(hermes):
    tokens = hermes.encode("  The answer is \\boxed{4}  ") + [hermes.stop_token_ids[0]]
    sampler = ScriptedSampler(lambda request, index: (tokens, [-0.5] * len(tokens)))
    for trajectory in run(hermes, sampler):
        assert trajectory.turns[0].text == hermes.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        assert trajectory.final_text == "The answer is \\boxed{4}"


def test_edge_7_transient_sampler_failures_are_retried(hermes, monkeypatch):
    delays = []
    monkeypatch.setattr("retool.sampling.contract.time.sleep", delays.append)
    inner = tool_then_answer(hermes)
    failures = []

    class Flaky:
        def sample(self, requests, settings):
            if len(failures) < 2:
                failures.append(1)
                raise ConnectionError("engine restarting")
            return inner.sample(requests, settings)

    trajectories = rollout_in_memory(EXAMPLES, Flaky(), InstantSandbox(), hermes, CONFIG)
    assert len(trajectories) == 8 and len(failures) == 2
    assert delays == [1.0, 2.0]  # exponential backoff

    class Down:
        def sample(self, requests, settings):
            raise ConnectionError("engine gone")

    with pytest.raises(RuntimeError, match="sampler failed 3 times.*engine gone"):
        sample_checked(Down(), [_request()], sampling_settings(CONFIG, hermes))


def _request():
    from retool.sampling.contract import SampleRequest

    return SampleRequest(0, (0,), (1, 2, 3), 8, 1)


@pytest.mark.parametrize(
    "field",
    [
        "group_size",
        "max_code_calls",
        "max_assistant_turns",
        "max_trajectory_tokens",
        "max_assistant_tokens",
        "max_tool_response_tokens",
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_edge_8_non_positive_settings_are_rejected(field, value):
    with pytest.raises(ValueError, match=rf"setting \[rollout\] {field} = {value}: must be a positive integer"):
        RolloutConfig(**{field: value})


def test_edge_9_empty_input_gives_empty_output(hermes):
    sampler = tool_then_answer(hermes)
    assert run(hermes, sampler, examples=[]) == []
    assert sampler.requests == []


# -- the rest of the machine ----------------------------------------------------------------------


def test_seeds_include_the_step_and_never_collide():
    seen = {sample_seed(42, step, q, g, t) for step in range(3) for q in range(4) for g in range(8) for t in range(6)}
    assert len(seen) == 3 * 4 * 8 * 6
    with pytest.raises(ValueError, match="group_index"):
        sample_seed(42, 0, 0, 512, 0)


def test_rollout_is_reproducible_and_step_changes_seeds(hermes):
    first = tool_then_answer(hermes)
    second = tool_then_answer(hermes)
    run(hermes, first, step=1)
    run(hermes, second, step=1)
    assert first.requests == second.requests
    third = tool_then_answer(hermes)
    run(hermes, third, step=2)
    assert {r.seed for r in third.requests}.isdisjoint({r.seed for r in first.requests})


def test_stop_reasons_and_code_calls(hermes):
    trajectories = run(hermes, tool_then_answer(hermes))
    by_branch = {t.group_index: t for t in trajectories if t.question_index == 0}
    assert [by_branch[g].code_calls for g in range(4)] == [0, 1, 2, 2]
    assert [by_branch[g].stop_reason for g in range(4)] == ["answer", "answer", "answer", "max_code_calls"]
    assert by_branch[1].turns[0].tool_call.content == "ran: print(0 + 0)\n"
    assert by_branch[1].turns[0].tool_call.call_id == "code-0-1-1"


def test_real_sandbox_observation_reaches_the_next_prompt(hermes):
    from retool.sandbox.call import Sandbox

    sampler = ScriptedSampler(
        scripted(hermes, lambda q, g, t: tool_call_text("x = 6 * 7\nprint(x)", "hermes") if t == 0 else "\\boxed{42}")
    )
    trajectory = run(hermes, sampler, examples=EXAMPLES[:1], sandbox=Sandbox())[0]
    assert trajectory.turns[0].tool_call.status == "ok" and trajectory.turns[0].tool_call.content == "42\n"
    assert "<tool_response>\n42\n\n</tool_response>" in hermes.tokenizer.decode(trajectory.turns[1].prompt_tokens)


def test_requests_map_back_to_their_branches(hermes):
    trajectories = start_trajectories(EXAMPLES, hermes, CONFIG)
    requests = plan_requests(trajectories, hermes, CONFIG, step=0)
    replies = [
        [
            SampledSequence(
                tuple(completion(hermes, f"\\boxed{{{r.question_index}{g}}}")[0]),
                tuple(completion(hermes, f"\\boxed{{{r.question_index}{g}}}")[1]),
                "stop",
            )
            for g in r.group_indices
        ]
        for r in requests
    ]
    assert apply_samples(trajectories, requests, replies, hermes, CONFIG) == []
    assert [t.final_text for t in trajectories] == [f"\\boxed{{{q}{g}}}" for q in range(2) for g in range(4)]


def test_zero_variance_groups_are_counted():
    from retool.rollout.scoring import zero_variance_groups

    assert zero_variance_groups([(0, 1.0), (0, -1.0), (1, -1.0), (1, -1.0), (2, 1.0)]) == 2


def test_a_turn_never_asks_for_more_than_max_assistant_tokens(hermes):
    (trajectory, *_) = start_trajectories(EXAMPLES[:1], hermes, replace(CONFIG, max_assistant_tokens=7))
    (request,) = plan_requests([trajectory], hermes, replace(CONFIG, max_assistant_tokens=7), step=0)
    assert request.max_tokens == 7
    rolled = run(
        hermes,
        ScriptedSampler(scripted(hermes, lambda q, g, t: "a long answer " * 40, close=False)),
        replace(CONFIG, max_assistant_tokens=7),
    )
    assert all(len(turn.completion_tokens) <= 7 for t in rolled for turn in t.turns)


def test_a_prompt_that_does_not_extend_the_turns_before_it_is_a_datum_error(hermes):
    trajectory = run(hermes, tool_then_answer(hermes))[1]  # branch 1: a tool call, then an answer
    build_datum(trajectory, CONFIG.trainer_max_tokens)
    trajectory.turns[1].prompt_tokens[3] += 1
    with pytest.raises(PrefixError, match="question 0, branch 1.*turn 2 does not extend"):
        build_datum(trajectory, CONFIG.trainer_max_tokens)


def test_a_trajectory_over_the_trainers_context_is_a_datum_error(hermes):
    trajectory = run(hermes, tool_then_answer(hermes))[1]
    with pytest.raises(ValueError, match="over the trainer's context of 10"):
        build_datum(trajectory, 10)


def test_a_turn_cut_off_by_its_cap_without_an_answer_ends_on_turn_budget(hermes):
    config = replace(CONFIG, max_assistant_tokens=8)

    def choose(question, group, turn):
        return ["thinking about it " * 20, "\\boxed{4} " + "and more words " * 20, "\\boxed{4}"][group % 3]

    trajectories = run(hermes, ScriptedSampler(scripted(hermes, choose, close=False)), config)
    reasons = {t.group_index: t.stop_reason for t in trajectories if t.question_index == 0}
    assert [reasons[g] for g in range(3)] == ["turn_budget", "answer", "answer"]  # a boxed answer counts even if cut
    assert all(t.turns[-1].finish_reason == "length" for t in trajectories if t.stop_reason == "turn_budget")


def test_the_n_children_of_a_first_turn_request_get_exactly_their_branches_seeds():
    """vLLM seeds child i of a request with seed + i: the first turn's shared request for branches
    0..n-1 must hand each child its own branch's seed, never another turn's."""
    for group in range(8):
        assert sample_seed(42, 3, 5, 0, 0) + group == sample_seed(42, 3, 5, group, 0)
        assert seed_field(sample_seed(42, 3, 5, group, 4), "turn") == 4
    children = {sample_seed(42, 3, 5, 0, 0) + i for i in range(8)}
    later_turns = {sample_seed(42, 3, 5, g, t) for g in range(8) for t in range(1, 6)}
    assert children.isdisjoint(later_turns)


def always_calling(protocol):
    """Every branch calls the tool at every turn but branch 1's fourth, which answers."""
    return ScriptedSampler(
        scripted(protocol, lambda q, g, t: "\\boxed{4}" if (g, t) == (1, 3) else tool_call_text("print(1)", "hermes"))
    )


def test_a_call_with_no_calls_left_ends_the_trajectory_or_gets_an_answer_turn(hermes):
    """calls_spent = end (the seed's): the third call ends the trajectory; answer_turn: it is not run, the model
    reads NO_CALLS_LEFT and gets one more turn (past max_assistant_turns), where a call ends it as the seed's would."""
    config = replace(CONFIG, max_assistant_turns=3)
    ended = run(hermes, always_calling(hermes), config, EXAMPLES[:1])
    assert {(t.stop_reason, len(t.turns), t.code_calls) for t in ended} == {("max_code_calls", 3, 2)}
    answered = run(hermes, always_calling(hermes), replace(config, calls_spent="answer_turn"), EXAMPLES[:1])
    by_branch = {t.group_index: t for t in answered}
    assert (by_branch[1].stop_reason, len(by_branch[1].turns), by_branch[1].code_calls) == ("answer", 4, 2)
    assert (by_branch[0].stop_reason, len(by_branch[0].turns), by_branch[0].code_calls) == ("max_code_calls", 4, 2)
    refused = by_branch[1].turns[2].tool_call
    assert (refused.status, refused.content) == (REFUSED, NO_CALLS_LEFT)
    assert NO_CALLS_LEFT in hermes.tokenizer.decode(by_branch[1].turns[3].prompt_tokens)
    assert by_branch[0].turns[3].tool_call is None  # the second call without calls left is not answered again
