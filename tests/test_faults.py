"""Kill -9 a run (a cold start and one RL step) at every stage, re-run the same command each time, and finish with
the rows of an uninterrupted run; no half-written output and no process is ever left behind. A later step's stages
are the same stages: what only a later step has is held elsewhere (its draw re-run alike: test_frontier; a kill
while it trains, from the trainer held in memory: the killed lagged run of test_off_policy, test_resume,
test_training_group)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from tests.conftest import BASE
from tests.helpers import REPO, assert_verifies

pytestmark = pytest.mark.slow
COMMAND = ["--module", "pipeline", "TrainStep", "--step", "0"]


def write_config(path: Path, runs: Path, model: Path, run: str) -> Path:
    overrides = {
        "run": {"name": run, "runs_dir": runs},
        "model": {"name": model},
        "sampler": {"engine": "scripted:tests.policies:branching_tools"},
        "trainer": {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3, "micro_batch_items": 2},
        "cold_start": {
            "data": REPO / "data/synthetic_sft.jsonl",
            "steps": 2,
            "batch_size": 2,
            "save_every": 1,
            "lora_rank": 4,
        },
    }
    sections = {name: {**BASE.get(name, {}), **overrides.get(name, {})} for name in {*BASE, *overrides}}
    path.write_text(
        "".join(
            f"[{name}]\n" + "".join(f"{key} = {value}\n" for key, value in values.items())
            for name, values in sections.items()
        )
    )
    return path


def run(config: Path, *launcher: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *launcher, *COMMAND],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LUIGI_CONFIG_PATH": str(config), "PYTHONDONTWRITEBYTECODE": "1", **environment},
    )


def outputs(run_folder: Path) -> dict[str, object]:
    """Every result file of the run, comparable across runs (timings and wall times left out)."""
    found = {}
    for path in sorted(run_folder.rglob("*.parquet")):
        if path.name == "metrics.parquet" or path.name.startswith("."):
            continue
        table = pq.read_table(path)
        found[str(path.relative_to(run_folder))] = table.drop_columns(
            [c for c in ("exec_seconds", "seconds") if c in table.column_names]
        )
    for path in sorted([*run_folder.rglob("adapter_model.safetensors"), *run_folder.rglob("model.safetensors")]):
        found[str(path.relative_to(run_folder))] = load_file(path)
    return found


def assert_same_outputs(expected: dict, actual: dict, float_columns: tuple[str, ...] = (), tolerance: float = 0.0):
    """Every table and weight of `expected` (see `outputs`) in `actual`, equal; `float_columns` (and the weights) to
    `tolerance` where it is set: the arithmetic of a sampler that batched other calls with them, or not."""
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        if isinstance(value, dict):  # weights
            for key in value:
                assert float((value[key] - actual[name][key]).abs().max()) <= tolerance, (name, key)
            continue
        floats = [column for column in float_columns if column in value.column_names]
        assert value.drop_columns(floats).equals(actual[name].drop_columns(floats)), name
        for column in floats:
            ours, theirs = (t.column(column).combine_chunks().flatten().to_numpy() for t in (value, actual[name]))
            assert len(ours) == len(theirs) and abs(ours - theirs).max(initial=0) <= tolerance, (name, column)


def assert_nothing_half_written(run_folder: Path) -> None:
    for path in run_folder.rglob("*.parquet"):
        if not path.name.startswith("."):
            pq.read_table(path)  # a complete file, or none at all
    for checkpoint in run_folder.rglob("checkpoint"):
        assert (checkpoint / "_SUCCESS").exists(), f"{checkpoint} looks complete but is not"


def parent_of(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def assert_no_process_left(killed: object) -> None:
    """The sandbox processes of a run that ended (`killed`: which, for the message) end with it."""

    def orphans() -> list[int]:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                pid = int(cmdline.parent.name)
                # a sandbox process whose command is gone (its parent now init), not one of this test process's
                if b"retool/sandbox/forkserver.py" in cmdline.read_bytes() and parent_of(pid) == 1:
                    found.append(int(cmdline.parent.name))
            except OSError:
                continue
        return found

    deadline = time.monotonic() + 10
    while orphans():
        assert time.monotonic() < deadline, f"sandbox processes outlived the killed run {killed}: {orphans()}"
        time.sleep(0.1)


def test_a_run_killed_at_every_stage_finishes_with_the_rows_of_an_uninterrupted_run(
    uninterrupted_run, tiny_model_dir, tmp_path
):
    runs = tmp_path / "runs"
    config, kill_points = (
        write_config(tmp_path / "faulty.cfg", runs, tiny_model_dir, "faulty"),
        tmp_path / "kill-points.txt",
    )
    for attempt in range(60):
        done = run(config, "tests.kill_points", KILL_POINTS=str(kill_points), KILL_RUN=str(runs / "faulty"))
        if done.returncode == 0:
            break
        assert done.returncode == -9, done.stderr[-3000:]
        assert_nothing_half_written(runs / "faulty")
        assert_no_process_left(attempt)
    else:
        pytest.fail("the run never finished")

    points = kill_points.read_text().splitlines()
    for step in ("step=0000",):
        stage_points = [p for p in points if f"/{step}/" in p or p.endswith(f"/{step}/checkpoint")]
        for name in ("prompts", "samples", "observations", "trajectories", "datums", "metrics"):
            assert any(p.startswith("publishing") and p.endswith(f"{name}.parquet") for p in stage_points), (
                step,
                name,
                points,
            )
        for kind in ("publishing", "writing"):
            assert f"{kind} {runs / 'faulty' / step / 'checkpoint'}" in points, (step, kind, points)
    assert [p for p in points if p.startswith("training")] == ["training step 0"]
    sft = runs / "faulty" / "sft"
    for point in (
        "cold start started",
        "cold start past its resume point",
        f"publishing {sft / 'examples.parquet'}",
        f"publishing {sft / 'progress'}",
        f"writing {sft / 'progress'}",
        f"writing {sft / 'checkpoint'}",
        f"publishing {sft / 'checkpoint'}",
        f"publishing {sft / 'losses.parquet'}",
    ):
        assert point in points, (point, points)

    assert_same_outputs(uninterrupted_run, outputs(runs / "faulty"))
    assert_verifies(runs / "faulty")
    assert any("datums.parquet" in name for name in uninterrupted_run)
    assert any("adapter" in name for name in uninterrupted_run)
    assert "sft/checkpoint/model/model.safetensors" in uninterrupted_run
