"""Cold-start data as it is published: the tagged ReTool layout and chat messages with tool calls (arguments a
string or an object), in JSONL and in Parquet, all read to the same conversations; tool output left in an
assistant's text is refused; `python -m retool convert` writes the project's layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retool.data.conversations import read_conversations
from retool.data.examples import DataError

QUESTION = "What is the sum of the squares of 1, 2 and 3?"
INSTRUCTION = "Solve the problem with the code interpreter; put the answer in \\boxed{}.\n\n*user question:*\n"
FIRST, OUTPUT_1 = "squares = [n * n for n in (1, 2, 3)]\nprint(squares)", "[1, 4, 9]"
SECOND, OUTPUT_2 = "print(sum([1, 4, 9]))", "14"


def tagged_row() -> dict:
    content = (
        "I list the squares first.\n<code>\n```python\n"
        + FIRST
        + "\n```\n</code>\n<interpreter>\n"
        + OUTPUT_1
        + "\n</interpreter>\nNow their sum.\n<code>\n```python\n"
        + SECOND
        + "\n```\n</code>\n<interpreter>\n"
        + OUTPUT_2
        + "\n</interpreter>\nThe squares add up to 14.\n<answer>\nSo the answer is \\boxed{14}.\n</answer>"
    )
    return {
        "messages": [{"role": "user", "content": INSTRUCTION + QUESTION}, {"role": "assistant", "content": content}]
    }


def tool_calls_row(arguments_as_object: bool) -> dict:
    def call(code: str) -> dict:
        arguments = {"code": code} if arguments_as_object else json.dumps({"code": code})
        return {"type": "function", "function": {"name": "code_interpreter", "arguments": arguments}}

    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "I list the squares first.", "tool_calls": [call(FIRST)]},
            {"role": "tool", "content": OUTPUT_1},
            {"role": "assistant", "content": "Now their sum.", "tool_calls": [call(SECOND)]},
            {"role": "tool", "content": OUTPUT_2},
            {"role": "assistant", "content": "The squares add up to 14.\nSo the answer is \\boxed{14}."},
        ]
    }


def write(rows: list[dict], path: Path) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def essence(path: Path) -> list[tuple]:
    return [
        (c.question, c.answer, [(t.text, t.code, t.output, t.trained) for t in c.turns])
        for c in read_conversations(path)
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_every_public_layout_reads_to_the_same_conversation(tmp_path, suffix):
    layouts = {
        "tagged": tagged_row(),
        "string arguments": tool_calls_row(False),
        "object arguments": tool_calls_row(True),
    }
    read = {
        name: essence(write([row], tmp_path / f"{name.replace(' ', '-')}{suffix}")) for name, row in layouts.items()
    }
    expected = [
        (
            QUESTION,
            "14",
            [
                ("I list the squares first.", FIRST, OUTPUT_1, True),
                ("Now their sum.", SECOND, OUTPUT_2, True),
                ("The squares add up to 14.\nSo the answer is \\boxed{14}.", None, None, True),
            ],
        )
    ]
    assert read == {name: expected for name in layouts}


@pytest.mark.parametrize(
    "broken, tag",
    [
        ("First.\n<code>\nprint(1)\n</code>\nThe answer is \\boxed{1}.", "<code>"),  # a call without its output
        ("It printed\n<interpreter>\n1\n</interpreter>\nso \\boxed{1}.", "<interpreter>"),  # an output without a call
        ("<code>\nprint(1)\n</code>\n<interpreter>\n1\nSo \\boxed{1}.", "<code>"),  # an unclosed output
    ],
)
def test_tool_output_left_in_an_assistant_turn_is_refused_naming_the_row_and_the_tag(tmp_path, broken, tag):
    row = {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": broken}]}
    for path in (
        write([tagged_row(), row], tmp_path / "mixed.jsonl"),
        write([tagged_row(), row], tmp_path / "mixed.parquet"),
    ):
        unit = "row" if path.suffix == ".parquet" else "line"
        with pytest.raises(DataError, match=rf"{path} {unit} 2: assistant turn \d still holds '{tag}'"):
            read_conversations(path)


def test_a_tool_calls_message_holding_tagged_output_too_is_refused(tmp_path):
    row = tool_calls_row(False)
    row["messages"][2]["content"] += "\n<interpreter>\n[1, 4, 9]\n</interpreter>"
    with pytest.raises(DataError, match=r"line 1: assistant turn 1 still holds '<interpreter>'"):
        read_conversations(write([row], tmp_path / "both.jsonl"))


def test_convert_writes_the_project_layout_that_reads_back_the_same(tmp_path):
    source = write([tagged_row(), tool_calls_row(True)], tmp_path / "public.parquet")
    out = tmp_path / "converted.jsonl"
    shown = subprocess.run(
        [sys.executable, "-m", "retool", "convert", str(source), str(out)], capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == f"2 conversations, 4 code calls -> {out}"
    assert essence(out) == essence(source)
    assert all(
        m.get("tool_calls") or m["role"] != "assistant" or "<code>" not in m["content"]
        for line in out.read_text().splitlines()
        for m in json.loads(line)["messages"]
    )
    refused = subprocess.run(
        [sys.executable, "-m", "retool", "convert", str(tmp_path / "missing.jsonl"), str(tmp_path / "no.jsonl")],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "cold-start data file does not exist" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "no.jsonl").exists()
