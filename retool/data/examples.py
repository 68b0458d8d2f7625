"""Math problems: one value type, readers for JSONL/Parquet, and the public layouts (DAPO, AIME)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from retool.files.atomic import write_text_atomically


@dataclass(frozen=True)
class MathExample:
    id: str  # stable identifier within its data set
    question: str  # the problem statement shown to the model
    answer: str  # reference answer, compared by the reward job
    data_source: str  # where the problem comes from (file stem or layout name)


class DataError(ValueError):
    """A data file or one of its rows is not usable; the message names both."""


# DAPO-Math-17k wraps every problem in an instruction to end with "Answer: $Answer".
_DAPO_PREFIX = re.compile(
    r"^\s*Solve the following math problem step by step\..*?where \$Answer is the answer to the problem\.\s*",
    re.DOTALL,
)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def strip_dapo_wrapper(content: str) -> str:
    return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", content, count=1), count=1).strip()


def _text(value: Any, field: str, where: str) -> str:
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: field {field!r} is missing or null")
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {field!r} is empty")
    return value


def example_from_row(row: dict[str, Any], where: str, data_source: str, fallback_id: str = "") -> MathExample:
    """Reads one row in any supported layout: native, DAPO-Math-17k or AIME. Field names match in any
    case (public files write `Problem`, `Answer`, `ID`); a row without an id gets `fallback_id`."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    row = {key.lower() if isinstance(key, str) else key: value for key, value in row.items()}
    if fallback_id and row.get("id") is None:
        row["id"] = fallback_id
    if "prompt" in row and "reward_model" in row:  # DAPO-Math-17k
        messages = row["prompt"]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise DataError(f"{where}: field 'prompt' must be a non-empty list of {{role, content}}")
        user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if not user:
            raise DataError(f"{where}: field 'prompt' has no user message")
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict):
            raise DataError(f"{where}: field 'reward_model' must be an object with 'ground_truth'")
        extra = row.get("extra_info") or {}
        index = extra.get("index") if isinstance(extra, dict) else None
        return MathExample(
            id=_text(index if index is not None else where.rsplit(" ", 1)[-1], "extra_info.index", where),
            question=strip_dapo_wrapper(_text(user[-1].get("content"), "prompt[].content", where)),
            answer=_text(reward_model.get("ground_truth"), "reward_model.ground_truth", where),
            data_source=str(row.get("data_source") or data_source),
        )
    if "problem" in row:  # AIME layout
        return MathExample(
            id=_text(row.get("id"), "id", where),
            question=_text(row.get("problem"), "problem", where),
            answer=_text(row.get("answer"), "answer", where),
            data_source=str(row.get("data_source") or data_source),
        )
    return MathExample(
        id=_text(row.get("id"), "id", where),
        question=_text(row.get("question"), "question", where),
        answer=_text(row.get("answer"), "answer", where),
        data_source=str(row.get("data_source") or data_source),
    )


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield line_number, json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path} line {line_number}: not valid JSON ({error.msg})") from None
    elif path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as error:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable Parquet file ({error})") from None
        for row_number, row in enumerate(table.to_pylist()):
            yield row_number, row
    else:
        raise DataError(f"{path}: unsupported data file type {path.suffix!r} (use .jsonl or .parquet)")


def read_examples(path: str | Path) -> list[MathExample]:
    """Reads a data set; a malformed row is an error naming the file and the row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file does not exist")
    unit = "line" if path.suffix == ".jsonl" else "row"
    examples = [
        example_from_row(row, f"{path} {unit} {number}", path.stem, f"{path.stem}-{number}")
        for number, row in _rows(path)
    ]
    if not examples:
        raise DataError(f"{path}: data file has no examples")
    return examples


@lru_cache(maxsize=16)  # asked by every task of a step's or an evaluation's graph: each file is read once
def cached_examples(path: str) -> tuple[MathExample, ...]:
    """`read_examples`, once per process and path."""
    return tuple(read_examples(path))


def write_examples(examples: Sequence[MathExample], path: str | Path) -> None:
    write_text_atomically(path, "".join(json.dumps(asdict(example), ensure_ascii=False) + "\n" for example in examples))


def shuffled(examples: Sequence[MathExample], seed: int) -> list[MathExample]:
    """A deterministic permutation: the same seed gives the same order on every machine."""
    order = list(examples)
    random.Random(seed).shuffle(order)
    return order


def take_batch(examples: Sequence[MathExample], step: int, batch_size: int) -> list[MathExample]:
    """Batch `step` of a cyclic walk through `examples` (wraps around the end of the data set)."""
    if not examples:
        raise DataError("cannot take a batch from an empty data set")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    start = step * batch_size
    return [examples[(start + offset) % len(examples)] for offset in range(batch_size)]
