"""What a check of a run folder found: each rule's tally (what it checked, how many rows broke it) and the rows that
broke it, each named by its file, question, branch, round and token position."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy
import pyarrow as pa

from retool.files.tables import row_views

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


def branches(table: pa.Table) -> list[tuple[int, int]]:
    """Each row's (question_index, group_index)."""
    return list(zip(table.column("question_index").to_pylist(), table.column("group_index").to_pylist(), strict=True))


def compare_tables(
    rule_of: dict[str, str | Callable[[tuple[int, int], int | None], str]],
    expected: pa.Table,
    found: pa.Table,
    file: Path,
    report: Report,
    step: int,
) -> None:
    """Column by column, the rows a stage would write from its inputs against those its file holds, matched by
    (question, branch) (rows in one only are accounting's to name). Token columns are compared as numpy views of
    the files' buffers, never as Python values (a step holds tens of millions of tokens). `rule_of`: the rule each
    compared column answers to, or a function of the branch and the first position that differs that says which."""
    expected, found = _matched(expected, found)
    keys = branches(expected)
    rounds = expected.column("round").to_pylist() if "round" in expected.column_names else [None] * len(keys)
    for column, rule in rule_of.items():
        for row, position, message in _differences(column, expected.column(column), found.column(column)):
            branch = keys[row]
            named = rule if isinstance(rule, str) else rule(branch, position)
            report.add(Finding(named, str(file), message, step, *branch, rounds[row], position, column))


def _matched(expected: pa.Table, found: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Both tables' rows of the (question, branch) pairs they share, in one order."""
    keys = [branches(expected), branches(found)]
    if keys[0] == keys[1]:
        return expected, found
    where = {branch: index for index, branch in enumerate(keys[1])}
    shared = [(index, where[branch]) for index, branch in enumerate(keys[0]) if branch in where]
    return expected.take([a for a, _ in shared]), found.take([b for _, b in shared])


def _differences(column: str, expected: pa.ChunkedArray, found: pa.ChunkedArray):
    """(row, first differing item or None, message) of each row where the two columns differ."""
    if pa.types.is_list(expected.type) and not expected.null_count and not found.null_count:
        for row, (want, have) in enumerate(zip(row_views(expected), row_views(found), strict=True)):
            if (position := first_difference(want, have)) is not None:
                yield row, position, f"{column} differs from what its inputs give at item {position}"
        return
    for row, (want, have) in enumerate(zip(expected.to_pylist(), found.to_pylist(), strict=True)):
        if want == have or (_is_nan(want) and _is_nan(have)):
            continue
        if isinstance(want, list) and isinstance(have, list):
            position = first_difference(want, have)
            yield row, position, f"{column} differs from what its inputs give at item {position}"
        else:
            yield row, None, f"{column} is {have!r}, its inputs give {want!r}"


def _is_nan(value) -> bool:
    return isinstance(value, float) and value != value
