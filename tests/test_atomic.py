"""Publishing in one rename, in-process and in milliseconds: a writer that dies half-way leaves the file that was
there (or none), never a partial one, and the next writer clears what it left. The whole run killed at every
stage is the end-to-end form of this (test_faults, make test-all)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retool.files.atomic import publish_once, write_atomically
from retool.files.tables import write_table_atomically


class Died(Exception):
    """Stands for the writer's process dying in the middle of its write."""


def test_a_writer_that_dies_half_way_leaves_the_old_file_and_no_partial_one(tmp_path):
    path = tmp_path / "rows.parquet"
    write_table_atomically(pa.table({"x": [1, 2, 3]}), path)

    def half_then_die(temporary):
        temporary.write_bytes(path.read_bytes()[:20])  # a Parquet file cut short
        raise Died

    with pytest.raises(Died):
        write_atomically(path, half_then_die)
    assert pq.read_table(path).column("x").to_pylist() == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.parquet"]


def test_a_first_write_that_dies_leaves_no_file_and_the_next_writer_clears_its_temporary(tmp_path):
    path = tmp_path / "new.parquet"
    stale = tmp_path / ".new.parquet.tmp-1"  # what a writer killed by SIGKILL leaves: no finally ran
    stale.write_bytes(b"PAR1 half")

    def die(temporary):
        temporary.write_bytes(b"PAR1 half")
        raise Died

    with pytest.raises(Died):
        write_atomically(path, die)
    assert not path.exists()
    write_table_atomically(pa.table({"x": [4]}), path)
    assert pq.read_table(path).column("x").to_pylist() == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.parquet"]


def test_publish_once_keeps_the_first_text(tmp_path):
    path = tmp_path / "record.json"
    assert publish_once(path, "first") and not publish_once(path, "second")
    assert path.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["record.json"]
