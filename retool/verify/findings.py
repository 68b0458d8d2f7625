"""What a check of a run folder found: each rule's tally (what it checked, how many rows broke it) and the rows that
broke it, each named by its file, question, branch, round and token position."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy
import pyarrow as pa

# The rules, in the order a step's files are made; each line of the report is one of them.
RULES = {
    "accounting": "every (question, branch) once in each stage's file; a step's files the join of its shards'",
    "continuation": "each round's prompt = the one before + its completion + the observation, as the template renders",
    "stops_and_budgets": "turns, code calls and tokens within the settings; each stop reason the one its tokens give",
    "observation": "what the model read = the recorded tool output, cut as the settings cut it",
    "reward": "rewards re-scored from the final text; shaped rewards, group-centred advantages, kept and masked",
    "datums": "input and target shifted by one; loss mask on sampled tokens; the samples' logprobs; the advantage",
    "checkpoints": "each step's checkpoint present and marked, its metrics the datums', its sampler gap in bounds",
}
KEPT_PER_RULE = 1000  # rows broken by one rule kept in verify.parquet: enough to see a pattern, bounded in memory

FINDINGS = pa.schema(
    [
        ("rule", pa.string()),
        ("file", pa.string()),
        ("step", pa.int32()),
        ("question_index", pa.int32()),
        ("group_index", pa.int32()),
        ("round", pa.int32()),
        ("position", pa.int64()),
        ("column", pa.string()),
        ("message", pa.string()),
    ]
)


@dataclass(frozen=True)
class Finding:
    """One row that breaks a rule; what is not known of its place is None."""

    rule: str
    file: str
    message: str
    step: int | None = None
    question_index: int | None = None
    group_index: int | None = None
    round: int | None = None
    position: int | None = None  # the first token (or list item) that differs
    column: str | None = None

    def where(self) -> str:
        places = (
            ("step", self.step),
            ("question", self.question_index),
            ("branch", self.group_index),
            ("round", self.round),
            ("column", self.column),
            ("token", self.position),
        )
        return ", ".join(f"{name} {value}" for name, value in places if value is not None)


@dataclass
class Tally:
    """One rule over the run: rows and tokens checked, the rows that broke it (the first KEPT_PER_RULE of them)."""

    rows: int = 0
    tokens: int = 0
    broken: int = 0
    findings: list[Finding] = field(default_factory=list)


class Report:
    """Every rule's tally, filled as the checks go."""

    def __init__(self) -> None:
        self.tallies = {rule: Tally() for rule in RULES}

    def checked(self, rule: str, rows: int, tokens: int = 0) -> None:
        self.tallies[rule].rows += rows
        self.tallies[rule].tokens += tokens

    def add(self, finding: Finding) -> None:
        tally = self.tallies[finding.rule]
        tally.broken += 1
        if len(tally.findings) < KEPT_PER_RULE:
            tally.findings.append(finding)

    @property
    def holds(self) -> bool:
        return not any(tally.broken for tally in self.tallies.values())

    def lines(self) -> list[str]:
        """One line per rule: what it checked, and the first row that broke it."""
        lines = []
        for rule, tally in self.tallies.items():
            checked = f"{tally.rows} rows" + (f", {tally.tokens} tokens" if tally.tokens else "")
            if not tally.broken:
                lines.append(f"ok      {rule}: {checked}")
                continue
            first = tally.findings[0]
            lines.append(
                f"BROKEN  {rule}: {tally.broken} of {checked}; first: {first.file} ({first.where()}): {first.message}"
            )
        return lines

    def table(self) -> pa.Table:
        rows = [asdict(finding) for tally in self.tallies.values() for finding in tally.findings]
        return pa.Table.from_pylist(rows, schema=FINDINGS)


def first_difference(expected, found) -> int | None:
    """The first position where two token lists (or arrays) differ, their shorter length if one is a prefix of the
    other; None when they are equal."""
    a, b = numpy.asarray(expected), numpy.asarray(found)
    length = min(len(a), len(b))
    unequal = numpy.flatnonzero(a[:length] != b[:length])
    if len(unequal):
        return int(unequal[0])
    return None if len(a) == len(b) else length


def compare_rows(
    rule_of: dict[str, str | Callable[[tuple[int, int], int | None], str]],
    expected: Sequence[dict],
    found: Sequence[dict],
    file: Path,
    report: Report,
    step: int,
) -> None:
    """Row by row and column by column, the rows a stage would write from its inputs against those its file holds;
    rows are keyed by (question, branch). `rule_of`: the rule each compared column answers to, or a function of the
    branch and the first position that differs that says which."""
    key = ("question_index", "group_index")
    found_by_key = {tuple(row[k] for k in key): row for row in found}
    for row in expected:
        branch = tuple(row[k] for k in key)
        recorded = found_by_key.get(branch)
        if recorded is None:
            continue  # accounting names rows missing from a file
        for column, rule in rule_of.items():
            want, have = row[column], recorded[column]
            if isinstance(want, list | tuple | numpy.ndarray) and have is not None and want is not None:
                position = first_difference(want, have)
                if position is None:
                    continue
                message = f"{column} differs from what its inputs give at item {position}"
            elif want == have or (_is_nan(want) and _is_nan(have)):
                continue
            else:
                position, message = None, f"{column} is {have!r}, its inputs give {want!r}"
            named = rule if isinstance(rule, str) else rule(branch, position)
            report.add(Finding(named, str(file), message, step, *branch, row.get("round"), position, column))


def _is_nan(value) -> bool:
    return isinstance(value, float) and value != value
