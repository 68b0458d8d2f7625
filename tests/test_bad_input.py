"""Bad inputs get one clear error naming the input, and leave existing outputs as they were."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import retool.sandbox.call
from retool.files.tables import SAMPLES, TableError, read_table
from retool.sandbox.call import Sandbox
from tests.pipeline_helpers import TRAIN, build, build_train, step_dir, tool_policy


def test_truncated_parquet_in_the_run_folder_names_the_file(configure, monkeypatch, caplog):
    settings = configure("truncated")
    assert build(settings, 0, tool_policy(settings, 0), monkeypatch)
    samples = step_dir(settings, 0) / "shard=00/round=01/samples.parquet"
    samples.write_bytes(samples.read_bytes()[:100])
    (step_dir(settings, 0) / "shard=00/round=01/observations.parquet").unlink()
    untouched = {p: p.read_bytes() for p in step_dir(settings, 0).rglob("*.parquet") if p != samples}
    assert not build(settings, 0, tool_policy(settings, 0), monkeypatch)
    assert f"{samples}: not a readable Parquet file" in caplog.text and "delete it and re-run its stage" in caplog.text
    assert all(path.read_bytes() == data for path, data in untouched.items())


def test_foreign_parquet_names_the_missing_columns(tmp_path):
    path = tmp_path / "samples.parquet"
    pq.write_table(pa.table({"step": [0], "something": ["else"]}), path)
    with pytest.raises(TableError, match=f"{path}: missing columns .*'round'"):
        read_table(path, SAMPLES)


def test_a_sandbox_failure_affects_only_its_call(monkeypatch):
    sandbox = Sandbox()
    real_mkdtemp = retool.sandbox.call.tempfile.mkdtemp
    calls = []

    def flaky_mkdtemp(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("no more processes")
        return real_mkdtemp(*args, **kwargs)

    monkeypatch.setattr(retool.sandbox.call.tempfile, "mkdtemp", flaky_mkdtemp)
    results = [sandbox.run_code(f"print({i})") for i in range(3)]
    assert [r.status for r in results] == ["ok", "error", "ok"]
    assert "SandboxError: the sandbox could not run this code (OSError: no more processes)" in sandbox.observation(
        results[1]
    )


def test_checkpoint_without_success_marker_is_trained_again(configure, monkeypatch):
    settings = configure("marker", trainer=TRAIN)
    assert build_train(settings, 0, tool_policy(settings), monkeypatch)
    checkpoint = step_dir(settings, 0) / "checkpoint"
    weights = (checkpoint / "adapter/adapter_model.safetensors").read_bytes()
    (checkpoint / "_SUCCESS").unlink()  # as if the writer died before finishing
    assert build_train(settings, 0, tool_policy(settings), monkeypatch)
    assert (checkpoint / "_SUCCESS").exists() and (
        checkpoint / "adapter/adapter_model.safetensors"
    ).read_bytes() == weights


def test_a_training_group_of_one_is_refused_but_an_evaluation_with_n_1_runs():
    from dataclasses import replace

    from retool.config.rollout import RolloutConfig
    from retool.config.settings import DataConfig, RunSettings, SettingsError, check_training
    from retool.evaluation.spec import EvalSpec, evaluation_settings

    with pytest.raises(SettingsError, match="group_size = 1: training needs at least 2 samples per question"):
        check_training(RunSettings(rollout=RolloutConfig(group_size=1)))
    with pytest.raises(SettingsError, match="questions_per_step = 5000 exceeds 4096"):
        check_training(replace(RunSettings(), data=DataConfig(questions_per_step=5000)))
    evaluation = evaluation_settings(RunSettings(), EvalSpec("data/synthetic_eval.jsonl", 1, "retool"))
    assert evaluation.rollout.group_size == 1


def test_a_training_nucleus_is_refused_and_an_evaluations_temperature_never_reaches_the_trainer():
    from retool.config.settings import RunSettings, SettingsError, check_training
    from retool.evaluation.spec import EvalSpec, evaluation_settings

    with pytest.raises(SettingsError, match=r"\[rollout\] top_p = 0.9: training samples with top_p = 1"):
        check_training(RunSettings().changed(rollout={"top_p": 0.9}))
    settings = RunSettings().changed(rollout={"temperature": 0.8})
    assert settings.trainer_on_device().temperature == 0.8  # the trainer's logprobs at the sampling temperature
    assert settings.sft_trainer().temperature == 1.0  # the cold start's likelihood is the model's own
    evaluation = evaluation_settings(
        settings, EvalSpec("data/synthetic_eval.jsonl", 1, "retool", temperature=0.3, top_p=0.5)
    )
    assert evaluation.rollout.temperature == 0.3 and settings.trainer_on_device().temperature == 0.8


def test_an_evaluation_set_larger_than_the_seed_layout_names_the_file(tmp_path):
    import json

    from retool.config.settings import RunSettings, SettingsError
    from retool.evaluation.spec import EvalSpec, evaluation_settings

    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"id": str(i), "question": "q", "answer": "1"}) + "\n" for i in range(4097)))
    with pytest.raises(SettingsError, match=f"evaluation dataset {big}: 4097 questions, over the 4096"):
        evaluation_settings(RunSettings(), EvalSpec(str(big), 2, "retool"))


def test_chat_template_arguments_must_be_a_json_object():
    from retool.config.settings import ModelConfig, SettingsError

    assert ModelConfig(chat_template_kwargs='{"reasoning_effort": "low"}').template_kwargs() == {
        "enable_thinking": False,
        "reasoning_effort": "low",
    }
    with pytest.raises(SettingsError, match=r"\[model\] chat_template_kwargs = .*: must be a JSON object \(Expecting"):
        ModelConfig(chat_template_kwargs="{enable_thinking: true")
    with pytest.raises(SettingsError, match="must be a JSON object"):
        ModelConfig(chat_template_kwargs="[1]")
