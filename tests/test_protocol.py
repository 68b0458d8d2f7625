import pytest

from retool.protocol.chat import BUNDLED_TEMPLATE, ChatProtocol, TemplateError
from retool.protocol.tool_calls import CODE_INTERPRETER_TOOL, parse_assistant
from tests.helpers import completion, tool_call_text


@pytest.mark.parametrize("tool_format", ["xml", "hermes"])
def test_parse_tool_call(tool_format):
    parsed = parse_assistant(tool_call_text("print(1 + 1)", tool_format), tool_format)
    assert (parsed.kind, parsed.code) == ("tool", "print(1 + 1)")
    assert parse_assistant(tool_call_text("print(1 + 1)", tool_format), "auto").code == "print(1 + 1)"


def test_parse_answer_and_invalid_turns():
    assert parse_assistant("So the answer is \\boxed{3}.").kind == "answer"
    invalid = {
        "two calls": tool_call_text("a=1", "hermes") + "\n" + tool_call_text("b=2", "hermes"),
        "text after": tool_call_text("a=1", "hermes") + " and then more",
        "unclosed": '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "1"',
        "empty code": tool_call_text("   ", "hermes"),
        "wrong tool": '<tool_call>\n{"name": "browser", "arguments": {"code": "1"}}\n</tool_call>',
        "bad json": "<tool_call>\n{name: code}\n</tool_call>",
        "xml without a code parameter": (
            "<tool_call>\n<function=code_interpreter>\n<parameter=x>\n2\n</parameter>\n</function>\n</tool_call>"
        ),
    }
    for name, text in invalid.items():
        parsed = parse_assistant(text, "auto")
        assert parsed.kind == "invalid" and parsed.error, name


def test_hermes_arguments_may_be_a_json_string():
    text = '<tool_call>\n{"name": "code_interpreter", "arguments": "{\\"code\\": \\"print(3)\\"}"}\n</tool_call>'
    assert parse_assistant(text, "hermes").code == "print(3)"


def test_bundled_template_declares_the_tool(protocol):
    assert protocol.template_handles_tools
    prompt_text = protocol.tokenizer.decode(protocol.build_prompt(protocol.initial_messages("What is 2+2?")))
    assert CODE_INTERPRETER_TOOL["function"]["description"] in prompt_text
    assert prompt_text.endswith("<|im_start|>assistant\n")
    assert ("<parameter=" in prompt_text) == (protocol.tool_format == "xml")


def test_template_without_tool_support_gets_the_tool_in_the_system_prompt(tokenizer):
    protocol = ChatProtocol(tokenizer, tool_format="auto")  # SmolLM2's own template ignores tools=
    assert not protocol.template_handles_tools and protocol.tool_format == "hermes"
    assert "code_interpreter" in protocol.system_prompt
    assert "code_interpreter" in protocol.tokenizer.decode(protocol.build_prompt(protocol.initial_messages("Q")))


def test_stop_tokens_come_from_the_template(protocol, tokenizer):
    assert protocol.stop_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert protocol.stop_strings == ()  # a turn ends at the end-of-turn token, after a call too (the seed's)
    assert ChatProtocol(tokenizer, chat_template=BUNDLED_TEMPLATE, stop_at_tool_call=True).stop_strings == (
        "</tool_call>",
    )
    assert {"<|im_start|>", "<|im_end|>", "</tool_response>"} <= set(protocol.forbidden_strings)


@pytest.mark.parametrize("bundled", [True, False], ids=["bundled-template", "fallback-template"])
def test_next_prompt_extends_tokens_over_three_tool_rounds(tokenizer, bundled, protocol):
    """P(i+1) = P(i) + C(i) + D(i) over three rounds, and the result decodes to exactly what the
    template renders for the whole conversation (this template never rewrites history)."""
    if not bundled:
        protocol = ChatProtocol(tokenizer, tool_format=protocol.tool_format)
    messages = protocol.initial_messages("Compute 2**100 mod 7.")
    prompt = protocol.build_prompt(messages)
    for round_number in range(3):
        text = tool_call_text(f"print(pow(2, 100 + {round_number}, 7))", protocol.tool_format)
        tokens, _ = completion(protocol, text, close=round_number != 1)  # round 1 stops on </tool_call>
        observation = f"{round_number}\nline two"
        delta = protocol.observation_delta(messages, tokens, observation, f"code-0-0-{round_number + 1}")
        next_prompt = protocol.build_next_prompt(prompt, tokens, delta)
        assert next_prompt[: len(prompt) + len(tokens)] == prompt + tokens
        messages = [
            *messages,
            protocol.assistant_message(text),
            protocol.tool_message(observation, f"code-0-0-{round_number + 1}"),
        ]
        assert tokenizer.decode(next_prompt) == protocol.render(messages, add_generation_prompt=True)
        prompt = next_prompt


def test_closing_emitted_by_the_model_is_not_added_twice(hermes):
    messages = hermes.initial_messages("Q")
    text = tool_call_text("print(1)", "hermes")
    closed, _ = completion(hermes, text, close=True)
    open_, _ = completion(hermes, text, close=False)
    with_closing = hermes.observation_delta(messages, open_, "1", "c")
    without = hermes.observation_delta(messages, closed, "1", "c")
    assert with_closing[0] == hermes.stop_token_ids[0]
    assert with_closing[1:] == without


def test_wrapper_token_count_matches_an_empty_observation(hermes):
    messages = hermes.initial_messages("Q")
    assert hermes.tool_wrapper_tokens(messages) == len(hermes.observation_delta(messages, [], "", "c"))
    assert hermes.tool_wrapper_tokens(messages) < len(hermes.observation_delta(messages, [], "some output", "c"))


def test_template_that_drops_assistant_content_is_rejected(tokenizer, tmp_path):
    template = tmp_path / "drops.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}{{ m.content }}{% endif "
        "%}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match="drops or rewrites assistant content"):
        ChatProtocol(tokenizer, chat_template=template)


def test_template_that_closes_turns_differently_before_a_tool_is_rejected(tokenizer, tmp_path):
    template = tmp_path / "rewrites.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if not loop.last and messages[loop.index0 + 1].role == 'tool' %}<|endoftext|>{% else %}<|im_end|>{% "
        "endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    protocol = ChatProtocol(tokenizer, chat_template=template)
    with pytest.raises(TemplateError, match="not when a tool message follows"):
        protocol.observation_delta(protocol.initial_messages("Q"), [], "1", "c")


def test_unknown_tool_format_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="tool_format"):
        ChatProtocol(tokenizer, tool_format="yaml", chat_template=BUNDLED_TEMPLATE)


def test_template_keyword_arguments_reach_every_render(tokenizer, tmp_path):
    template = tmp_path / "thinking.jinja"
    template.write_text(
        BUNDLED_TEMPLATE.read_text()
        + "{%- if add_generation_prompt and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    )
    off = ChatProtocol(tokenizer, chat_template=template, template_kwargs={"enable_thinking": False})
    on = ChatProtocol(tokenizer, chat_template=template, template_kwargs={"enable_thinking": True})
    messages = off.initial_messages("What is 2 + 2?")
    assert off.render(messages, True).endswith("<think>\n\n</think>\n\n") and not on.render(messages, True).endswith(
        "</think>\n\n"
    )
    delta = off.tokenizer.decode(off.observation_delta(messages, [], "4", "c"))
    assert delta.endswith("<think>\n\n</think>\n\n")  # the continuation after a tool message is rendered the same way
