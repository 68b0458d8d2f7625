"""Each row mapping (retool/rollout/rows.py; datums.py's columns for datums) writes exactly its file's columns, and
what it writes reads back."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq

from retool.data.examples import MathExample
from retool.data.frontier import Draw
from retool.files.tables import (
    DATUMS,
    OBSERVATIONS,
    PROMPTS,
    SAMPLES,
    TRAJECTORIES,
    read_table,
    table_from_rows,
    write_tables_atomically,
)
from retool.rollout import datums as datums_module
from retool.rollout.datums import LIST_COLUMNS, Datum, datums_from_table, datums_to_table, datums_to_tables, step_datums
from retool.rollout.rows import (
    example_of,
    observation_row,
    prompt_row,
    restore_observation,
    sample_row,
    sequence_of,
    trajectory_row,
    turn_of,
)
from retool.rollout.state import AssistantTurn, ToolCall, Trajectory
from retool.sampling.contract import SampledSequence, SampleRequest

EXAMPLE = MathExample("q-1", "What is 6 * 7?", "42", "arithmetic")


def ended_trajectory() -> Trajectory:
    turn = AssistantTurn([1, 2], [3, 4], [-0.5, -0.25], "print(6 * 7)", "stop", 11, "tool")
    turn.tool_call = ToolCall("code-0-1-1", "print(6 * 7)", "ok", 0.01, "42")
    answer = AssistantTurn([1, 2, 3, 4, 5], [6, 7], [-0.1, -0.2], r"\boxed{42}", "stop", 12, "answer")
    trajectory = Trajectory(EXAMPLE, 0, 1, [], turns=[turn, answer], code_calls=1)
    trajectory.end("answer", r"\boxed{42}")
    trajectory.reward, trajectory.correct, trajectory.valid_format, trajectory.advantage = 1.0, True, True, 0.5
    return trajectory


def test_every_row_has_exactly_its_files_columns(hermes):
    request = SampleRequest(0, (0, 1), (1, 2), 8, seed=11)
    sequence = SampledSequence((3, 4), (-0.5, -0.25), "stop")
    trajectory = ended_trajectory()
    rows = {
        PROMPTS: prompt_row(0, 0, Draw(EXAMPLE, 0.25, 0.68, "question 1/4 right"), [1, 2]),
        SAMPLES: sample_row(0, 0, request, 1, sequence, "print(6 * 7)", -1),
        OBSERVATIONS: observation_row(trajectory, 0, 1),
        TRAJECTORIES: trajectory_row(trajectory, 0, -1),
    }
    for schema, row in rows.items():
        assert list(row) == schema.names
        table_from_rows([row], schema)  # every value of its column's type


def test_what_is_written_reads_back(hermes):
    request = SampleRequest(0, (0, 1), (1, 2), 8, seed=11)
    sequence = SampledSequence((3, 4), (-0.5, -0.25), "stop")
    row = sample_row(0, 0, request, 1, sequence, "print(6 * 7)", -1)
    assert sequence_of(row) == sequence
    assert turn_of(row) == AssistantTurn([1, 2], [3, 4], [-0.5, -0.25], "print(6 * 7)", "stop", 11)
    assert example_of(prompt_row(0, 0, Draw(EXAMPLE, None, None, "the shuffled walk"), [1])) == EXAMPLE
    datum = Datum(0, 1, [1, 2, 3], [2, 3, 4], [0.0, -0.5, -0.25], [0.0, 0.5, 0.5], [False, True, True])
    table = datums_to_table([datum], 0, -1)  # datums are written column by column
    assert table.schema == DATUMS and table.column("num_tokens").to_pylist() == [3]
    (read,) = datums_from_table(table)
    assert (read.question_index, read.group_index) == (0, 1)
    assert [list(getattr(read, name)) for name in LIST_COLUMNS] == [getattr(datum, name) for name in LIST_COLUMNS]
    ended = ended_trajectory()
    restored = Trajectory(EXAMPLE, 0, 1, [], turns=[AssistantTurn([1, 2], [3, 4], [-0.5], "x", "stop", 11)])
    restore_observation(restored, observation_row(ended, 0, 1), hermes)
    assert (restored.done, restored.stop_reason, restored.final_text, restored.code_calls) == (
        True,
        "answer",
        r"\boxed{42}",
        1,
    )


def test_a_steps_datums_are_its_shards_merged_in_question_and_branch_order():
    """What the update reads (every shard's datums, question q in shard q % shards) is the step's datums.parquet."""
    datums = [Datum(q, g, [q, g], [g, q], [0.0, -0.5], [0.0, 1.0], [False, True]) for q in range(5) for g in (0, 2)]
    shards = [datums_to_table([d for d in datums if d.question_index % 3 == shard], 0, -1) for shard in range(3)]
    merged = step_datums(shards)
    assert [(d.question_index, d.group_index) for d in merged] == [(d.question_index, d.group_index) for d in datums]
    assert datums_to_table(merged, 0, -1).equals(datums_to_table(datums, 0, -1))


def test_datums_written_in_parts_are_the_same_table_in_row_groups(tmp_path, monkeypatch):
    """A step's datums are built and written a part of at most PART_TOKENS tokens at a time (one longer datum is a
    part alone); the file reads back as the whole table, and its datums as the same arrays."""
    monkeypatch.setattr(datums_module, "PART_TOKENS", 5)
    datums = [Datum(q, 0, [q] * n, [q] * n, [0.0] * n, [1.0] * n, [True] * n) for q, n in enumerate((2, 3, 1, 7, 4))]
    parts = list(datums_to_tables(datums, 3, 2))
    assert [part.column("num_tokens").to_pylist() for part in parts] == [[2, 3], [1], [7], [4]]
    written = write_tables_atomically(iter(parts), DATUMS, tmp_path / "datums.parquet")
    assert pq.ParquetFile(tmp_path / "datums.parquet").metadata.num_row_groups == 4
    whole = datums_to_table(datums, 3, 2)
    assert written.equals(whole) and read_table(tmp_path / "datums.parquet", DATUMS).equals(whole)
    read = datums_from_table(read_table(tmp_path / "datums.parquet", DATUMS))  # a chunk per row group
    assert [list(d.input_tokens) for d in read] == [d.input_tokens for d in datums]
    assert list(datums_to_tables([], 3, 2))[0].equals(datums_to_table([], 3, 2))  # no datums: one empty part


def test_a_process_that_touches_the_files_keeps_its_buffers_off_huge_pages():
    """Importing the Parquet contract sets Arrow's pool (jemalloc, or the system's malloc) and numpy's large arrays
    to ask for no transparent huge pages (docs/performance.md), in a new process as in the pipeline's."""
    script = (
        "import retool.files.tables, numpy, pyarrow as pa; "
        "multiarray = numpy._core.multiarray if hasattr(numpy, '_core') else numpy.core.multiarray; "
        "print(pa.default_memory_pool().backend_name, multiarray._set_madvise_hugepage(True))"
    )
    pool, huge_pages = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert pool in ("jemalloc", "system") and huge_pages == "False"
