"""Prompts rendered with the model's chat template (the tool declared), and the token-exact continuation
after a tool observation (tool calls themselves: retool.protocol.tool_calls)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy

from retool.protocol.tool_calls import CODE_INTERPRETER_TOOL, PROTOCOL_TAGS, TOOL_FORMATS, TOOL_NAME

TEXT_ONLY_SYSTEM_PROMPT = "Solve the math problem step by step. Put the final answer in \\boxed{}."
SYSTEM_PROMPT = (
    "Solve the math problem step by step. You can call the code_interpreter tool to run Python "
    "for calculations and checks; its output comes back to you. Put the final answer in \\boxed{}."
)
BUNDLED_TEMPLATE = Path(__file__).with_name("templates") / "chatml_tools.jinja"
_PLACEHOLDER = "\u2063RETOOL-ASSISTANT-PLACEHOLDER\u2063"  # never produced by a model


class TemplateError(ValueError):
    """The chat template cannot give a token-exact continuation."""


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def special_token_strings(tokenizer) -> tuple[str, ...]:
    """Every special or added token of this tokenizer, as text (what tool output must not contain)."""
    added = [token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    return tuple(sorted(set(added) | set(tokenizer.all_special_tokens)))


def _tools_block(tool_format: str) -> str:
    """The tool description for templates that ignore `tools=`, appended to the system prompt."""
    if tool_format == "xml":
        call = (
            "<tool_call>\n<function=code_interpreter>\n<parameter=code>\n"
            "YOUR CODE\n</parameter>\n</function>\n</tool_call>"
        )
    else:
        call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "YOUR CODE"}}\n</tool_call>'
    return (
        "\n\n# Tools\n\nYou may call this function; its signature is within <tools></tools> XML tags:\n"
        f"<tools>\n{json.dumps(CODE_INTERPRETER_TOOL)}\n</tools>\n\n"
        f"To call it, reply with exactly this format, and write nothing after it:\n{call}"
    )


class ChatProtocol:
    """Renders prompts and continuations for one tokenizer and chat template."""

    def __init__(
        self,
        tokenizer,
        tool_format: str = "auto",
        system_prompt: str | None = None,
        chat_template: str | Path | None = None,
        tools: bool = True,
        template_kwargs: dict | None = None,
        stop_at_tool_call: bool = False,
    ):
        self.tokenizer = tokenizer
        self._rendered_tokens: dict[str, list[int]] = {}  # encode() of template texts met before (see encode_rendered)
        self.template_kwargs = dict(template_kwargs or {})  # e.g. enable_thinking, passed to every render
        self.chat_template = (
            Path(chat_template).read_text(encoding="utf-8") if chat_template else tokenizer.chat_template
        )
        if not self.chat_template:
            raise TemplateError("the tokenizer has no chat template; pass chat_template=PATH")
        if tool_format == "auto":
            # Qwen3.5 / Qwen3-Coder templates teach only the XML form; a template that also shows the
            # JSON form (like the bundled one, which teaches either) defaults to Hermes JSON.
            tool_format = (
                "xml"
                if "<function=" in self.chat_template and "<args-json-object>" not in self.chat_template
                else "hermes"
            )
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of auto, {', '.join(TOOL_FORMATS)}; got {tool_format!r}")
        self.tool_format = tool_format
        self.tools = [CODE_INTERPRETER_TOOL] if tools else None  # None: text-only, no tool declared
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        self.template_handles_tools = self._render_raw(probe, False, tools=[CODE_INTERPRETER_TOOL]) != self._render_raw(
            probe, False, tools=None
        )
        if not tools:
            self.system_prompt = system_prompt or TEXT_ONLY_SYSTEM_PROMPT
        elif self.template_handles_tools:
            self.system_prompt = system_prompt or SYSTEM_PROMPT
        else:
            self.system_prompt = (system_prompt or SYSTEM_PROMPT) + _tools_block(tool_format)
        self.closing_text = self._closing_text(probe)
        self.stop_token_ids = self._stop_token_ids()
        closing = self.encode(self.closing_text)
        # The token a model emits to end an answer turn: the template's closing if special, else EOS.
        self.end_of_turn_token = closing[0] if closing and closing[0] in self.stop_token_ids else self.stop_token_ids[0]
        # A turn ends at the end-of-turn token, which the model samples after a call too (the seed's); or, with
        # `stop_at_tool_call`, at </tool_call>, and the template's closing joins the observation (docs/layout.md,
        # "Departures from the seed").
        self.stop_at_tool_call = stop_at_tool_call
        self.stop_strings = ("</tool_call>",) if stop_at_tool_call else ()
        self.forbidden_strings = tuple(sorted(set(special_token_strings(tokenizer)) | set(PROTOCOL_TAGS)))

    # -- rendering -------------------------------------------------------------------------------
    def _render_raw(self, messages: list[dict], add_generation_prompt: bool, tools: list | None) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **{"tool_format": self.tool_format, **self.template_kwargs},
        )

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._render_raw(messages, add_generation_prompt, self.tools if self.template_handles_tools else None)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_rendered(self, text: str) -> list[int]:
        """encode() of a text the template renders again and again: an assistant's closing, the wrapper of an empty
        observation (tool_wrapper_tokens, before every turn that may call). Kept by text, a few thousand at most:
        the same text always gives the same tokens, and a long step renders them tens of thousands of times."""
        tokens = self._rendered_tokens.get(text)
        if tokens is None:
            tokens = self.encode(text)
            if len(self._rendered_tokens) < 4096:
                self._rendered_tokens[text] = tokens
        return list(tokens)

    def decode(self, tokens: Sequence[int]) -> str:
        # As an array: transformers then converts it at once rather than checking each id's type (a turn has thousands)
        return self.tokenizer.decode(numpy.asarray(tokens, numpy.int64), skip_special_tokens=True)

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def initial_messages(self, question: str) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]

    def build_prompt(self, messages: list[dict]) -> list[int]:
        """The first prompt P(1), rendered by the template with the generation prefix."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    @staticmethod
    def assistant_message(text: str) -> dict:
        return {"role": "assistant", "content": text}

    @staticmethod
    def tool_message(content: str, call_id: str) -> dict:
        return {"role": "tool", "content": content, "name": TOOL_NAME, "tool_call_id": call_id}

    # -- continuation ----------------------------------------------------------------------------
    def _after_placeholder(self, rendered: str, what: str) -> str:
        if rendered.count(_PLACEHOLDER) != 1:
            raise TemplateError(
                f"the chat template drops or rewrites assistant content when {what}, so the next prompt "
                "cannot extend the sampled tokens exactly; pass a chat_template that keeps assistant turns verbatim"
            )
        return rendered.split(_PLACEHOLDER, 1)[1]

    def _closing_text(self, messages: list[dict]) -> str:
        history = [*messages, self.assistant_message(_PLACEHOLDER)]
        return self._after_placeholder(self.render(history, add_generation_prompt=False), "it is the last message")

    def _stop_token_ids(self) -> tuple[int, ...]:
        closing = self.encode(self.closing_text)
        ids = {closing[0]} if closing and closing[0] in self.tokenizer.all_special_ids else set()
        eos = self.tokenizer.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return tuple(sorted(ids))

    def observation_delta(
        self, messages_before_assistant: list[dict], completion_tokens: list[int], tool_content: str, call_id: str
    ) -> list[int]:
        """D(i): the assistant closing the completion did not emit, the tool message, and the next
        generation prefix, rendered in the real conversation so far (templates may vary by context)."""
        history = [*messages_before_assistant, self.assistant_message(_PLACEHOLDER)]
        closing = self._after_placeholder(self.render(history, add_generation_prompt=False), "it is the last message")
        after = self._continuation(messages_before_assistant, tool_content, call_id)
        closing_ids = self.encode_rendered(closing)
        delta_ids = self.encode_rendered(after) if not tool_content else self.encode(after)
        if not after.startswith(closing) or delta_ids[: len(closing_ids)] != closing_ids:
            raise TemplateError(
                f"the chat template closes an assistant turn with {closing!r} when it is last, but not when a "
                "tool message follows it; the observation cannot be appended token-exactly"
            )
        emitted = next(
            k for k in range(len(closing_ids), -1, -1) if k == 0 or completion_tokens[-k:] == closing_ids[:k]
        )
        return delta_ids[emitted:]

    @staticmethod
    def build_next_prompt(
        prompt_tokens: Sequence[int], completion_tokens: Sequence[int], delta: list[int]
    ) -> list[int]:
        """P(i+1) = P(i) + C(i) + D(i) (`delta`: observation_delta's): history is never re-tokenized from text."""
        return [*prompt_tokens, *completion_tokens, *delta]

    def _continuation(self, messages_before_assistant: list[dict], tool_content: str, call_id: str) -> str:
        """The text the template renders after an assistant turn when a tool message follows it: its closing, the
        tool message, the next generation prefix."""
        history = [
            *messages_before_assistant,
            self.assistant_message(_PLACEHOLDER),
            self.tool_message(tool_content, call_id),
        ]
        return self._after_placeholder(self.render(history, add_generation_prompt=True), "a tool message follows it")

    def tool_wrapper_tokens(self, messages_before_assistant: list[dict]) -> int:
        """Tokens an observation costs besides its content (closing, wrapper, next prefix): observation_delta's
        length for an empty completion and observation, whose closing is all still to come. One render, before every
        turn that may call; observation_delta checks the closing against it for each observation appended."""
        return len(self.encode_rendered(self._continuation(messages_before_assistant, "", "code-0-0-0")))
