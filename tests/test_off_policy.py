"""Sampling a step behind ([rollout] max_staleness): the graph edge that lets step N+1 sample while step N trains,
the policy recorded on every row, and decoupled PPO's importance weights ([trainer] correction)."""

from __future__ import annotations

import math
from dataclasses import replace

import luigi
import pytest
import torch

from retool.config.rollout import behaviour_step
from retool.config.trainer import TrainerConfig
from retool.files.tables import DATUMS, SAMPLES, TRAJECTORIES, read_table
from retool.training.losses import importance_weights, limited_by_correction
from retool.training.step import load_policy, update_policy
from tests.helpers import assert_verifies
from tests.test_trainer import CONFIG, datum_logprobs, on_policy_datums


def shifted(datum, by: float):
    """The datum as if a policy that gave each sampled token `by` nats less had sampled it."""
    return replace(datum, old_logprobs=[o - by if m else 0.0 for o, m in zip(datum.old_logprobs, datum.loss_mask)])


def test_a_step_samples_from_the_checkpoint_max_staleness_steps_older():
    assert [behaviour_step(step, 0) for step in range(4)] == [-1, 0, 1, 2]
    assert [behaviour_step(step, 1) for step in range(4)] == [-1, -1, 0, 1]
    assert [behaviour_step(step, 2) for step in range(5)] == [-1, -1, -1, 0, 1]


def test_with_a_lag_of_one_a_round_waits_for_the_step_two_before(configure):
    from pipeline import SampleRound, TrainStep

    configure("lagged", rollout={"max_staleness": 1})
    policies = {step: SampleRound(step=step, round=0).requires().get("policy") for step in range(4)}
    assert policies[0] is None and policies[1] is None  # the RL base (the model setting)
    assert policies[2] == TrainStep(step=0) and policies[3] == TrainStep(step=1)
    assert TrainStep(step=2) not in luigi.task.flatten(SampleRound(step=3, round=0).requires())
    # A stale step names the checkpoint that sampled it, which its sampler-gap check reads (step 1's: the RL base).
    assert [TrainStep(step=step).requires().get("behaviour") for step in range(4)] == [
        None,
        None,
        TrainStep(step=0),
        TrainStep(step=1),
    ]


def test_the_importance_weight_is_the_truncated_ratio_of_current_to_behaviour_policy(tiny_model_dir):
    """Against a direct computation on a tiny model: weight min(exp(current − behaviour), cap) per token, 1 for
    on-policy data; mis drops the tokens outside its band."""
    model, _ = load_policy(tiny_model_dir, None, CONFIG)
    datum = on_policy_datums(model)[0]
    current = datum_logprobs(model, datum)[torch.tensor(datum.loss_mask)]
    behaviour = torch.tensor([o for o, m in zip(datum.old_logprobs, datum.loss_mask) if m]) - torch.linspace(-1, 1, 12)
    tis = TrainerConfig(correction="tis", correction_cap=2.0)
    expected = torch.clamp(torch.exp(current - behaviour), max=2.0)
    torch.testing.assert_close(importance_weights(current, behaviour, tis), expected)
    assert limited_by_correction(current, behaviour, tis).tolist() == (torch.exp(current - behaviour) > 2).tolist()
    mis = replace(tis, correction="mis", correction_floor=0.5)
    raw = torch.exp(current - behaviour)
    inside = (raw >= 0.5) & (raw <= 2.0)
    torch.testing.assert_close(importance_weights(current, behaviour, mis), torch.where(inside, raw, 0.0))
    on_policy = torch.tensor([o for o, m in zip(datum.old_logprobs, datum.loss_mask) if m])
    torch.testing.assert_close(importance_weights(current, on_policy, tis), torch.ones(12), atol=1e-5, rtol=0)


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_decoupled_ppo_clips_against_the_policy_before_the_update(tiny_model_dir, correction):
    """Samples of a policy 1 nat less likely on every token (an older checkpoint), two updates. Without a
    correction every ratio to that policy is e > 1.28, clipped where a positive advantage meets it. With one, the
    ratio is to the trainer's policy before the update (1, then what the first update moved), and the weight e is
    truncated to 2 (tis) or the tokens dropped (mis: the step then learns nothing)."""
    config = replace(CONFIG, ppo_mini_batches=2, correction=correction, correction_cap=2.0)
    model, optimizer = load_policy(tiny_model_dir, None, config)
    stale = [shifted(d, 1.0) for d in on_policy_datums(model)]
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    metrics = update_policy(model, optimizer, stale, config, num_trajectories=2)
    moved = any(not torch.equal(a, p) for a, p in zip(before, [p for p in model.parameters() if p.requires_grad]))
    assert metrics.kl_sampler_trainer == pytest.approx(float(torch.e - 2), rel=1e-3)  # KL(behaviour || current)
    if correction == "none":  # clipped where the clip binds: the half with a positive advantage
        assert metrics.clip_fraction == 0.5 and metrics.importance_weight == 1.0 and moved
    elif correction == "tis":
        assert metrics.clip_fraction < 0.5 and moved
        assert metrics.importance_weight == pytest.approx(2.0) and metrics.importance_limited == 1.0
    else:
        assert metrics.importance_weight == 0.0 and metrics.importance_limited == 1.0 and not moved


def test_each_row_records_the_checkpoint_that_sampled_it(configure, monkeypatch):
    from pipeline import ShardDatums
    from retool.files.layout import RunFolder
    from tests.pipeline_helpers import TRAIN, tool_policy

    settings = configure("recorded", rollout={"max_staleness": 1}, trainer=TRAIN)
    monkeypatch.setattr("retool.sampling.engines.sampler_for", lambda settings, *_: tool_policy(settings))
    assert luigi.build([ShardDatums(step=1), ShardDatums(step=2)], local_scheduler=True, workers=1, log_level="WARNING")
    for step, policy in ((0, -1), (1, -1), (2, 0)):
        folder = RunFolder(settings.run_dir).step(step)
        tables = (
            read_table(folder.samples(0, 0), SAMPLES),
            read_table(folder.trajectories, TRAJECTORIES),
            read_table(folder.shard_datums(0), DATUMS),
        )
        assert all(set(table.column("policy_step").to_pylist()) <= {policy} for table in tables), step


@pytest.mark.slow
def test_a_lagged_run_samples_the_next_step_while_one_trains_and_a_killed_run_repeats_it(tiny_model_dir, tmp_path):
    """max_staleness = 1, the command with two Luigi workers (in a process of its own, as users run it: a forked
    worker of a process that has computed with torch may hang): step 2's rounds sample while step 1 trains (the
    stage timings say so); the same command killed (SIGKILL, every process of it) once step 1 trains, and run
    again, gives the uninterrupted run's tables and weights."""
    import os
    import signal
    import time

    import pyarrow.parquet as pq

    from bench.cluster import command, finished, write_config
    from retool.evaluation.analysis import metrics_by_step
    from retool.evaluation.metrics import stage_timings
    from retool.files.layout import RunFolder

    def run(name: str, killed: bool) -> RunFolder:
        folder = RunFolder(tmp_path / "runs" / name)
        config = write_config(
            tmp_path / f"{name}.cfg", tiny_model_dir, tmp_path / "runs", name, 0, central=False,
            rollout={"max_staleness": "1"},
        )  # fmt: skip
        arguments = ("TrainStep", "--step", "2", "--workers", "2")
        process = command(config, tmp_path / name, *arguments)
        if killed:
            while process.poll() is None and not folder.step(1).datums.exists():
                time.sleep(0.02)
            assert process.poll() is None and not (folder.step(2).checkpoint / "_SUCCESS").exists()
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            process = command(config, tmp_path / f"{name}-again", *arguments)
        code, _, errors = finished(process)
        assert code == 0, errors[-3000:]
        return folder

    runs = [run("lagged-a", killed=False), run("lagged-b", killed=True)]
    for folder in runs:
        assert_verifies(folder.path)
    trained = next(t for t in stage_timings(runs[0].step(1).timings) if t["stage"] == "TrainStep")
    sampled = [t for t in stage_timings(runs[0].step(2).timings) if t["stage"] == "SampleRound"]
    assert min(t["ended"] - t["seconds"] for t in sampled) < trained["ended"]  # step 2 sampled before step 1 ended
    # A scripted sampler, no sampler-gap check: the gap of a stale step is not measured (NaN), an on-policy one's is.
    gaps = metrics_by_step(runs[0].path)["train_logprob_gap"].to_list()
    assert gaps[0] >= 0 and all(math.isnan(gap) for gap in gaps[1:])

    def files(run):
        return sorted(p.relative_to(run.path) for p in run.path.rglob("*.parquet") if p.name != "metrics.parquet")

    def table(path):  # less the sandbox's wall times
        read = pq.read_table(path)
        return read.drop_columns([name for name in read.column_names if name == "exec_seconds"])

    assert files(runs[0]) == files(runs[1]) and files(runs[0])
    for relative in files(runs[0]):
        assert table(runs[0].path / relative).equals(table(runs[1].path / relative)), relative
    adapters = [run.step(2).checkpoint / "adapter" / "adapter_model.safetensors" for run in runs]
    assert adapters[0].read_bytes() == adapters[1].read_bytes()


@pytest.mark.parametrize("lora_rank", [8, 0])
def test_a_stale_steps_sampler_gap_is_taken_under_the_policy_that_sampled_it(tiny_model_dir, tmp_path, lora_rank):
    """Samples of the base model, trained from a policy one update further: their gap to the trainer's policy is
    the update's own change, their gap to the base (the policy that sampled them) none; a sampler that served other
    weights still shows. The weights and the random state the step trains from are untouched by the check."""
    from retool.training.resume import StepInputs, gap_to_behaviour

    config = replace(CONFIG, lora_rank=lora_rank, learning_rate=5e-3 if lora_rank else 1e-3)
    model, optimizer = load_policy(tiny_model_dir, None, config)
    datums = on_policy_datums(model)
    update_policy(model, optimizer, datums, config, num_trajectories=2)  # the policy moves on: the one a step later
    drifted = update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), datums, config, num_trajectories=2)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    random_state = torch.get_rng_state()
    files = {"datums": (tmp_path / "datums.parquet",), "previous": tmp_path / "step0", "out": tmp_path / "step1"}
    inputs = StepInputs(tiny_model_dir, **files, num_trajectories=2, zero_variance_groups=0, config=config)
    inputs = replace(inputs, behaviour=tiny_model_dir)  # sampled by the base model
    gap = gap_to_behaviour(model, model, datums, inputs, "cpu")
    assert drifted.logprob_gap > 1e-3 and gap < 1e-5
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), random_state)
    wrong = gap_to_behaviour(model, model, [shifted(d, 0.5) for d in datums], inputs, "cpu")
    assert wrong == pytest.approx(0.5, abs=1e-4)


def test_a_lag_keeps_the_checkpoints_the_steps_behind_sample_from():
    from retool.config.settings import RunSettings, SettingsError, check_training

    with pytest.raises(SettingsError, match=r"\[run\] keep_last = 2 with \[rollout\] max_staleness = 2"):
        check_training(RunSettings().changed(run={"keep_last": 2}, rollout={"max_staleness": 2}))
    check_training(RunSettings().changed(run={"keep_last": 3}, rollout={"max_staleness": 2}))
