"""[run] tracker: a step's scalars and an evaluation's scores arrive in TensorBoard, W&B (offline) and MLflow
(a SQLite store), each read back through the library's own files; a missing library is refused up front."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import luigi
import pyarrow.parquet as pq
import pytest

import pipeline.tasks
import retool.sampling.engines
from retool.config.settings import RunConfig, SettingsError
from retool.data.examples import MathExample, write_examples
from retool.evaluation.tracking import Tracker, check_tracker, scalars
from retool.files.layout import RunFolder
from retool.run.shared import protocol_for
from retool.sampling.scripted import ScriptedSampler
from tests.helpers import scripted
from tests.pipeline_helpers import TRAIN, build_train, step_dir, tool_policy


def tensorboard_scalars(folder: RunFolder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    events = EventMultiplexer().AddRunsFromDirectory(str(folder.tensorboard))
    events.Reload()
    found: dict[str, list[tuple[int, float]]] = {}
    for run in events.Runs():
        for tag in events.GetAccumulator(run).Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(run, tag))
    return {tag: sorted(values) for tag, values in found.items()}


def wandb_history(folder: RunFolder) -> list[dict]:
    """The history rows of every offline W&B session of the run. A .wandb file is LevelDB's log format (32 KiB
    blocks of records with a 7-byte header: checksum, length, type) after a 7-byte W&B header, each record a
    protobuf Record; the installed wandb ships the protobuf classes but no reader."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(folder.path.glob("wandb/offline-run-*/run-*.wandb")):
        data, position, pending = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B", path
        while position + 7 <= len(data):
            if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
                position += 32768 - position % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[position : position + 7])
            if kind == 0:
                break
            pending += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append(
                        {
                            item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item
                        }
                    )
    return rows


def mlflow_history(folder: RunFolder, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(folder.path / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([client.get_experiment_by_name("retool").experiment_id])
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, key))


@pytest.fixture
def offline(monkeypatch):
    for name in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow"])
def test_two_commands_log_two_steps_to_one_tracker_run(kind, tmp_path, offline):
    folder = RunFolder(tmp_path / "run")
    for step in (0, 1):  # each a separate command: a new Tracker, as a new process has
        Tracker(kind, folder, "demo").log(step, {"train_kl_k1": 0.5 + step, "reward_mean": -0.25 * step})
        time.sleep(1.0)  # W&B names an offline session's folder by the second it began: one session each
    expected = [(0, 0.5), (1, 1.5)]
    if kind == "tensorboard":
        assert tensorboard_scalars(folder)["train_kl_k1"] == expected
    elif kind == "wandb":
        rows = wandb_history(folder)
        assert [(row["step"], row["train_kl_k1"]) for row in rows] == expected
        assert len({path.name for path in folder.path.glob("wandb/offline-run-*/run-*.wandb")}) == 1  # one run id
    else:
        assert mlflow_history(folder, "train_kl_k1") == expected
        assert mlflow_history(folder, "reward_mean") == [(0, 0.0), (1, -0.25)]


def test_an_mlflow_run_ends_finished_with_the_settings_as_params(tmp_path, offline):
    from mlflow.tracking import MlflowClient

    from retool.config.settings import RunSettings, frozen

    folder = RunFolder(tmp_path / "run")
    tracker = Tracker("mlflow", folder, "demo", frozen(RunSettings().changed(rollout={"group_size": 5})))
    tracker.log_steps([(0, {"loss": 1.5}), (1, {"loss": 1.25})], prefix="cold_start/")
    tracker.log(0, {"reward_mean": -0.5})
    client = MlflowClient(tracking_uri=f"sqlite:///{(folder.path / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([client.get_experiment_by_name("retool").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["rollout.group_size"] == "5"
    assert mlflow_history(folder, "cold_start/loss") == [(0, 1.5), (1, 1.25)]


def test_scalars_are_the_numbers_but_flags_and_the_step():
    assert scalars({"step": 3, "loss": 0.5, "train_updates": 2, "train_skipped": False, "stops": "answer: 3"}) == {
        "loss": 0.5,
        "train_updates": 2.0,
    }
    assert scalars({"gap": float("nan")}) == {}  # a step without a value for it logs nothing


def test_an_unknown_or_missing_tracker_is_refused_naming_the_setting(monkeypatch):
    with pytest.raises(
        SettingsError, match=r"\[run\] tracker = 'neptune': must be one of none, tensorboard, wandb, mlflow"
    ):
        RunConfig(tracker="neptune")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(
        SettingsError, match=r"\[run\] tracker = wandb needs the wandb package.*retool-pipeline\[wandb\]"
    ):
        check_tracker("wandb")
    check_tracker("none")


@pytest.mark.slow
def test_a_training_step_logs_its_metrics_to_mlflow(configure, monkeypatch, offline):
    settings = configure("tracked", run={"tracker": "mlflow"}, trainer=TRAIN)
    assert build_train(settings, 0, tool_policy(settings, 0), monkeypatch)
    (metrics,) = pq.read_table(step_dir(settings, 0) / "metrics.parquet").to_pylist()
    folder = RunFolder(settings.run_dir)
    for name in ("reward_mean", "train_kl_k1", "train_entropy", "seconds_TrainStep"):
        assert mlflow_history(folder, name) == [(0, pytest.approx(metrics[name]))]
    assert json.loads(folder.tracking_record.read_text())["id"].startswith("tracked-")


@pytest.mark.slow
def test_an_evaluation_logs_its_scores_to_wandb(configure, monkeypatch, tmp_path, offline):
    dataset = tmp_path / "sums.jsonl"
    write_examples([MathExample(str(i), f"What is {i} + {i}?", str(2 * i), "sums") for i in range(2)], dataset)
    settings = configure("tracked-eval", run={"tracker": "wandb"})
    sampler = ScriptedSampler(
        scripted(protocol_for(settings.model), lambda q, g, t: f"\\boxed{{{2 * q if g else -1}}}")
    )
    monkeypatch.setattr(retool.sampling.engines, "sampler_for", lambda s, policy=None, shard=0, in_memory=None: sampler)
    task = pipeline.Evaluate(step=-1, dataset=str(dataset), n=2, eval_mode="retool")
    assert luigi.build([task], local_scheduler=True, workers=1, log_level="WARNING")
    (row,) = wandb_history(RunFolder(settings.run_dir))
    name = Path(task.output().path).parent.parent.relative_to(settings.run_dir / "eval")
    assert row["step"] == -1
    assert row[f"eval/{name}/base/average_at_n"] == 0.5 and row[f"eval/{name}/base/questions"] == 2
