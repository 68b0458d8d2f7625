"""The default CPU run (configs/cpu.cfg, the command `make run` gives) end to end, shortened: its cold start, two RL
steps that both update, and the before/after table on 6 held-out questions (the evaluation set takes the three
family roles in turn: 2 of each). It needs the real model: whether the default trains (the cold start teaches the
tool, every step's groups disagree so that there is a gradient, every update moves the policy) is a property of
the embedded model and its data, which no random-weight model has. How well RL keeps the format is measured
by `python -m bench learning`, not here: a quality figure on a few questions is noise, not a correctness check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest

from retool.config.precision import this_processor
from retool.evaluation.analysis import metrics_by_step
from tests.helpers import REPO, assert_verifies

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_the_default_run_cold_starts_updates_every_step_and_compares(tmp_path, default_model_dir):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join((REPO / "data/synthetic_eval.jsonl").read_text().splitlines(keepends=True)[:6]))
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
    assert_verifies(run)
    chosen = "bfloat16" if this_processor().native_bfloat16 else "float32"  # auto, as configs/cpu.cfg sets it
    assert result.stdout.splitlines()[0].startswith(f"dtype: sampler {chosen}, trainer float32")
    assert json.loads((run / "config.json").read_text())["sampler"]["dtype"] == chosen

    losses = pl.read_parquet(run / "sft" / "losses.parquet")
    assert losses["loss"][-1] < losses["loss"][0] / 4
    metrics = metrics_by_step(run)
    assert metrics["step"].to_list() == [0, 1]
    assert not any(metrics["train_skipped"]) and all(metrics["train_updates"] > 0)  # every step updates
    # The sampler serves the policy the trainer holds (both bfloat16 on a CPU that has it natively, else float32).
    assert max(metrics["train_logprob_gap"]) < 0.05
    assert all(metrics["train_kl_k3"] > 0) and all(metrics["train_entropy"] > 0)  # the drift of every update
    assert all(metrics["train_loss_tokens"] > 0) and all(metrics["train_grad_norm"] > 0)  # a gradient every step
    assert all(metrics["zero_variance_group_rate"] < 1)  # some group of every step disagrees: a reward to move
    assert metrics["code_calls"].min() > 0.5 and metrics["format"].min() > 0  # the cold start taught the protocol

    (table_path,) = run.glob("eval/heldout-*/retool-n2/before_after-step=0001.md")  # the file's name and content
    table = table_path.read_text()
    lines = table.splitlines()
    changes = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:5]]  # it leads with RL - SFT
    assert lines[0].startswith("| questions | RL step 1 - SFT (Average@2) | Format SFT → RL step 1 |")
    assert [row[0].split(" (")[0] for row in changes] == ["sft families", "rl families", "held-out families"]
    first = lines.index(next(line for line in lines if line.startswith("| questions | policy |")))
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[first + 2 : first + 8]]
    assert [row[1] for row in rows] == ["SFT", "RL step 1"] * 3  # the base model only when asked for
    for checkpoint in ("sft", "step0001"):  # each evaluated checkpoint's summary, on the 6 questions
        (summary,) = run.glob(f"eval/heldout-*/retool-n2/checkpoint={checkpoint}/summary.parquet")
        assert pl.read_parquet(summary)["questions"].sum() == 6, checkpoint
    assert not list(run.glob("eval/heldout-*/retool-n2/checkpoint=base"))
    assert "rl families: RL step 1 - SFT" in table and "RL step 1 - base" not in table
    assert table in result.stdout
    assert (run / "report" / "step=0001" / "diagnostics.png").exists()
