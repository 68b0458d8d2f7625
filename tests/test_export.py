"""`python -m retool export-sft`: a run's correct rollouts become cold-start data that the next run's SFTExamples
renders to the very tokens the rollouts sampled."""

from __future__ import annotations

import subprocess
import sys

import luigi
import pytest

import pipeline.cold_start
from retool.data.conversations import read_conversations
from retool.files.layout import RunFolder
from retool.files.tables import SFT_EXAMPLES, TRAJECTORIES, read_table
from retool.rollout.replay import replay_shards
from retool.run.setup import freeze
from retool.run.shared import protocol_for
from tests.conftest import REPO
from tests.pipeline_helpers import build, tool_policy


def export(*arguments) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "retool", "export-sft", *map(str, arguments)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_exported_rollouts_render_to_the_sampled_tokens_through_sft_examples(configure, monkeypatch, tmp_path):
    settings = configure("rollouts")
    for step in (0, 1):
        assert build(settings, step, tool_policy(settings), monkeypatch)
    out = tmp_path / "rft.jsonl"
    done = export(settings.run_dir, "--steps", "0-1", "--out", out)
    assert done.returncode == 0, done.stderr

    sampled = {}
    for step in (0, 1):
        scores = read_table(settings.run_dir / f"step={step:04d}" / "trajectories.parquet", TRAJECTORIES).to_pylist()
        correct = {(row["question_index"], row["group_index"]) for row in scores if row["correct"]}
        folder, rollout = RunFolder(settings.run_dir).step(step), settings.rollout
        rounds = [folder.rounds(shard, rollout.max_assistant_turns) for shard in range(rollout.shards)]
        for trajectory in replay_shards(folder.prompts, rounds, protocol_for(settings.model), rollout):
            if (trajectory.question_index, trajectory.group_index) in correct:
                sampled[f"{trajectory.example.id}@step{step}.{trajectory.group_index}"] = trajectory.token_ids()
    conversations = read_conversations(out)
    assert sorted(c.id for c in conversations) == sorted(sampled) and len(sampled) >= 4
    assert any(turn.code for c in conversations for turn in c.turns)  # tool calls and their outputs are kept
    assert f"{len(sampled)} of {len(sampled)} render to the sampled tokens exactly\n" in done.stdout  # no "others"

    # Another run starts from them: its SFT examples are the sampled sequences, token for token.
    configure("from-rollouts", cold_start={"data": str(out)})
    task = pipeline.cold_start.SFTExamples()
    assert luigi.build([task], local_scheduler=True, workers=1, log_level="WARNING")
    examples = read_table(task.output().path, SFT_EXAMPLES).to_pylist()
    assert len(examples) == len(sampled)
    for example in examples:
        assert example["input_tokens"] + example["target_tokens"][-1:] == sampled[example["example_id"]]


def test_export_refuses_a_folder_that_is_not_a_run_and_steps_it_has_not_scored(configure, tmp_path):
    done = export(tmp_path)
    assert done.returncode == 2 and "not a run folder" in done.stderr and "Traceback" not in done.stderr
    settings = configure("empty-run")
    freeze(settings)  # what a run's first command writes
    done = export(settings.run_dir, "--steps", "3")
    assert done.returncode == 2 and "no scored trajectories for step(s) 3; scored: none" in done.stderr
    done = export(settings.run_dir, "--steps", "x")
    assert done.returncode == 2 and "expected steps like 0,2-4" in done.stderr
