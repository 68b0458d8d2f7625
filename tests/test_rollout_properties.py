"""Property-based: any mix of model behaviour and budgets ends every trajectory with every invariant."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retool.config.rollout import RolloutConfig, seed_field
from retool.data.examples import MathExample
from retool.rollout.datums import trajectory_sequence
from retool.rollout.in_memory import rollout_in_memory
from retool.rollout.state import REFUSED, STOP_REASONS
from retool.sampling.scripted import ScriptedSampler
from tests.helpers import InstantSandbox, completion, tool_call_text

BEHAVIOURS = ("answer", "tool", "big_tool", "malformed", "max_length", "budget_fill", "open_tool")


def behaviour_text(name: str, question: int, turn: int, tool_format: str) -> tuple[str, bool]:
    """Text of one turn, and whether the model closes the turn with its end token."""
    if name == "answer":
        return f"The result is \\boxed{{{question + turn}}}", True
    if name == "tool":
        return tool_call_text(f"print({question} * {turn})", tool_format), True
    if name == "big_tool":
        return tool_call_text(f"print('x' * {400 + 97 * turn})", tool_format), False
    if name == "malformed":
        return '<tool_call>\n{"name": "code_interpreter", "arguments": ', True
    if name == "open_tool":  # stopped on </tool_call>, closing not emitted
        return tool_call_text("print(7)", tool_format), False
    if name == "max_length":
        return "Thinking " * 400, False  # never stops by itself: cut at max_tokens
    return "\\boxed{1} " + "filler " * 2000, False  # budget_fill: more than any budget


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    plan=st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=12),
    questions=st.integers(0, 3),
    group_size=st.integers(1, 4),
    max_code_calls=st.integers(1, 4),
    max_turns=st.integers(1, 5),
    max_trajectory_tokens=st.integers(250, 1400),
    max_assistant_tokens=st.integers(1, 300),
    max_tool_response_tokens=st.integers(1, 200),
    step=st.integers(0, 5),
    calls_spent=st.sampled_from(["end", "answer_turn"]),
)
def test_any_behaviour_ends_every_trajectory_with_the_invariants(
    protocol,
    plan,
    questions,
    group_size,
    max_code_calls,
    max_turns,
    max_trajectory_tokens,
    max_assistant_tokens,
    max_tool_response_tokens,
    step,
    calls_spent,
):
    config = RolloutConfig(
        group_size=group_size,
        max_code_calls=max_code_calls,
        max_assistant_turns=max_turns,
        max_trajectory_tokens=max_trajectory_tokens,
        max_assistant_tokens=max_assistant_tokens,
        max_tool_response_tokens=max_tool_response_tokens,
        min_tool_response_tokens=min(8, max_tool_response_tokens),
        trainer_max_tokens=2048,
        calls_spent=calls_spent,
    )
    examples = [
        MathExample(f"q{i}", f"Question {i}: what is {i}+{i}?" + " Think." * (60 * (i == 2)), str(2 * i), "t")
        for i in range(questions)
    ]

    def script(request, index):
        group, turn = request.group_indices[index], seed_field(request.seed, "turn")
        name = plan[(request.question_index * 7 + group * 3 + turn) % len(plan)]
        text, close = behaviour_text(name, request.question_index, turn, protocol.tool_format)
        return completion(protocol, text, close=close)

    sampler = ScriptedSampler(script)
    trajectories = rollout_in_memory(examples, sampler, InstantSandbox(), protocol, config, step=step)

    assert len(trajectories) == questions * group_size
    assert sorted((t.question_index, t.group_index) for t in trajectories) == [
        (q, g) for q in range(questions) for g in range(group_size)
    ]
    for request in sampler.requests:
        first_round = seed_field(request.seed, "turn") == 0
        assert request.num_samples == (group_size if first_round else 1)
    for trajectory in trajectories:
        assert trajectory.done and trajectory.stop_reason in STOP_REASONS
        assert trajectory.reward in (1.0, -1.0) and trajectory.advantage is not None
        refused = [t for t in trajectory.turns if t.tool_call and t.tool_call.status == REFUSED]
        assert len(refused) <= (calls_spent == "answer_turn") and trajectory.code_calls <= max_code_calls
        assert len(trajectory.turns) <= max_turns + len(refused)  # a refused call's one more turn
        ran = [t for t in trajectory.turns if t.tool_call and t.tool_call.content and t.tool_call.status != REFUSED]
        assert trajectory.code_calls == len(ran)
        if trajectory.turns:
            # Out of budget after an observation, no answer turn followed: the seed's empty final text.
            ended_unanswered = trajectory.stop_reason == "token_budget" and trajectory.turns[-1].tool_call is not None
            assert trajectory.final_text == ("" if ended_unanswered else trajectory.turns[-1].text)
        else:
            assert trajectory.stop_reason == "prompt_over_budget"
        for turn in trajectory.turns:
            assert len(turn.completion_tokens) == len(turn.logprobs) > 0
            assert len(turn.prompt_tokens) + len(turn.completion_tokens) <= max_trajectory_tokens
            if turn.tool_call and turn.tool_call.content:
                assert protocol.count_tokens(turn.tool_call.content) <= max_tool_response_tokens
        sequence = trajectory_sequence(trajectory)  # raises if any prompt fails to extend the history
        assert sum(sequence.is_action) == sum(len(t.completion_tokens) for t in trajectory.turns)
    for question in range(questions):
        assert abs(sum(t.advantage for t in trajectories if t.question_index == question)) < 1e-9
