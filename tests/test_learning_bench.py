"""The learning benchmark's pairing with an earlier run: its final policy, whatever number of steps it took."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.learning import final_evaluation

EVALUATION = "eval/synthetic_eval-0123456789/retool-n2"


def evaluated(run, *checkpoints):
    for checkpoint in checkpoints:
        folder = run / EVALUATION / f"checkpoint={checkpoint}"
        folder.mkdir(parents=True)
        (folder / "trajectories.parquet").touch()


def test_the_earlier_runs_final_policy_is_its_newest_rl_step(tmp_path):
    evaluated(tmp_path, "sft", "base", "step0009", "step0029")
    (tmp_path / EVALUATION / "checkpoint=step0039").mkdir()  # an evaluation that did not finish
    assert final_evaluation(tmp_path, Path(EVALUATION)).name == "checkpoint=step0029"


def test_a_run_without_that_evaluation_is_named_in_the_error(tmp_path):
    evaluated(tmp_path, "sft")
    with pytest.raises(SystemExit, match=f"--against {tmp_path}: no RL step evaluated in .*retool-n2"):
        final_evaluation(tmp_path, Path(EVALUATION))
