"""`python -m retool convert IN OUT`: cold-start conversations in either public layout (the tagged ReTool one, or
chat messages with tool calls), JSONL or Parquet, written as JSONL in the project's layout: what the cold
start will train on, to read before it does."""

from __future__ import annotations

import argparse
from pathlib import Path

from retool.data.conversations import read_conversations, write_conversations
from retool.data.examples import DataError


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m retool convert", description=__doc__)
    parser.add_argument("source", type=Path, help="conversations: .jsonl or .parquet, in either layout")
    parser.add_argument("out", type=Path, help="JSONL file to write, in the project's layout")
    args = parser.parse_args()
    try:
        conversations = read_conversations(args.source)
    except DataError as error:
        parser.exit(2, f"{error}\n")  # nothing is written
    write_conversations(conversations, args.out)
    calls = sum(turn.code is not None for conversation in conversations for turn in conversation.turns)
    print(f"{len(conversations)} conversations, {calls} code calls -> {args.out}")


if __name__ == "__main__":
    main()
