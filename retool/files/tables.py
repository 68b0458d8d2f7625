"""The Parquet contract: one Arrow schema per kind of file, and reading/writing that checks it."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy
import pyarrow as pa
import pyarrow.parquet as pq

from retool.files.atomic import write_atomically


def _buffers_on_small_pages() -> None:
    """Arrow's buffers from jemalloc (the system's malloc where a wheel has none), not the default mimalloc, and
    numpy's large arrays without a request for transparent huge pages. Under the kernel's usual THP mode (`madvise`)
    both requests made a stage fault in and zero fresh 2 MiB pages each time it freed and refilled its buffers: the
    join of a 13 M-token step's datums spent 6 of its 7 seconds in the kernel (docs/performance.md)."""
    try:
        pa.set_memory_pool(pa.jemalloc_memory_pool())
    except NotImplementedError:
        pa.set_memory_pool(pa.system_memory_pool())
    multiarray = numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray  # numpy 2, numpy 1
    multiarray._set_madvise_hugepage(False)  # what NUMPY_MADVISE_HUGEPAGE=0 does at numpy's import


_buffers_on_small_pages()

TOKENS = pa.list_(pa.int32())
FLOATS = pa.list_(pa.float32())

PROMPTS = pa.schema(
    [
        ("step", pa.int32()),
        ("question_index", pa.int32()),  # position in the step's batch; groups advantages
        ("example_id", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),  # reference answer
        ("data_source", pa.string()),
        ("prompt_tokens", TOKENS),  # P(1), rendered by the chat template
        ("pass_rate", pa.float32()),  # [data] draw = frontier: the estimate it was drawn by; null otherwise
        ("draw_weight", pa.float32()),  # frontier: its draw weight (the chance its group disagrees, floored)
        ("draw_reason", pa.string()),  # how it was chosen: the shuffled walk, or the outcomes its estimate rests on
    ]
)

SAMPLES = pa.schema(
    [
        ("step", pa.int32()),
        ("round", pa.int32()),
        ("question_index", pa.int32()),
        ("group_index", pa.int32()),  # branch within the question's group
        ("prompt_tokens", TOKENS),  # P(i): the exact model input
        ("completion_tokens", TOKENS),  # C(i): the sampler's own tokens
        ("logprobs", FLOATS),  # sampler logprob of each completion token
        ("text", pa.string()),  # decoded from completion_tokens, stripped
        ("finish_reason", pa.string()),  # stop | length
        ("seed", pa.int64()),
        ("policy_step", pa.int32()),  # the checkpoint that sampled it: its RL step (-1: the RL base)
    ]
)

OBSERVATIONS = pa.schema(
    [
        ("step", pa.int32()),
        ("round", pa.int32()),
        ("question_index", pa.int32()),
        ("group_index", pa.int32()),
        ("kind", pa.string()),  # tool | answer | invalid; null when the round had no budget to sample
        ("code", pa.string()),  # the code run, for an executed call
        ("call_id", pa.string()),
        ("exec_status", pa.string()),  # ok | error | timeout | refused (no calls left: not run)
        ("exec_seconds", pa.float32()),
        ("tool_content", pa.string()),  # the observation as appended ("" when it did not fit)
        ("next_prompt_tokens", TOKENS),  # P(i+1); null once done
        ("code_calls", pa.int32()),  # observations appended so far
        ("turns", pa.int32()),  # assistant turns so far
        ("done", pa.bool_()),
        ("stop_reason", pa.string()),  # null while live
        ("final_text", pa.string()),  # the text the reward reads; null while live
    ]
)

TRAJECTORIES = pa.schema(
    [
        ("step", pa.int32()),
        ("question_index", pa.int32()),
        ("group_index", pa.int32()),
        ("example_id", pa.string()),
        ("data_source", pa.string()),
        ("answer", pa.string()),
        ("num_turns", pa.int32()),
        ("code_calls", pa.int32()),
        ("code_calls_ok", pa.int32()),  # of those, calls whose code ran without an error or a timeout
        ("stop_reason", pa.string()),
        ("final_text", pa.string()),
        ("extracted_answer", pa.string()),  # last \boxed{} content, null if none
        ("valid_format", pa.bool_()),
        ("correct", pa.bool_()),
        ("reward", pa.float32()),  # correctness: +1 right, -1 otherwise
        ("shaped_reward", pa.float32()),  # what the advantage is computed from: reward with [reward]'s terms
        ("advantage", pa.float32()),  # shaped reward minus the question group's mean
        ("kept", pa.bool_()),  # its group trains this step (dynamic sampling keeps groups of mixed correctness)
        ("masked", pa.bool_()),  # left out of the loss: stopped by a budget, with [reward] overlong = mask
        ("trajectory_tokens", pa.int32()),  # length of the whole token sequence
        ("sampled_tokens", pa.int32()),  # how many of those the model sampled (the actions)
        ("policy_step", pa.int32()),  # the checkpoint that sampled it: its RL step (-1: the RL base)
    ]
)

DATUMS = pa.schema(
    [
        ("step", pa.int32()),
        ("question_index", pa.int32()),
        ("group_index", pa.int32()),
        ("input_tokens", TOKENS),  # the trajectory's tokens but the last: what the model reads
        ("target_tokens", TOKENS),  # the tokens but the first: what each position predicts
        ("old_logprobs", FLOATS),  # sampler logprob of each target on sampled tokens, 0 elsewhere
        ("advantages", FLOATS),  # the trajectory's advantage on sampled targets, 0 elsewhere
        ("loss_mask", pa.list_(pa.bool_())),  # True on targets the model sampled
        ("num_tokens", pa.int32()),
        ("policy_step", pa.int32()),  # the checkpoint that sampled it: its RL step (-1: the RL base)
    ]
)


# Columns that files written before them lack: read as nulls (not recorded).
ADDED_LATER = {"policy_step", "pass_rate", "draw_weight", "draw_reason", "shaped_reward", "masked"}


class TableError(ValueError):
    """A Parquet file in the run folder is damaged or not what the pipeline wrote."""


SFT_EXAMPLES = pa.schema(
    [
        ("example_id", pa.string()),
        ("line", pa.int32()),  # line of the cold-start data file
        ("num_turns", pa.int32()),
        ("code_calls", pa.int32()),
        ("input_tokens", TOKENS),  # the rendered conversation, less its last token
        ("target_tokens", TOKENS),  # shifted by one
        (
            "loss_mask",
            pa.list_(pa.bool_()),
        ),  # True on targets the assistant emits; tool output and template tokens False
        ("num_tokens", pa.int32()),
    ]
)

SFT_LOSSES = pa.schema(
    [
        ("step", pa.int32()),
        ("loss", pa.float64()),  # mean token NLL of the step's batch, before its update
        ("examples", pa.int32()),
        ("loss_tokens", pa.int32()),
        ("grad_norm", pa.float64()),  # before clipping
        ("seconds", pa.float64()),
    ]
)


def table_from_rows(rows: Sequence[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=schema)


def list_column(rows: Sequence[Sequence], type: pa.ListType) -> pa.ListArray:
    """A list column from one sequence (numpy array or list) per row, converted at once rather than value by value
    (each row's values rounded to the column's type as from_pylist would: float64 to the nearest float32)."""
    lengths = numpy.fromiter((len(row) for row in rows), numpy.int64, len(rows))
    if lengths.sum() >= 2**31:  # Arrow's list offsets are 32-bit
        raise ValueError(f"a {type} column of {lengths.sum()} values: more than a Parquet list column holds")
    offsets = numpy.zeros(len(rows) + 1, numpy.int32)
    numpy.cumsum(lengths, out=offsets[1:])
    dtype = type.value_type.to_pandas_dtype()
    values = numpy.concatenate([numpy.asarray(row, dtype) for row in rows]) if rows else numpy.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type.value_type), type=type)


def row_views(column: pa.ChunkedArray) -> list[numpy.ndarray]:
    """Each row of a list column without nulls as a numpy view of its values (no copy, no Python value per item; a
    file of several row groups reads as a chunk each)."""
    if column.null_count:
        raise ValueError(f"a {column.type} column has nulls")
    views = []
    for array in column.chunks:
        values, offsets = array.values.to_numpy(zero_copy_only=False), array.offsets.to_numpy()
        views += [values[start:end] for start, end in zip(offsets[:-1], offsets[1:])]
    return views


_parquet = threading.local()  # seconds spent in read_table and write_tables_atomically, by each thread of the process


def parquet_seconds() -> float:
    """Seconds this thread has spent reading and writing pipeline Parquet files so far (a task runs in one thread;
    TrainStep writes the step's datums in another while it trains)."""
    return getattr(_parquet, "seconds", 0.0)


def _timed(function):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _parquet.seconds = parquet_seconds() + time.perf_counter() - started

    return timed


@functools.lru_cache(maxsize=16)  # about one step's files of one shard
def _read_published(path: str, inode: int, mtime_ns: int, size: int, columns: tuple[str, ...] | None) -> pa.Table:
    """Files are only ever replaced whole (a new inode), so a version read once is reused: each
    stage replays its shard from every earlier round file, and a process runs many stages."""
    parquet = pq.ParquetFile(path)  # not read_table: its dataset layer costs a millisecond a file
    if columns is not None:
        present = set(parquet.schema_arrow.names)
        columns = [name for name in columns if name in present]  # one added later: filled in by the caller
    return parquet.read(columns=columns)


def forget_read_files() -> None:
    """Empties the cache of files read (a benchmark's repeated run reads them again, as a new process does)."""
    _read_published.cache_clear()


@_timed
def read_table(path: str | Path, schema: pa.Schema, columns: Sequence[str] | None = None) -> pa.Table:
    """Reads a file the pipeline wrote (only `columns` of its schema, when given); a truncated or foreign file
    is an error naming it."""
    path = Path(path)
    if columns is not None:
        schema = pa.schema([schema.field(name) for name in columns])
    try:
        version = path.stat()
        table = _read_published(
            str(path), version.st_ino, version.st_mtime_ns, version.st_size, None if columns is None else tuple(columns)
        )
    except Exception as error:  # pyarrow raises several types for damaged files
        raise TableError(f"{path}: not a readable Parquet file ({error}); delete it and re-run its stage") from None
    for name in ADDED_LATER & set(schema.names) - set(table.schema.names):  # a file written before the column was
        table = table.append_column(name, pa.nulls(table.num_rows, schema.field(name).type))
    missing = [name for name in schema.names if name not in table.schema.names]
    if missing:
        raise TableError(f"{path}: missing columns {missing}; it was not written by this pipeline stage")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise TableError(f"{path}: columns have unexpected types ({error})") from None


def write_table_atomically(table: pa.Table, path: str | Path) -> None:
    """Writes `table` (`write_tables_atomically`)."""
    write_tables_atomically([table], table.schema, path)


def write_tables_atomically(tables: Iterable[pa.Table], schema: pa.Schema, path: str | Path) -> pa.Table:
    """Writes each of `tables` (of `schema`) as the file's next row group, so a large file is built a part at a time,
    and returns the file's table (the parts, not copied).
    Token and logprob lists are not dictionary-encoded (their values rarely repeat within a page: Parquet tries,
    then falls back) and pages are compressed with zstd at level 1: the datums of a long step write in 0.7 the time
    and read in 0.6 of snappy's with dictionaries, in half the bytes (docs/performance.md)."""
    scalar = [field.name for field in schema if not pa.types.is_list(field.type)]
    written = []

    def write(temporary: Path) -> None:
        open_file = _timed(pq.ParquetWriter)
        with open_file(temporary, schema, compression="zstd", compression_level=1, use_dictionary=scalar) as out:
            for table in tables:  # made as they are written: only the writing counts as Parquet seconds
                _timed(out.write_table)(table)
                written.append(table)

    write_atomically(path, write)
    return pa.concat_tables(written) if written else schema.empty_table()
