"""The code_interpreter tool: its declaration, how a call is written in each tool format, how an
assistant turn is parsed into a call, an answer or an invalid turn, and tool output kept from faking
the protocol's tokens."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

TOOL_NAME = "code_interpreter"


CODE_INTERPRETER_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Runs Python 3 code and returns what it prints with print(); on an error, the error message. "
            "Each call starts in a fresh process: nothing carries over from earlier calls. sympy and numpy are "
            "available."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}


TOOL_FORMATS = ("xml", "hermes")


PROTOCOL_TAGS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)  # never let tool output fake them


# The seed's pattern: the code is everything from the first <parameter=code> to the last </parameter> before
# </function> (a second parameter is then part of the code, which fails to run, as in the seed).
_XML_CALL = re.compile(
    rf"^\s*<function={TOOL_NAME}>\s*<parameter=code>\s*(.*?)\s*</parameter>\s*</function>\s*$", re.DOTALL
)


@dataclass(frozen=True)
class ParsedAssistant:
    kind: str  # tool | answer | invalid
    code: str | None = None  # the code to run, for kind == "tool"
    error: str | None = None  # why the turn is invalid, for kind == "invalid"


def _parse_xml_call(body: str) -> tuple[str | None, str]:
    call = _XML_CALL.match(body)
    if not call:
        return None, f"tool call is not <function={TOOL_NAME}><parameter=code>...</parameter></function>"
    return call.group(1), ""


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
    """Classifies one assistant turn as the seed does: exactly one well-formed call with nothing after it is a tool
    call (its code stripped of surrounding whitespace, run as written); a turn without <tool_call> is an answer (a
    stray </tool_call> included); anything else is invalid."""
    opens, closes = text.count("<tool_call>"), text.count("</tool_call>")
    if opens == 0:
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
    if not code.strip():
        return ParsedAssistant("invalid", error="tool call has empty code")
    return ParsedAssistant("tool", code=code.strip())


def tool_call_text(code: str, tool_format: str, preamble: str = "") -> str:
    """An assistant turn that calls the tool, written as a model is taught to write it."""
    if tool_format == "xml":
        body = f"<function={TOOL_NAME}>\n<parameter=code>\n{code}\n</parameter>\n</function>"
    else:
        body = json.dumps({"name": TOOL_NAME, "arguments": {"code": code}})
    return f"{preamble}\n<tool_call>\n{body}\n</tool_call>" if preamble else f"<tool_call>\n{body}\n</tool_call>"


ZERO_WIDTH_SPACE = "\u200b"


def neutralise(text: str, forbidden: Sequence[str]) -> str:
    """Breaks every occurrence of a special token or protocol tag so it reads the same but cannot
    tokenize to the real token (a zero-width space after its first character)."""
    for token in sorted(forbidden, key=len, reverse=True):
        if len(token) > 1 and token in text:
            text = text.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
    return text
