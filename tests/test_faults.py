"""Kill -9 at many points of a two-step run, restart, and finish with the rows of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from jobs.protocol import BUNDLED_TEMPLATE

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def write_config(path: Path, runs: Path, model: Path, run: str) -> Path:
    settings = {
        "run": run, "runs_dir": runs, "model": model, "device": "cpu", "sampler": "scripted:tests.policies:slow_tools",
        "chat_template": BUNDLED_TEMPLATE, "train_data": REPO / "data/synthetic_eval.jsonl", "questions_per_step": 3,
        "group_size": 3, "max_code_calls": 2, "max_assistant_turns": 3, "max_trajectory_tokens": 900, "max_assistant_tokens": 96,
        "max_tool_response_tokens": 48, "trainer_max_tokens": 1024, "lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3,
        "micro_batch_items": 2, "sandbox_workers": 2,
    }
    path.write_text("[retool]\n" + "".join(f"{key} = {value}\n" for key, value in settings.items()))
    return path


def start(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "luigi", "--module", "pipeline", "TrainStep", "--step", "1"], cwd=REPO,
        env={**os.environ, "LUIGI_CONFIG_PATH": str(config)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )


def outputs(run: Path) -> dict[str, object]:
    """Every result file of the run, comparable across runs (timings and wall times left out)."""
    found = {}
    for path in sorted(run.rglob("*.parquet")):
        if path.name == "metrics.parquet" or path.name.startswith("."):
            continue
        table = pq.read_table(path)
        found[str(path.relative_to(run))] = table.drop_columns(["exec_seconds"]) if "exec_seconds" in table.column_names else table
    for path in sorted(run.rglob("adapter_model.safetensors")):
        found[str(path.relative_to(run))] = load_file(path)
    return found


def assert_nothing_half_written(run: Path) -> None:
    for path in run.rglob("*.parquet"):
        if not path.name.startswith("."):
            pq.read_table(path)  # a complete file, or none at all
    for checkpoint in run.rglob("checkpoint"):
        assert (checkpoint / "_SUCCESS").exists(), f"{checkpoint} looks complete but is not"


def test_killed_runs_finish_with_the_rows_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    runs = tmp_path / "runs"
    reference = start(write_config(tmp_path / "reference.cfg", runs, tiny_model_dir, "reference"))
    began = time.monotonic()
    assert reference.wait(timeout=600) == 0, reference.stderr.read().decode()[-3000:]
    duration = time.monotonic() - began

    config = write_config(tmp_path / "faulty.cfg", runs, tiny_model_dir, "faulty")
    interrupted = []
    for fraction in (0.2, 0.35, 0.5, 0.65, 0.8, 0.9):
        process = start(config)
        time.sleep(duration * fraction)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            interrupted.append(fraction)
        process.wait()
        assert_nothing_half_written(runs / "faulty")
    final = start(config)
    assert final.wait(timeout=600) == 0, final.stderr.read().decode()[-3000:]
    assert len(interrupted) >= 3  # the kills landed in the middle of the run

    expected, actual = outputs(runs / "reference"), outputs(runs / "faulty")
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        if isinstance(value, dict):
            assert all(bool((value[k] == actual[name][k]).all()) for k in value), name
        else:
            assert value.equals(actual[name]), name
    assert any("datums.parquet" in name for name in expected) and any("adapter" in name for name in expected)
