"""A disk that fills up while a stage writes its output: the stage fails with one line naming the file and the
space left on its filesystem, no partial file is left (nor its hidden temporary), and the same command, run again
once space is freed, finishes with the rows of an uninterrupted run."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
from dataclasses import MISSING, fields, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.errors import ErrorsAsOneLine
from retool.config.trainer import TrainerConfig
from retool.files.atomic import DiskFullError, write_atomically
from retool.files.tables import write_table_atomically
from retool.training.checkpoints import save_checkpoint
from retool.training.record import StepMetrics
from tests.test_faults import (
    assert_no_process_left,
    assert_nothing_half_written,
    assert_same_outputs,
    outputs,
    run,
    write_config,
)

FREE = r"\(\d+(\.\d)? (B|KiB|MiB|GiB|TiB) free on /[^)]*\)"


def fills_the_disk(code: int = errno.ENOSPC):
    def write(temporary: Path) -> None:
        temporary.write_bytes(b"PAR1" + bytes(60))  # what fitted before the disk filled
        raise OSError(code, "No space left on device")

    return write


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota")])
def test_a_write_that_fills_the_disk_fails_in_one_line_and_leaves_the_old_file(tmp_path, code, words):
    path = tmp_path / "rows.parquet"
    write_table_atomically(pa.table({"x": [1, 2, 3]}), path)
    with pytest.raises(DiskFullError) as caught:
        write_atomically(path, fills_the_disk(code))
    error = caught.value
    assert re.fullmatch(rf"{words}[a-z ]* writing {re.escape(str(path))} {FREE}", str(error)), str(error)
    assert isinstance(error, OSError) and error.errno == code and error.filename == str(path)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == code
    assert pq.read_table(path).column("x").to_pylist() == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.parquet"]  # no hidden temporary


def test_a_first_write_that_fills_the_disk_leaves_no_file(tmp_path):
    path = tmp_path / "step=0000" / "datums.parquet"
    with pytest.raises(DiskFullError, match=rf"^no space left on device writing {re.escape(str(path))} {FREE}$"):
        write_atomically(path, fills_the_disk())
    assert list(path.parent.iterdir()) == []


def test_other_write_errors_are_left_as_they_are(tmp_path):
    def denied(temporary: Path) -> None:
        temporary.write_bytes(b"PAR1")
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError) as caught:
        write_atomically(tmp_path / "x.parquet", denied)
    assert not isinstance(caught.value, DiskFullError) and list(tmp_path.iterdir()) == []


def test_a_task_that_fills_the_disk_is_logged_as_its_one_line(tmp_path):
    try:
        write_atomically(tmp_path / "datums.parquet", fills_the_disk())
    except DiskFullError:
        record = logging.LogRecord("luigi-interface", logging.ERROR, __file__, 0, "[pid %s] failed %s", (1, "T"), None)
        record.exc_info = sys.exc_info()
    assert ErrorsAsOneLine().filter(record) and record.exc_info is None
    assert re.fullmatch(f"no space left on device writing .*datums.parquet {FREE}", record.getMessage())


METRICS = StepMetrics(**{f.name: 0 for f in fields(StepMetrics) if f.default is MISSING})


class Weights:
    """A model as save_checkpoint sees one: save_pretrained writes its config and safetensors, or, given `fails`,
    part of its safetensors and then that error."""

    def __init__(self, fails=None):
        self.fails = fails

    def save_pretrained(self, folder: Path, state_dict: dict) -> None:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        if self.fails:
            (folder / "model.safetensors").write_bytes(bytes(4096))  # what fitted before the disk filled
            raise self.fails()
        save_file(state_dict, str(folder / "model.safetensors"))


def save(folder: Path, model: Weights, weights: torch.Tensor, state: torch.Tensor, datums: int = 0) -> None:
    tokenizer = folder.parent.parent / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    (tokenizer / "tokenizer.json").write_text("{}")
    metrics = replace(METRICS, datums=datums)
    save_checkpoint(folder, model, None, metrics, TrainerConfig(), tokenizer, gathered=({"w": weights}, {"s": state}))


def safetensors_full() -> Exception:  # what safetensors raises (from transformers' save_pretrained too)
    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def torch_over_quota(value, file) -> None:  # torch.save into a file whose write found the quota spent
    file.write(b"PK" + bytes(100))
    try:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534") from None


def assert_only_the_older_checkpoint(folder: Path) -> None:
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no hidden temporary
    assert (folder / "_SUCCESS").exists() and '"datums": 1,' in (folder / "metrics.json").read_text()
    assert torch.equal(load_file(folder / "model" / "model.safetensors")["w"], torch.ones(4))


@pytest.mark.parametrize(
    "full, code, words", [("weights", errno.ENOSPC, "no space"), ("optimizer", errno.EDQUOT, "disk quota")]
)
def test_a_checkpoint_that_fills_the_disk_fails_in_one_line_and_leaves_the_older_one(
    tmp_path, monkeypatch, full, code, words
):
    folder = tmp_path / "step=0003" / "checkpoint"
    save(folder, Weights(), torch.ones(4), torch.ones(4), datums=1)
    if full == "optimizer":
        monkeypatch.setattr(torch, "save", torch_over_quota)
    with pytest.raises(DiskFullError) as caught:
        save(folder, Weights(safetensors_full if full == "weights" else None), torch.zeros(4), torch.zeros(4))
    error = caught.value
    assert re.fullmatch(rf"{words}[a-z ]* writing {re.escape(str(folder))} {FREE}", str(error)), str(error)
    assert error.errno == code and error.filename == str(folder)
    assert_only_the_older_checkpoint(folder)


def test_a_checkpoint_that_fails_otherwise_raises_its_own_error_and_leaves_no_temporary(tmp_path):
    folder = tmp_path / "step=0003" / "checkpoint"
    save(folder, Weights(), torch.ones(4), torch.ones(4), datums=1)
    with pytest.raises(ValueError, match="^bad weights$") as caught:
        save(folder, Weights(lambda: ValueError("bad weights")), torch.zeros(4), torch.zeros(4))
    assert not isinstance(caught.value, OSError)
    assert_only_the_older_checkpoint(folder)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (as root where mounting works, else skipped)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mount.stderr.decode().strip()}")
    yield disk
    if subprocess.run(["umount", str(disk)]).returncode != 0:
        subprocess.run(["umount", "-l", str(disk)])


@pytest.mark.parametrize("full", ["weights", "optimizer"])
def test_a_checkpoint_that_fills_a_real_disk_fails_in_one_line_and_leaves_the_older_one(small_disk, full):
    folder = small_disk / "step=0003" / "checkpoint"
    save(folder, Weights(), torch.ones(4), torch.ones(4), datums=1)
    big, small = torch.zeros(100_000), torch.zeros(4)  # 400 KB: more than the disk holds
    with pytest.raises(DiskFullError) as caught:
        save(folder, Weights(), *((big, small) if full == "weights" else (small, big)))
    assert re.fullmatch(rf"no space left on device writing {re.escape(str(folder))} {FREE}", str(caught.value))
    assert str(caught.value).endswith(f" free on {small_disk})")
    assert_only_the_older_checkpoint(folder)


@pytest.mark.slow
def test_a_run_whose_disk_fills_up_fails_in_one_line_then_finishes_once_space_is_freed(
    uninterrupted_run, tiny_model_dir, tmp_path
):
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "faulty.cfg", runs, tiny_model_dir, "faulty")
    config.write_text(config.read_text() + "[scheduler]\nretry_delay = 1\n")  # its retries fail alike, quickly
    datums = runs / "faulty" / "step=0000" / "datums.parquet"
    full = run(config, "tests.inject_faults", DISK_FULL_AT=str(datums))
    assert full.returncode != 0, full.stdout[-3000:]
    line = rf"no space left on device writing {re.escape(str(datums))} {FREE}"
    assert re.search(rf"^(ERROR: )?{line}$", full.stderr, re.MULTILINE), full.stderr[-3000:]  # each try
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    assert re.search(rf"^TrainStep\(step=0\): not done: TrainStep: {line}$", full.stdout, re.MULTILINE), full.stdout
    assert not datums.exists() and not list(datums.parent.glob(".datums.parquet.tmp-*"))
    assert_nothing_half_written(runs / "faulty")
    assert_no_process_left("the run that found its disk full")

    freed = run(config, "luigi")
    assert freed.returncode == 0, freed.stderr[-3000:]
    assert_same_outputs(uninterrupted_run, outputs(runs / "faulty"))
    assert any("datums.parquet" in name for name in uninterrupted_run)
