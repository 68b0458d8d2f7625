"""The Luigi pipeline: Parquet equal to the in-memory rollout, re-runs, sharding, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import luigi
import pyarrow as pa
import pytest

import pipeline.tasks
import retool.sampling.engines
from retool.evaluation.metrics import stage_timings
from retool.files.tables import OBSERVATIONS, SAMPLES, SFT_LOSSES, TRAJECTORIES, read_table, table_from_rows
from retool.rollout.in_memory import rollout_in_memory
from retool.rollout.rows import observation_row
from retool.rollout.stage_tables import trajectories_table
from retool.rollout.state import NO_CALLS_LEFT, REFUSED
from retool.run.shared import protocol_for, sandbox_for
from retool.sampling.scripted import ScriptedSampler
from tests.helpers import REPO, scripted
from tests.pipeline_helpers import TRAIN, batch, build, build_train, step_dir, tool_policy


def without(table: pa.Table, column: str) -> pa.Table:
    return table.drop_columns([column])


@pytest.mark.parametrize(
    "rollout, reward",
    [
        ({}, {}),
        ({"max_code_calls": 1, "max_assistant_turns": 2, "calls_spent": "answer_turn"}, {}),
        ({}, {"valid_call_bonus": 0.1, "wrong_answer_call_credit": 0.2}),
    ],
    ids=["calls spent end", "an answer turn past the last", "shaped rewards"],
)
def test_pipeline_parquet_equals_the_in_memory_rollout(configure, monkeypatch, rollout, reward):
    settings = configure("equal", rollout=rollout, reward=reward)
    assert build(settings, 1, tool_policy(settings, 1), monkeypatch)

    observations_by_round = []
    finished = set()

    def record(round_index, trajectories):
        observations_by_round.extend(
            observation_row(t, 1, round_index)
            for t in trajectories
            if (t.question_index, t.group_index) not in finished
        )
        finished.update((t.question_index, t.group_index) for t in trajectories if t.done)

    protocol = protocol_for(settings.model)
    trajectories = rollout_in_memory(
        batch(settings, 1),
        tool_policy(settings, 1),
        sandbox_for(settings.sandbox),
        protocol,
        settings.rollout,
        step=1,
        on_round=record,
        reward=settings.reward,
    )

    assert read_table(step_dir(settings, 1) / "trajectories.parquet", TRAJECTORIES).equals(
        trajectories_table(trajectories, 1, 0)
    )
    expected_samples = table_from_rows(
        [
            {
                "step": 1,
                "round": r,
                "question_index": t.question_index,
                "group_index": t.group_index,
                "prompt_tokens": turn.prompt_tokens,
                "completion_tokens": turn.completion_tokens,
                "logprobs": turn.logprobs,
                "text": turn.text,
                "finish_reason": turn.finish_reason,
                "seed": turn.seed,
                "policy_step": 0,  # step 1 samples from step 0's checkpoint
            }
            for t in trajectories
            for r, turn in enumerate(t.turns)
        ],
        SAMPLES,
    )
    actual_samples = pa.concat_tables(
        read_table(path, SAMPLES) for path in sorted(step_dir(settings, 1).glob("shard=*/round=*/samples.parquet"))
    )
    order = [("round", "ascending"), ("question_index", "ascending"), ("group_index", "ascending")]
    assert actual_samples.sort_by(order).equals(expected_samples.sort_by(order))
    actual_observations = pa.concat_tables(
        read_table(path, OBSERVATIONS)
        for path in sorted(step_dir(settings, 1).glob("shard=*/round=*/observations.parquet"))
    )
    expected_observations = table_from_rows(observations_by_round, OBSERVATIONS)
    assert without(actual_observations.sort_by(order), "exec_seconds").equals(
        without(expected_observations.sort_by(order), "exec_seconds")
    )
    assert {row["stop_reason"] for row in actual_observations.to_pylist() if row["done"]} >= {"answer"}
    assert any(row["tool_content"] for row in actual_observations.to_pylist())
    refused = [row for row in actual_observations.to_pylist() if row["exec_status"] == REFUSED]
    assert bool(refused) == bool(rollout) and all(row["tool_content"] == NO_CALLS_LEFT for row in refused)
    assert any(row["round"] == settings.rollout.max_assistant_turns for row in actual_observations.to_pylist()) == bool(
        rollout
    )  # a round past the last turn: the answer turn


def test_deleting_one_output_reruns_only_it_and_downstream(configure, monkeypatch):
    settings = configure("rerun")
    assert build(settings, 0, tool_policy(settings, 0), monkeypatch)
    folder = step_dir(settings, 0)
    files = sorted(p for p in folder.rglob("*.parquet"))
    before = {
        p: (
            p.stat().st_mtime_ns,
            without(pa.parquet.read_table(p), "exec_seconds") if "observations" in p.name else pa.parquet.read_table(p),
        )
        for p in files
    }
    deleted = folder / "shard=00/round=01/observations.parquet"
    deleted.unlink()
    assert build(settings, 0, tool_policy(settings, 0), monkeypatch)
    downstream = {
        deleted,
        folder / "shard=00/round=02/samples.parquet",
        folder / "shard=00/round=02/observations.parquet",
        folder / "shard=00/scored.parquet",
        folder / "trajectories.parquet",
    }
    for path, (mtime, table) in before.items():
        assert (path.stat().st_mtime_ns != mtime) == (path in downstream), path
        reread = pa.parquet.read_table(path)
        assert (without(reread, "exec_seconds") if "observations" in path.name else reread).equals(table), path


def test_a_run_refuses_different_settings(configure, monkeypatch, caplog):
    settings = configure("frozen")
    assert build(settings, 0, tool_policy(settings, 0), monkeypatch)
    changed = configure("frozen", rollout={"group_size": 2}, sandbox={"max_workers": 1})  # workers may differ
    assert not build(changed, 0, tool_policy(changed, 0), monkeypatch)  # refused as Luigi first asks of the task
    assert "differing: [rollout] group_size = 2 (frozen: 3). Use" in caplog.text
    assert read_table(step_dir(settings, 0) / "trajectories.parquet", TRAJECTORIES).num_rows == 9  # nothing lost


def test_sharded_run_equals_one_chain(configure, monkeypatch):
    one = configure("one-chain")
    assert build(one, 0, tool_policy(one, 0), monkeypatch)
    sharded = configure("sharded", rollout={"shards": 3})
    assert build(sharded, 0, tool_policy(sharded, 0), monkeypatch)
    assert sorted(p.name for p in step_dir(sharded, 0).glob("shard=*")) == ["shard=00", "shard=01", "shard=02"]
    assert read_table(step_dir(one, 0) / "trajectories.parquet", TRAJECTORIES).equals(
        read_table(step_dir(sharded, 0) / "trajectories.parquet", TRAJECTORIES)
    )


def test_round_without_live_trajectories_writes_an_empty_file_with_the_schema(configure, monkeypatch):
    settings = configure("answers")
    answer_at_once = ScriptedSampler(scripted(protocol_for(settings.model), lambda q, g, t: "\\boxed{1}"))
    assert build(settings, 0, answer_at_once, monkeypatch)
    for name, schema in (("samples", SAMPLES), ("observations", OBSERVATIONS)):
        table = pa.parquet.read_table(step_dir(settings, 0) / f"shard=00/round=02/{name}.parquet")
        assert table.num_rows == 0 and table.schema.equals(schema)


def test_real_sampler_through_the_pipeline(configure):
    settings = configure(
        "hf",
        data={"questions_per_step": 1},
        rollout={"group_size": 2, "max_assistant_tokens": 12, "max_assistant_turns": 2},
    )
    assert build(settings, 0)
    table = read_table(step_dir(settings, 0) / "shard=00/round=00/samples.parquet", SAMPLES)
    assert table.num_rows == 2 and all(
        len(tokens) == len(logprobs)
        for tokens, logprobs in zip(table.column("completion_tokens").to_pylist(), table.column("logprobs").to_pylist())
    )


def run_cli(*args, env_extra=None, cwd=REPO):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "luigi", "--module", "pipeline", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gpu_configuration_on_a_cpu_machine_names_the_setting():
    result = run_cli("ScoreTrajectories", "--step", "0")
    assert result.returncode != 0
    assert "setting [run] device = cuda, but this machine has no GPU" in result.stderr + result.stdout


def test_missing_model_names_the_setting(tmp_path):
    result = run_cli(
        "ScoreTrajectories",
        "--step",
        "0",
        "--run-device",
        "cpu",
        "--model-name",
        str(tmp_path / "nowhere"),
        "--run-runs-dir",
        str(tmp_path),
    )
    assert result.returncode != 0
    assert (
        "setting [model] name = " in result.stderr + result.stdout
        and "neither a local folder" in result.stderr + result.stdout
    )


def test_the_documented_polars_snippets_answer_their_questions(configure, monkeypatch):
    import re

    settings = configure("readme")
    assert build(settings, 0, tool_policy(settings, 0), monkeypatch)
    assert build(settings, 1, tool_policy(settings, 1), monkeypatch)
    page = (REPO / "docs/run-folder.md").read_text()
    code = re.search(r"## Reading a run with polars.*?```python\n(.*?)```", page, re.DOTALL).group(1)
    namespace = {}
    exec(code.replace('RUN = "runs/cpu-default"', f'RUN = "{settings.run_dir}"'), namespace)
    assert namespace["reward_by_step"]["step"].to_list() == [0, 1]
    assert namespace["reward_by_step"]["trajectories"].to_list() == [9, 9]
    assert namespace["tool_calls_by_round"]["calls"].sum() > 0
    assert 0 < namespace["longest_observations"].height <= 5


def test_train_step_runs_steps_in_a_chain_and_resumes_exactly(configure, monkeypatch):
    from safetensors.torch import load_file

    together = configure("together", trainer=TRAIN)
    assert build_train(together, 1, tool_policy(together, 0), monkeypatch)
    apart = configure("apart", trainer=TRAIN)
    assert build_train(apart, 0, tool_policy(apart, 0), monkeypatch)
    assert not (step_dir(apart, 1)).exists()
    assert build_train(apart, 1, tool_policy(apart, 0), monkeypatch)  # a second command
    for step in (0, 1):
        datums = [pa.parquet.read_table(step_dir(s, step) / "datums.parquet") for s in (together, apart)]
        assert datums[0].equals(datums[1]) and datums[0].num_rows > 0
        weights = [
            load_file(step_dir(s, step) / "checkpoint/adapter/adapter_model.safetensors") for s in (together, apart)
        ]
        assert all(bool((weights[0][k] == weights[1][k]).all()) for k in weights[0])
        assert (step_dir(together, step) / "checkpoint/metrics.json").read_text() != ""
    before = load_file(step_dir(together, 0) / "checkpoint/adapter/adapter_model.safetensors")
    after = load_file(step_dir(together, 1) / "checkpoint/adapter/adapter_model.safetensors")
    assert any(not bool((before[k] == after[k]).all()) for k in before)  # the second step moved the policy


def test_datums_match_the_trajectories(configure, monkeypatch):
    settings = configure("datums", trainer=TRAIN)
    assert build_train(settings, 0, tool_policy(settings, 0), monkeypatch)
    trajectories = read_table(step_dir(settings, 0) / "trajectories.parquet", TRAJECTORIES).to_pylist()
    datums = pa.parquet.read_table(step_dir(settings, 0) / "datums.parquet").to_pylist()
    with_signal = [(t["question_index"], t["group_index"]) for t in trajectories if t["advantage"] != 0]
    assert [(d["question_index"], d["group_index"]) for d in datums] == with_signal
    for datum in datums:
        trajectory = next(
            t
            for t in trajectories
            if (t["question_index"], t["group_index"]) == (datum["question_index"], datum["group_index"])
        )
        assert datum["num_tokens"] == trajectory["trajectory_tokens"] - 1 == len(datum["target_tokens"])
        assert sum(datum["loss_mask"]) == trajectory["sampled_tokens"]
        assert [a for a, m in zip(datum["advantages"], datum["loss_mask"]) if m] == pytest.approx(
            [trajectory["advantage"]] * sum(datum["loss_mask"])
        )
        assert all(
            a == 0 and o == 0
            for a, o, m in zip(datum["advantages"], datum["old_logprobs"], datum["loss_mask"])
            if not m
        )


def test_train_step_writes_the_step_metrics(configure, monkeypatch):
    settings = configure("metrics", trainer=TRAIN)
    assert build_train(settings, 0, tool_policy(settings, 0), monkeypatch)
    (metrics,) = pa.parquet.read_table(step_dir(settings, 0) / "metrics.parquet").to_pylist()
    trajectories = read_table(step_dir(settings, 0) / "trajectories.parquet", TRAJECTORIES).to_pylist()
    assert metrics["reward_mean"] == pytest.approx(sum(t["reward"] for t in trajectories) / len(trajectories))
    assert metrics["code_calls"] == pytest.approx(sum(t["code_calls"] for t in trajectories) / len(trajectories))
    assert metrics["sandbox_calls"] == sum(t["code_calls"] for t in trajectories) and metrics["sandbox_ok_rate"] == 1.0
    assert metrics["train_datums"] == pa.parquet.read_table(step_dir(settings, 0) / "datums.parquet").num_rows > 0
    assert metrics["train_padded_tokens"] >= metrics["train_tokens"] > 0 and metrics["train_micro_batches"] >= 1
    assert metrics["seconds_SampleRound"] > 0 and metrics["seconds_TrainStep"] > 0
    timings = stage_timings(step_dir(settings, 0) / "_timings")
    assert {t["stage"] for t in timings} == {
        "Prompts",
        "SampleRound",
        "ExecuteRound",
        "ScoreShard",
        "ScoreTrajectories",
        "ShardDatums",
        "BuildDatums",
        "TrainStep",
    }
    assert all(
        0 < t["parquet_seconds"] < t["seconds"] for t in timings if t["stage"] != "TrainStep"
    )  # every other stage reads and writes Parquet
    assert metrics["sandbox_containment"].startswith(("namespaces", "NO namespaces"))
    assert (
        sum(
            metrics[f"stop_{r}"]
            for r in (
                "answer",
                "invalid",
                "max_code_calls",
                "max_turns",
                "token_budget",
                "observation_over_budget",
                "prompt_over_budget",
            )
        )
        == 9
    )


def test_step_zero_samples_from_and_trains_on_top_of_the_cold_start(configure, monkeypatch):
    from pipeline import ColdStart, TrainStep
    from retool.run.shared import run_rl_base
    from retool.weights.checkpoint import Policy

    settings = configure(
        "cold",
        cold_start={"data": str(REPO / "data/synthetic_sft.jsonl"), "steps": 2, "batch_size": 2, "lora_rank": 0},
        trainer={"lora_rank": 4, "lora_alpha": 8},
        rollout={"max_assistant_tokens": 200, "max_tool_response_tokens": 128},
    )
    policies = []

    def recording_sampler(settings, policy=None, shard=0, in_memory=None):
        policies.append(policy)
        return tool_policy(settings)

    monkeypatch.setattr(retool.sampling.engines, "sampler_for", recording_sampler)
    assert luigi.build([TrainStep(step=1)], local_scheduler=True, workers=1, log_level="WARNING")
    assert ColdStart().complete() and read_table(settings.run_dir / "sft/losses.parquet", SFT_LOSSES).num_rows == 2
    step_zero, step_one = step_dir(settings, 0) / "checkpoint", step_dir(settings, 1) / "checkpoint"
    sft_model = settings.run_dir / "sft/checkpoint/model"
    assert run_rl_base(settings) == sft_model
    assert set(policies) == {Policy(sft_model), Policy(sft_model, step_zero / "adapter")}
    config = json.loads((step_zero / "adapter" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == sft_model  # RL's LoRA sits on the cold start's weights
    assert (step_one / "_SUCCESS").exists()


def test_a_bad_cold_start_file_fails_once_with_its_line_and_writes_nothing(configure, tmp_path):
    from pipeline import SFTExamples

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "1"}]}\n')
    from retool.data.examples import DataError

    settings = configure("bad-cold", cold_start={"data": str(bad)})
    task = SFTExamples()
    with pytest.raises(DataError, match=f"{bad} line 1 message 2: a tool message without"):  # before it is scheduled
        task.complete()
    assert not (settings.run_dir / "sft").exists() or not list((settings.run_dir / "sft").glob("*.parquet"))


def test_task_help_does_not_import_torch():
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
        "from luigi.cmdline import luigi_run\n"
        "luigi_run(['--module', 'pipeline', 'TrainStep', '--help'])\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "--step" in result.stdout and "torch imported: False" in result.stdout, result.stdout[-2000:]


def test_a_sampler_that_does_not_serve_the_policy_fails_the_step_before_saving(configure, monkeypatch):
    from jobs.train_step import train_step
    from retool.config.settings import training_stage
    from retool.training.resume import PolicySyncError

    settings = configure("out-of-sync", trainer={**TRAIN, "max_sampler_gap": 1e-3})  # scripted logprobs are made up
    assert not build_train(settings, 0, tool_policy(settings), monkeypatch)
    assert not (step_dir(settings, 0) / "checkpoint").exists()
    with pytest.raises(PolicySyncError, match="the sampler does not serve the trained policy"):
        folder = step_dir(settings, 0)
        observations = sorted(folder.glob("shard=*/round=*/observations.parquet"))
        train_step(
            sorted(folder.glob("shard=*/datums.parquet")), folder / "datums.parquet", folder / "trajectories.parquet",
            observations, None, None, None,
            folder / "checkpoint", folder / "metrics.parquet", folder / "_timings", training_stage(settings, 0), 0,
        )  # fmt: skip


def test_one_worker_runs_a_shard_s_rounds_before_the_next_shard_s(configure, monkeypatch):
    settings = configure("order", rollout={"shards": 3})
    started = []
    handler = pipeline.tasks.RunTask.event_handler(luigi.Event.START)(
        lambda task: started.append((task.task_family, getattr(task, "shard", None)))
    )
    try:
        assert build(settings, 0, tool_policy(settings, 0), monkeypatch)
    finally:
        pipeline.tasks.RunTask._event_callbacks[pipeline.tasks.RunTask][luigi.Event.START].discard(handler)
    shards = [shard for family, shard in started if family in ("SampleRound", "ExecuteRound")]
    assert shards == sorted(shards) and len(shards) == 3 * 2 * settings.rollout.max_assistant_turns


def test_one_worker_evaluates_one_checkpoint_after_the_other(configure, monkeypatch):
    """Every shard of the newest checkpoint's evaluation, then every shard of the one before, each in shard order:
    the sampler takes each checkpoint once (a CPU engine starts anew at each switch)."""
    from pipeline import BeforeAfter

    configure("eval-order", trainer=TRAIN, rollout={"eval_shard_sequences": 2})
    monkeypatch.setattr(retool.sampling.engines, "sampler_for", lambda settings, *_: tool_policy(settings))
    started = []
    handler = pipeline.tasks.RunTask.event_handler(luigi.Event.START)(
        lambda task: (
            started.append((task.evaluation, task.step, task.shard)) if task.task_family == "SampleRound" else None
        )
    )
    try:
        assert luigi.build([BeforeAfter(step=0, n=1, limit=4)], local_scheduler=True, workers=1, log_level="WARNING")
    finally:
        pipeline.tasks.RunTask._event_callbacks[pipeline.tasks.RunTask][luigi.Event.START].discard(handler)
    evaluated = [(step, shard) for evaluation, step, shard in started if evaluation is not None]
    assert started[: len(started) - len(evaluated)] == [(None, 0, 0)] * (len(started) - len(evaluated)), started
    checkpoints = [step for step, _ in evaluated]
    assert checkpoints == sorted(checkpoints, reverse=True) and set(checkpoints) == {0, -1}, started
    for checkpoint in (0, -1):
        shards = [shard for step, shard in evaluated if step == checkpoint]
        assert shards == sorted(shards) and len(set(shards)) == 2, started


def test_an_evaluation_is_split_into_shards_its_sampler_can_cache():
    from retool.config.rollout import RolloutConfig
    from retool.evaluation.spec import evaluation_shards

    assert evaluation_shards(RolloutConfig(), questions=258, n=2) == 1
    assert evaluation_shards(RolloutConfig(eval_shard_sequences=64), questions=258, n=2) == 9
    assert evaluation_shards(RolloutConfig(eval_shard_sequences=64, shards=12), questions=258, n=2) == 12
    assert evaluation_shards(RolloutConfig(eval_shard_sequences=1), questions=5, n=2) == 5
