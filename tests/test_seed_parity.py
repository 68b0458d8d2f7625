"""The seed's rules, each with the outcome the seed's own code gives (its protocol.py, reward.py, sandbox.py and
rollout.py, run on the same inputs), and each departure the project keeps, pointing at its row of docs/layout.md,
"Departures from the seed"."""

from dataclasses import replace

import pytest

from retool.config.sandbox import SandboxConfig
from retool.config.trainer import TrainerConfig
from retool.data.reward import score_answer
from retool.protocol.chat import BUNDLED_TEMPLATE, ChatProtocol
from retool.protocol.tool_calls import parse_assistant
from retool.rollout.datums import build_datum
from retool.rollout.in_memory import rollout_in_memory
from retool.rollout.scoring import assign_group_advantages
from retool.rollout.state import Trajectory
from retool.sampling.scripted import ScriptedSampler
from retool.sandbox.observation import ExecutionResult, observation_text
from tests.helpers import InstantSandbox, scripted
from tests.test_rollout import CONFIG as ROLLOUT_CONFIG
from tests.test_rollout import EXAMPLES

EXAMPLE = EXAMPLES[0]
CONFIG = replace(ROLLOUT_CONFIG, group_size=2)  # the state machine tests' budgets, a group of two


@pytest.fixture(scope="module")
def xml(tokenizer) -> ChatProtocol:
    """The seed's call format (Qwen's XML), through the bundled ChatML template."""
    return ChatProtocol(tokenizer, tool_format="xml", chat_template=BUNDLED_TEMPLATE)


def call(code: str) -> str:
    return (
        f"<tool_call>\n<function=code_interpreter>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>"
    )


# -- protocol.parse_assistant: a turn is a tool call, an answer or invalid ------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "code"),
    [
        ("So the answer is \\boxed{3}.", "answer", None),
        ("Let me compute.\n" + call("print(1 + 1)"), "tool", "print(1 + 1)"),
        (call("print(1)") + " and more", "invalid", None),  # nothing may follow the call
        (call("a=1") + "\n" + call("b=2"), "invalid", None),  # one call a turn
        ("<tool_call>\n<function=code_interpreter>\n<parameter=code>\nprint(1)", "invalid", None),  # unclosed
        (call("   "), "invalid", None),  # empty code
        (
            "<tool_call>\n<function=browser>\n<parameter=code>\n1\n</parameter>\n</function>\n</tool_call>",
            "invalid",
            None,
        ),
        ("done </tool_call> \\boxed{2}", "answer", None),  # a stray closing tag without an opening one
        (call("```python\nprint(2)\n```"), "tool", "```python\nprint(2)\n```"),  # run as written, fence and all
        (call("   x = 1\n   print(x)   "), "tool", "x = 1\n   print(x)"),  # stripped of surrounding whitespace
        (
            "<tool_call>\n<function=code_interpreter>\n<parameter=code>\n1\n</parameter>\n<parameter=x>\n2\n"
            "</parameter>\n</function>\n</tool_call>",
            "tool",
            "1\n</parameter>\n<parameter=x>\n2",  # the pattern's capture: to the last </parameter>
        ),
        ("\\boxed{4}\n" + call("print(4)"), "tool", "print(4)"),  # an answer before a call: the call counts
    ],
)
def test_a_turn_parses_as_the_seed_parses_it(text, kind, code):
    parsed = parse_assistant(text, "xml")
    assert (parsed.kind, parsed.code) == (kind, code)


# -- rollout.begin_advance: the caps on calls and turns (can_code) -------------------------------------------------


def keeps_calling(protocol):
    return ScriptedSampler(scripted(protocol, lambda q, g, t: call(f"print({t})")))


@pytest.mark.parametrize(
    ("calls", "turns", "observations", "stop"), [(2, 4, 2, "max_code_calls"), (4, 2, 1, "max_turns")]
)
def test_a_call_runs_only_with_calls_and_turns_left(xml, calls, turns, observations, stop):
    """The seed: a tool turn runs while code_calls < max_code_calls and the turn is not the last allowed; the turn
    that may not run becomes the final text (a call, so -1)."""
    config = replace(CONFIG, max_code_calls=calls, max_assistant_turns=turns)
    (trajectory, _) = rollout_in_memory([EXAMPLE], keeps_calling(xml), InstantSandbox(), xml, config)
    assert trajectory.code_calls == observations and len(trajectory.turns) == observations + 1
    assert trajectory.stop_reason == stop and trajectory.final_text == trajectory.turns[-1].text
    assert trajectory.reward == -1.0


def test_the_end_of_turn_token_after_a_call_is_sampled_and_trained(xml):
    """The seed stops sampling only at the end-of-turn token: a call's turn ends with it, it is an action, and the
    closing it completes is not appended again (docs/layout.md, departures: the stop string)."""
    assert xml.stop_strings == ()
    sampler = ScriptedSampler(scripted(xml, lambda q, g, t: call("print(4)") if t == 0 else "\\boxed{4}"))
    (trajectory, _) = rollout_in_memory([EXAMPLE], sampler, InstantSandbox(), xml, CONFIG)
    first, second = trajectory.turns
    assert first.completion_tokens[-1] == xml.end_of_turn_token
    end = len(first.prompt_tokens) + len(first.completion_tokens)
    assert list(second.prompt_tokens[:end]) == list(first.prompt_tokens) + list(first.completion_tokens)
    assert second.prompt_tokens[end] != xml.end_of_turn_token  # the closing's rest, then the tool message
    trajectory.advantage = 1.0
    datum = build_datum(trajectory, CONFIG.trainer_max_tokens)
    end_of_first = end - 2  # the end-of-turn token, as a target of the position before it
    assert datum.target_tokens[end_of_first] == xml.end_of_turn_token and datum.loss_mask[end_of_first]


# -- reward.score_answer: the last \boxed{ and math_verify ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reference", "reward", "valid", "answer"),
    [
        ("The answer is \\boxed{204}.", "204", 1.0, True, "204"),
        ("\\boxed{7} and then \\boxed{8", "7", -1.0, False, None),  # the last \boxed{ is unbalanced: no answer
        ("\\boxed{5} then \\boxed{6}", "5", -1.0, True, "6"),  # the last one decides
        ("\\fbox{5}", "5", -1.0, False, None),  # only \boxed
        ("\\boxed{1 2}", "12", -1.0, True, "1 2"),  # equal only after deleting spaces: not equal
        ("\\boxed{1 000}", "1000", -1.0, True, "1 000"),
        ("\\boxed{1,000}", "1000", 1.0, True, "1,000"),  # thousands separators
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, True, "\\frac{1}{2}"),  # a fraction and a decimal
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0, True, "\\{2,1\\}"),  # a set in any order
        ("\\boxed{x=3}", "3", 1.0, True, "x=3"),  # an x= prefix
        ("\\boxed{ 12 }", "12", 1.0, True, "12"),
        ("\\boxed{}", "3", -1.0, True, ""),
        ("", "3", -1.0, False, None),  # an empty final text
        ("\\boxed{3}" + "." * 300, "3", -1.0, False, None),  # only the last 300 characters are read
    ],
)
def test_the_reward_is_the_seeds(text, reference, reward, valid, answer):
    score = score_answer(text, reference)
    assert (score.reward, score.valid_format, score.extracted_answer) == (reward, valid, answer)
    assert score.correct == (reward == 1.0)


def test_a_budget_that_ends_after_an_observation_scores_an_empty_final_text(xml):
    """The seed: make_request finds no room for another turn and ends the trajectory with final_text "" (-1), even
    when the turn that called the tool had written a \\boxed{} answer before the call."""
    sampler = ScriptedSampler(scripted(xml, lambda q, g, t: "\\boxed{4}\n" + call("print(4)")))
    probe = rollout_in_memory([EXAMPLE], sampler, InstantSandbox(), xml, replace(CONFIG, max_code_calls=1))[0]
    first = probe.turns[1].prompt_tokens  # the prompt after the one observation
    config = replace(CONFIG, max_code_calls=4, max_trajectory_tokens=len(first), min_tool_response_tokens=1)
    trajectory = rollout_in_memory([EXAMPLE], sampler, InstantSandbox(), xml, config)[0]
    assert (trajectory.stop_reason, trajectory.final_text, trajectory.reward) == ("token_budget", "", -1.0)


# -- rollout.assign_group_advantages: A = R - mean(R) per question, no std -------------------------------------------


def test_advantages_are_centred_per_question_without_a_std():
    trajectories = [Trajectory(EXAMPLE, q, g, []) for q in (0, 1) for g in range(4)]
    for trajectory, reward in zip(trajectories, [1, -1, -1, -1, 1, 1, 1, 1]):
        trajectory.reward = trajectory.shaped_reward = float(reward)
    assign_group_advantages(trajectories)
    assert [t.advantage for t in trajectories] == [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]


# -- sandbox.format_tool_content: what the model reads back ---------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "seen"),
    [
        (ExecutionResult("ok", "42\n", "", 0.1, 0), "42\n"),  # stdout as printed, its newline kept
        (ExecutionResult("ok", "", "", 0.1, 0), ""),  # nothing printed: an empty string
        (
            ExecutionResult("error", "x\n", "Traceback ...\nZeroDivisionError\n", 0.1, 1),
            "Traceback ...\nZeroDivisionError\n",
        ),
        (ExecutionResult("error", "", "", 0.1, 3), "Error: process exited with code 3."),
        (ExecutionResult("timeout", "partial\n", "", 10.0, None), "Error: execution timed out after 10 seconds."),
        (ExecutionResult("ok", "y" * 5000, "", 0.1, 0), "[... truncated 904 chars ...]\n" + "y" * 4096),
    ],
)
def test_the_observation_is_the_seeds(result, seen):
    assert observation_text(result, SandboxConfig(timeout_seconds=10)) == seen


def test_a_long_output_read_back_from_the_sandbox_counts_what_it_cut_as_the_seed_does():
    """The seed reads back the last 16384 bytes of a stream and cuts them to their last 4096 characters, counting the
    characters it cut: 10,033 printed, 5937 cut."""
    from retool.sandbox.call import Sandbox

    config = SandboxConfig(timeout_seconds=20)
    [result] = Sandbox(config).run_many(["print('y' * 10032)"])
    assert observation_text(result, config) == "[... truncated 5937 chars ...]\n" + "y" * 4095 + "\n"


# -- departures kept, each a row of docs/layout.md, "Departures from the seed" --------------------------------------


def test_departure_the_gradient_norm_is_clipped():
    """Row "Gradient-norm clipping": the seed's train.py clips nothing; verl's and TRL's defaults clip at 1.0."""
    assert TrainerConfig().max_grad_norm == 1.0


def test_departure_a_notebook_observation_is_a_setting():
    """Row "Observation format": [sandbox] observation = notebook prints stdout, then stderr, or "(no output)"."""
    notebook = SandboxConfig(observation="notebook")
    assert observation_text(ExecutionResult("ok", "", "", 0.1, 0), notebook) == "(no output)"
    assert observation_text(ExecutionResult("error", "x\n", "E\n", 0.1, 1), notebook) == "x\nE"


def test_departure_sampling_may_stop_at_the_closing_tag(tokenizer):
    """Row "Stop string": [model] stop_at_tool_call = true ends a turn at </tool_call>."""
    stopping = ChatProtocol(tokenizer, chat_template=BUNDLED_TEMPLATE, stop_at_tool_call=True)
    assert stopping.stop_strings == ("</tool_call>",)


def test_departure_hermes_calls_are_parsed_too():
    """Row "Tool-call formats": the seed parses only the XML form; templates that teach JSON calls get them parsed."""
    text = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": " print(5) "}}\n</tool_call>'
    assert (parse_assistant(text, "hermes").kind, parse_assistant(text, "hermes").code) == ("tool", "print(5)")
