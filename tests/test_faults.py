"""Kill -9 at every point where a stage publishes its output (and twice mid-computation) during a
two-step run; restart each time; finish with the rows of an uninterrupted run."""

from __future__ import annotations

import os
import shutil
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


COMMAND = [sys.executable, "-m", "luigi", "--module", "pipeline", "TrainStep", "--step", "1"]
RENAMES = "rename,renameat,renameat2"


def start(config: Path, kill_at_rename: int | None = None) -> subprocess.Popen:
    """The two-step command; with `kill_at_rename` = k, strace kills it with SIGKILL on its k-th
    rename, before the rename happens: every stage publishes its output (Parquet file or checkpoint
    folder) by one rename, so that is the moment a stage's output is complete but not yet in place."""
    prefix = []
    if kill_at_rename:
        prefix = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={RENAMES}", "-e", f"inject={RENAMES}:error=EIO:signal=SIGKILL:when={kill_at_rename}"]
    return subprocess.Popen(
        [*prefix, *COMMAND], cwd=REPO, env={**os.environ, "LUIGI_CONFIG_PATH": str(config), "PYTHONDONTWRITEBYTECODE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
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


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (.ci/run installs it)")
def test_killed_runs_finish_with_the_rows_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    runs = tmp_path / "runs"
    reference = start(write_config(tmp_path / "reference.cfg", runs, tiny_model_dir, "reference"))
    began = time.monotonic()
    assert reference.wait(timeout=600) == 0, reference.stderr.read().decode()[-3000:]
    duration = time.monotonic() - began

    # Each run re-does the output the run before was killed publishing (its first rename), then is
    # killed publishing the next one (its second): every output is killed once, until a run survives.
    published = write_config(tmp_path / "published.cfg", runs, tiny_model_dir, "killed-publishing")
    kills = 0
    for attempt in range(100):
        process = start(published, kill_at_rename=1 if attempt == 0 else 2)
        code = process.wait(timeout=600)
        assert_nothing_half_written(runs / "killed-publishing")
        if code == 0:
            break
        assert code in (-signal.SIGKILL, 128 + signal.SIGKILL), process.stderr.read().decode()[-3000:]
        kills += 1
    assert kills >= 20  # 11 outputs a step: prompts, 3 x (samples, observations), trajectories, datums, checkpoint, metrics

    computing = write_config(tmp_path / "computing.cfg", runs, tiny_model_dir, "killed-computing")
    for fraction in (0.3, 0.6):  # in the middle of sampling, tool calls or training
        process = start(computing)
        time.sleep(duration * fraction)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        assert_nothing_half_written(runs / "killed-computing")
    final = start(computing)
    assert final.wait(timeout=600) == 0, final.stderr.read().decode()[-3000:]

    expected = outputs(runs / "reference")
    for run in ("killed-publishing", "killed-computing"):
        actual = outputs(runs / run)
        assert expected.keys() == actual.keys(), run
        for name, value in expected.items():
            if isinstance(value, dict):
                assert all(bool((value[k] == actual[name][k]).all()) for k in value), (run, name)
            else:
                assert value.equals(actual[name]), (run, name)
    assert any("datums.parquet" in name for name in expected) and any("adapter" in name for name in expected)
