"""Worked solutions for the cold start, read from JSONL or Parquet in either public layout and written back in
the project's:

- chat messages with tool calls (the project's layout, and the one verl's converter writes): the user's
  question, assistant messages whose `tool_calls` run `code_interpreter` (arguments a JSON string or an
  object), the `tool` messages with the output, a final answer with `\\boxed{}`;
- the tagged ReTool layout: one assistant message holding the code in `<code>```python ...```</code>`, each
  output in `<interpreter>...</interpreter>` and the answer in `<answer>...</answer>`, after a user message
  whose instruction ends in `*user question:*` before the problem.

Text the model would be trained to write must never hold a tool's output: a tag left in an assistant turn
after reading (unclosed, stray, or in the other layout's message) is an error naming the file, row and tag."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.data.examples import DataError
from retool.data.reward import last_boxed
from retool.files.atomic import write_text_atomically
from retool.protocol.tool_calls import TOOL_NAME

QUESTION_MARKER = "*user question:*"  # the tagged layout's instruction ends here; the problem follows
TAGGED_CALL = re.compile(r"<code>(.*?)</code>\s*<interpreter>(.*?)</interpreter>", re.DOTALL)
TAGGED_ANSWER = re.compile(r"(.*?)<answer>(.*?)</answer>\s*", re.DOTALL)
FENCED = re.compile(r"^\s*```(?:python|py)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)
TOOL_OUTPUT_TAGS = ("<code>", "</code>", "<interpreter>", "</interpreter>", "<tool_response>", "</tool_response>")


@dataclass(frozen=True)
class SolutionTurn:
    text: str  # what the assistant writes before its call, or its whole final answer
    code: str | None = None  # the code its tool call runs; None for the final answer
    output: str | None = None  # the tool message that answered the call
    trained: bool = True  # false ("weight": 0 on the message): context only, e.g. a mistake that is then corrected


@dataclass(frozen=True)
class Conversation:
    id: str  # from the file, or "<file stem>-<line>"
    line: int  # line of the file it came from
    question: str  # the user message
    answer: str  # reference answer: the row's "answer", else the final \boxed{}
    turns: tuple[SolutionTurn, ...]  # assistant turns; the last one answers
    data_source: str = "cold-start"  # the row's "data_source" (a synthetic problem's family), if it has one


def _call_code(call: Any, where: str) -> str:
    """The code of one tool call, in the OpenAI layout (arguments as a JSON string) or the Hugging
    Face layout (arguments as an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise DataError(f"{where}: a tool call needs a 'function' object")
    if function.get("name") != TOOL_NAME:
        raise DataError(f"{where}: unknown tool {function.get('name')!r} (only {TOOL_NAME!r} exists)")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: tool call arguments are not valid JSON ({error.msg})") from None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str) or not arguments["code"].strip():
        raise DataError(f"{where}: tool call arguments need a non-empty string 'code'")
    return arguments["code"]


def _trained(message: dict, where: str) -> bool:
    """An assistant message's optional "weight" (as in OpenAI's fine-tuning layout): 1 trains on it, 0 keeps it
    as context only."""
    weight = message.get("weight")
    weight = 1 if weight is None else weight  # absent, or null in a Parquet struct
    if weight not in (0, 1) or isinstance(weight, bool):
        raise DataError(f"{where}: field 'weight' must be 0 or 1, got {weight!r}")
    return weight == 1


def _content(message: dict, where: str, allow_empty: bool = False) -> str:
    content = message.get("content")
    if content is None and allow_empty:
        return ""
    if not isinstance(content, str) or (not allow_empty and not content.strip()):
        raise DataError(f"{where}: field 'content' is missing or empty")
    return content


def tagged_turns(content: str, trained: bool) -> list[SolutionTurn]:
    """The turns of one assistant message in the tagged layout: the text before each <code>, its code (fence
    unwrapped) and the <interpreter> output that follows; then the final text with its <answer> unwrapped."""
    turns, position = [], 0
    for call in TAGGED_CALL.finditer(content):
        fenced = FENCED.match(call.group(1))
        code = (fenced.group(1) if fenced else call.group(1)).strip("\n")
        turns.append(SolutionTurn(content[position : call.start()].strip(), code, call.group(2).strip("\n"), trained))
        position = call.end()
    final = content[position:]
    answer = TAGGED_ANSWER.fullmatch(final)
    text = "\n".join(part.strip() for part in answer.groups() if part.strip()) if answer else final.strip()
    turns.append(SolutionTurn(text, trained=trained))
    return turns


def _refuse_tool_output(turns: list[SolutionTurn], where: str) -> None:
    """The model is trained on every turn's text: a tool's output there (a tag left after reading) would teach
    it to write the output itself."""
    for number, turn in enumerate(turns, start=1):
        for tag in TOOL_OUTPUT_TAGS:
            if tag in turn.text:
                raise DataError(
                    f"{where}: assistant turn {number} still holds {tag!r} after reading (an unclosed or stray tag, "
                    "or two layouts in one message): the model would be trained to write a tool's output"
                )


def _problem(question: str) -> str:
    """The problem of a tagged layout's user message, without the instruction before it."""
    at = question.lower().rfind(QUESTION_MARKER)
    return question[at + len(QUESTION_MARKER) :].strip() if at >= 0 else question


def conversation_from_row(row: Any, line: int, where: str, default_id: str) -> Conversation:
    """One conversation: an optional system message (the run's protocol supplies its own), the
    question, then assistant turns, each call answered by a tool message, ending on an answer."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise DataError(f"{where}: expected an object with a 'messages' list")
    messages = [m for m in row["messages"] if not (isinstance(m, dict) and m.get("role") == "system")]
    if not messages or not isinstance(messages[0], dict) or messages[0].get("role") != "user":
        raise DataError(f"{where}: the first message after the system prompt must be the user's question")
    question = _problem(_content(messages[0], f"{where} message 1"))
    turns: list[SolutionTurn] = []
    position = 1
    while position < len(messages):
        message, at = messages[position], f"{where} message {position + 1}"
        if not isinstance(message, dict) or message.get("role") not in ("assistant", "tool"):
            raise DataError(f"{at}: expected an assistant or tool message, got {message!r:.80}")
        if message["role"] == "tool":
            raise DataError(f"{at}: a tool message without a tool call before it")
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list) or len(calls) > 1:
            raise DataError(
                f"{at}: an assistant message may make one tool call, got "
                f"{len(calls) if isinstance(calls, list) else calls!r}"
            )
        if not calls:
            content = _content(message, at)
            tagged = "<code>" in content or "<interpreter>" in content
            turns += (
                tagged_turns(content, _trained(message, at))
                if tagged
                else [SolutionTurn(content, trained=_trained(message, at))]
            )
            position += 1
            continue
        code = _call_code(calls[0], at)
        reply = messages[position + 1] if position + 1 < len(messages) else None
        if not isinstance(reply, dict) or reply.get("role") != "tool":
            raise DataError(f"{at}: its tool call is not answered by a tool message")
        turns.append(
            SolutionTurn(
                _content(message, at, allow_empty=True),
                code,
                _content(reply, f"{where} message {position + 2}", allow_empty=True),
                _trained(message, at),
            )
        )
        position += 2
    _refuse_tool_output(turns, where)
    if not turns or turns[-1].code is not None:
        raise DataError(f"{where}: the conversation must end with an assistant answer")
    answer = row.get("answer")
    answer = (
        str(answer)
        if isinstance(answer, (str, int, float)) and not isinstance(answer, bool)
        else last_boxed(turns[-1].text)
    )
    if not answer:
        raise DataError(f"{where}: no 'answer' field and no \\boxed{{}} in the final answer")
    source = row.get("data_source")
    source = source if isinstance(source, str) and source else "cold-start"
    return Conversation(str(row.get("id") or default_id), line, question, answer, tuple(turns), source)


def read_conversations(path: str | Path) -> list[Conversation]:
    """All conversations of a JSONL or Parquet file, in either layout; any malformed one is an error naming the
    file and its line (row, in Parquet)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: cold-start data file does not exist")
    conversations = [
        conversation_from_row(row, line, f"{path} {unit} {line}", f"{path.stem}-{line}")
        for unit, line, row in _rows(path)
    ]
    if not conversations:
        raise DataError(f"{path}: cold-start data file has no conversations")
    return conversations


def _rows(path: Path):
    """(line or row, its number from 1, the row as Python objects) of a JSONL or Parquet file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as error:  # not a Parquet file, or a truncated one
            raise DataError(f"{path}: not a readable Parquet file ({error})") from None
        yield from (("row", number, row) for number, row in enumerate(table.to_pylist(), start=1))
        return
    with path.open(encoding="utf-8") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                yield "line", line, json.loads(text)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {line}: not valid JSON ({error.msg})") from None


def write_conversations(conversations: list[Conversation], path: str | Path) -> None:
    """The conversations as JSONL in the project's layout, published in one rename."""
    text = "".join(json.dumps(conversation_row(c), ensure_ascii=False) + "\n" for c in conversations)
    write_text_atomically(Path(path), text)


def conversation_row(conversation: Conversation) -> dict:
    """The JSONL row of a conversation (the inverse of conversation_from_row)."""
    messages: list[dict] = [{"role": "user", "content": conversation.question}]
    for number, turn in enumerate(conversation.turns, start=1):
        weight = {} if turn.trained else {"weight": 0}
        if turn.code is None:
            messages.append({"role": "assistant", "content": turn.text, **weight})
            continue
        call = {
            "id": f"call_{number}",
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"code": turn.code})},
        }
        messages.append({"role": "assistant", "content": turn.text, "tool_calls": [call], **weight})
        messages.append({"role": "tool", "tool_call_id": f"call_{number}", "content": turn.output})
    return {
        "id": conversation.id,
        "answer": conversation.answer,
        "data_source": conversation.data_source,
        "messages": messages,
    }
