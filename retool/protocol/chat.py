"""The tool protocol: prompts rendered with the model's chat template, tool-call parsing, and the
token-exact continuation after a tool observation."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TOOL_NAME = "code_interpreter"
CODE_INTERPRETER_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Runs Python 3 code in a fresh process and returns what it prints (stdout, then stderr). "
            "The value of a trailing expression is printed. sympy and numpy are available."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}
TEXT_ONLY_SYSTEM_PROMPT = "Solve the math problem step by step. Put the final answer in \\boxed{}."
SYSTEM_PROMPT = (
    "Solve the math problem step by step. You can call the code_interpreter tool to run Python "
    "for calculations and checks; its output comes back to you. Put the final answer in \\boxed{}."
)
TOOL_FORMATS = ("xml", "hermes")
PROTOCOL_TAGS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)  # never let tool output fake them
BUNDLED_TEMPLATE = Path(__file__).with_name("templates") / "chatml_tools.jinja"
_PLACEHOLDER = "\u2063RETOOL-ASSISTANT-PLACEHOLDER\u2063"  # never produced by a model
_XML_CALL = re.compile(r"^\s*<function=([^>\n]+)>\s*(.*?)\s*</function>\s*$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_CODE_FENCE = re.compile(r"^\s*```(?:python|py)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


class TemplateError(ValueError):
    """The chat template cannot give a token-exact continuation."""


@dataclass(frozen=True)
class ParsedAssistant:
    kind: str  # tool | answer | invalid
    code: str | None = None  # the code to run, for kind == "tool"
    error: str | None = None  # why the turn is invalid, for kind == "invalid"


def _strip_fence(code: str) -> str:
    fenced = _CODE_FENCE.match(code)
    return fenced.group(1) if fenced else code


def _parse_xml_call(body: str) -> tuple[str | None, str]:
    call = _XML_CALL.match(body)
    if not call:
        return None, "tool call is not <function=NAME>...</function>"
    if call.group(1).strip() != TOOL_NAME:
        return None, f"unknown function {call.group(1).strip()!r}"
    parameters = _XML_PARAMETER.findall(call.group(2))
    if [name.strip() for name, _ in parameters] != ["code"]:
        return None, "tool call needs exactly one <parameter=code>"
    return parameters[0][1], ""


def _parse_hermes_call(body: str) -> tuple[str | None, str]:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return None, f"tool call is not valid JSON ({error.msg})"
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        return None, f"unknown function {call.get('name') if isinstance(call, dict) else call!r}"
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, "tool call arguments are not valid JSON"
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return None, "tool call arguments need a string 'code'"
    return arguments["code"], ""


def parse_assistant(text: str, tool_format: str = "auto") -> ParsedAssistant:
    """Classifies one assistant turn: exactly one well-formed call with nothing after it is a tool
    call; no call at all is an answer; anything else is invalid."""
    opens, closes = text.count("<tool_call>"), text.count("</tool_call>")
    if opens == 0 and closes == 0:
        return ParsedAssistant("answer")
    if opens != 1 or closes > 1:
        return ParsedAssistant("invalid", error="exactly one tool call per turn is allowed")
    if closes == 0:
        return ParsedAssistant("invalid", error="tool call is not closed with </tool_call>")
    head, _, tail = text.partition("<tool_call>")
    body, _, after = tail.partition("</tool_call>")
    if "</tool_call>" in head:
        return ParsedAssistant("invalid", error="</tool_call> before <tool_call>")
    if after.strip():
        return ParsedAssistant("invalid", error="text after the tool call")
    fmt = tool_format if tool_format != "auto" else ("xml" if body.lstrip().startswith("<function=") else "hermes")
    code, error = _parse_xml_call(body) if fmt == "xml" else _parse_hermes_call(body)
    if code is None:
        return ParsedAssistant("invalid", error=error)
    code = _strip_fence(code)
    if not code.strip():
        return ParsedAssistant("invalid", error="tool call has empty code")
    return ParsedAssistant("tool", code=code)


def tool_call_text(code: str, tool_format: str, preamble: str = "") -> str:
    """An assistant turn that calls the tool, written as a model is taught to write it."""
    if tool_format == "xml":
        body = f"<function={TOOL_NAME}>\n<parameter=code>\n{code}\n</parameter>\n</function>"
    else:
        body = json.dumps({"name": TOOL_NAME, "arguments": {"code": code}})
    return f"{preamble}\n<tool_call>\n{body}\n</tool_call>" if preamble else f"<tool_call>\n{body}\n</tool_call>"


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


ZERO_WIDTH_SPACE = "\u200b"


def neutralise(text: str, forbidden: Sequence[str]) -> str:
    """Breaks every occurrence of a special token or protocol tag so it reads the same but cannot
    tokenize to the real token (a zero-width space after its first character)."""
    for token in sorted(forbidden, key=len, reverse=True):
        if len(token) > 1 and token in text:
            text = text.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
    return text


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
    ):
        self.tokenizer = tokenizer
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
        self.stop_strings = ("</tool_call>",)  # a call is complete here; nothing may follow it
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

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

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
        after = self._after_placeholder(
            self.render([*history, self.tool_message(tool_content, call_id)], add_generation_prompt=True),
            "a tool message follows it",
        )
        closing_ids, delta_ids = self.encode(closing), self.encode(after)
        if not after.startswith(closing) or delta_ids[: len(closing_ids)] != closing_ids:
            raise TemplateError(
                f"the chat template closes an assistant turn with {closing!r} when it is last, but not when a "
                "tool message follows it; the observation cannot be appended token-exactly"
            )
        emitted = next(
            k for k in range(len(closing_ids), -1, -1) if k == 0 or completion_tokens[-k:] == closing_ids[:k]
        )
        return delta_ids[emitted:]

    def build_next_prompt(
        self,
        prompt_tokens: list[int],
        completion_tokens: list[int],
        messages_before_assistant: list[dict],
        tool_content: str,
        call_id: str,
    ) -> list[int]:
        """P(i+1) = P(i) + C(i) + D(i): history is never re-tokenized from text."""
        return [
            *prompt_tokens,
            *completion_tokens,
            *self.observation_delta(messages_before_assistant, completion_tokens, tool_content, call_id),
        ]

    def tool_wrapper_tokens(self, messages_before_assistant: list[dict]) -> int:
        """Tokens an observation costs besides its content (closing, wrapper, next prefix)."""
        return len(self.observation_delta(messages_before_assistant, [], "", "code-0-0-0"))
