"""The trainer kept in memory between steps, and checkpoints by cadence: a resume replays the steps since the
newest full save from their datums, to the same bits as a run that never stopped."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import retool.training.resume
from retool.config.trainer import TrainerConfig, saves_in_full
from retool.files.tables import DATUMS, table_from_rows, write_table_atomically
from retool.rollout.datums import datums_from_table
from retool.training import resident
from retool.training.resume import ResumeError, StepInputs, train_from_files
from retool.training.step import load_model
from retool.weights.checkpoint import Checkpoint
from tests.test_trainer import CONFIG, datum_logprobs, make_datum

STEPS = 7


def write_datums(folder, step):
    """A step's datums: other completions and advantages each step, so that every update differs."""
    datums = [
        make_datum(0, g, list(range(100, 130)), list(range(300 + 20 * g + step, 310 + 20 * g + step)), adv, [-3.0] * 10)
        for g, adv in enumerate([1.0, -1.0, 0.5 - step % 2])
    ]
    rows = [{"step": step, **asdict(d), "num_tokens": d.num_tokens} for d in datums]
    path = folder / f"step={step:04d}" / "datums.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table_atomically(table_from_rows(rows, DATUMS), path)
    return path


def train(folder, model_dir, config, steps, save_every, resident_trainer=True):
    """Steps `steps` of a run in `folder`, as jobs/train_step.py trains them (full saves by the cadence)."""
    for step in steps:
        inputs = StepInputs(
            model_dir,
            (write_datums(folder, step),),
            3,
            0,
            folder / f"step={step - 1:04d}" / "checkpoint" if step else None,
            folder / f"step={step:04d}" / "checkpoint",
            config,
            served_in="" if saves_in_full(step, save_every) or not resident_trainer else "bfloat16",
        )
        train_from_files(inputs, "cpu", "cpu" if resident_trainer else "")


def step_inputs(folder, model_dir, config, step, served_in="bfloat16"):
    """Step `step` of a run in `folder` (its datums written), as a training group is handed it."""
    previous = folder / f"step={step - 1:04d}" / "checkpoint" if step else None
    datums = (write_datums(folder, step),)
    return StepInputs(model_dir, datums, 3, 0, previous, folder / f"step={step:04d}" / "checkpoint", config, served_in)


def test_inputs_read_back_and_a_record_of_one_datums_file_still_reads(tmp_path):
    """A step's inputs.json lists its shards' datums; one written before that names the step's datums.parquet."""
    import json

    inputs = step_inputs(tmp_path, tmp_path / "model", TrainerConfig(data_parallel="ddp"), 0)  # as resolved
    assert StepInputs.from_json(inputs.to_json()) == inputs
    earlier = json.loads(inputs.to_json()) | {"datums": str(tmp_path / "datums.parquet")}
    assert StepInputs.from_json(json.dumps(earlier)).datums == (tmp_path / "datums.parquet",)


def state_of(checkpoint):
    """A full save's weights and Adam state."""
    held = Checkpoint(checkpoint)
    weights = load_file(
        held.adapter / "adapter_model.safetensors" if held.holds_adapter else held.model / "model.safetensors"
    )
    return weights, torch.load(held.optimizer, weights_only=False)


def assert_bit_equal(a, b):
    (weights_a, adam_a), (weights_b, adam_b) = a, b
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    assert adam_a["state"].keys() == adam_b["state"].keys()
    for name, state in adam_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, adam_b["state"][name][key]), (name, key)


CONFIGS = [CONFIG, replace(CONFIG, lora_rank=0, learning_rate=1e-4)]
WITH_KL = replace(CONFIGS[1], kl_coef=0.5)  # each step (and each replay) takes the RL base's logprobs in a pass


@pytest.mark.parametrize("config", [*CONFIGS, WITH_KL], ids=["lora", "full", "full-kl"])
def test_a_resume_after_a_kill_replays_from_the_last_full_save_to_the_same_bits(tiny_model_dir, tmp_path, config):
    """save_every = 4: step 3 saves in full; killed after step 4, the command again replays step 4 to train step 5."""
    config = replace(config, save_every=4)
    train(tmp_path / "whole", tiny_model_dir, config, range(STEPS), 4)
    resident.save_at_exit()  # the command's end: its last step saved in full
    train(tmp_path / "killed", tiny_model_dir, config, range(5), 4)
    resident.drop()  # killed: nothing saved at exit
    step = tmp_path / "killed" / "step={:04d}" / "checkpoint"
    assert Checkpoint(step.parent.parent / "step=0003" / "checkpoint").holds_state
    assert not Checkpoint(tmp_path / "killed" / "step=0004" / "checkpoint").holds_state
    replayed = []
    real = retool.training.resume.update_policy
    retool.training.resume.update_policy = lambda *a, **k: replayed.append(len(a[2])) or real(*a, **k)
    try:
        train(tmp_path / "killed", tiny_model_dir, config, range(5, STEPS), 4)
    finally:
        retool.training.resume.update_policy = real
    resident.save_at_exit()
    assert len(replayed) == 3  # step 4 replayed, then steps 5 and 6 trained
    last = f"step={STEPS - 1:04d}/checkpoint"
    assert_bit_equal(state_of(tmp_path / "whole" / last), state_of(tmp_path / "killed" / last))


@pytest.mark.parametrize("config", CONFIGS, ids=["lora", "full"])
def test_the_resident_trainer_gives_the_checkpoints_of_one_that_loads_each_step(tiny_model_dir, tmp_path, config):
    """Three steps held in memory (the policy loaded once) equal three steps that each load the step before's full
    save from disk; the steps in between write only what the sampler loads."""
    loads = []
    real = retool.training.resume.load_model
    retool.training.resume.load_model = lambda *a, **k: loads.append(a[1]) or real(*a, **k)
    try:
        train(tmp_path / "held", tiny_model_dir, replace(config, save_every=20), range(3), 20)
    finally:
        retool.training.resume.load_model = real
    assert loads == [None]  # the base model, once
    held = Checkpoint(tmp_path / "held" / "step=0001" / "checkpoint")
    assert not held.holds_state and held.inputs.exists()
    if not config.lora_rank:  # what the engine loads, in its dtype
        assert {t.dtype for t in load_file(held.model / "model.safetensors").values()} == {torch.bfloat16}
    resident.save_at_exit()
    train(tmp_path / "loaded", tiny_model_dir, config, range(3), 1, resident_trainer=False)
    last = "step=0002/checkpoint"
    assert_bit_equal(state_of(tmp_path / "held" / last), state_of(tmp_path / "loaded" / last))


def test_a_held_state_is_taken_only_for_its_own_checkpoint(tiny_model_dir, tmp_path):
    train(tmp_path / "run", tiny_model_dir, replace(CONFIG, save_every=20), range(1), 20)
    checkpoint = tmp_path / "run" / "step=0000" / "checkpoint"
    assert resident.take(checkpoint, tiny_model_dir, replace(CONFIG, learning_rate=1.0)) is None  # other settings
    assert resident.take(checkpoint, tiny_model_dir, CONFIG) is None  # what was held is gone
    train(tmp_path / "run", tiny_model_dir, replace(CONFIG, save_every=20), range(1), 20)
    Checkpoint(checkpoint).marker.unlink()
    Checkpoint(checkpoint).marker.write_text("")  # written again: another state
    assert resident.take(checkpoint, tiny_model_dir, CONFIG) is None


def test_a_checkpoint_that_cannot_be_replayed_is_named(tiny_model_dir, tmp_path):
    train(tmp_path / "run", tiny_model_dir, replace(CONFIG, save_every=20), range(1), 20)
    resident.drop()
    Checkpoint(tmp_path / "run" / "step=0000" / "checkpoint").inputs.unlink()
    with pytest.raises(ResumeError, match=r"step=0000/checkpoint holds no Adam state and no inputs.json"):
        train(tmp_path / "run", tiny_model_dir, replace(CONFIG, save_every=20), range(1, 2), 20)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=["lora", "full"])
def test_a_training_group_holds_the_state_between_steps_and_trains_as_one_process(tiny_model_dir, tmp_path, config):
    """Two gloo processes started once (DDP for the LoRA, FSDP2 for the full fine-tune), handed three steps through
    the run folder: the state is loaded once and held, the last step is saved in full when the group stops, and
    the weights equal one process's within float32 tolerance (the order of the sums differs)."""
    import os

    from retool.training.group import RECORD, TrainingGroupError, group_for, stop_group, train_in_group

    config = replace(config, micro_batch_items=1, save_every=20)
    folder = tmp_path / "group" / "trainer"
    pid = group_for(folder, 2, "cpu", os.getpid())
    assert group_for(folder, 2, "cpu", os.getpid()) == pid  # the command's own group, started once
    with pytest.raises(TrainingGroupError, match="belongs to another command still running"):
        group_for(folder, 2, "cpu", os.getppid())
    try:
        for step in range(3):
            inputs = step_inputs(tmp_path / "group", tiny_model_dir, config, step)
            assert train_in_group(folder, pid, inputs).datums == 3
    finally:
        stop_group(folder, os.getpid())
    assert not (folder / RECORD).exists()
    log = (folder / "group.log").read_text()
    assert log.count("starts from the state held in memory") == 2 * 2, log[-3000:]  # steps 1 and 2, each process
    train(tmp_path / "one", tiny_model_dir, config, range(3), 20)
    resident.save_at_exit()
    last = "step=0002/checkpoint"
    (weights, adam), (one_weights, one_adam) = state_of(tmp_path / "group" / last), state_of(tmp_path / "one" / last)
    assert weights.keys() == one_weights.keys() and adam["state"].keys() == one_adam["state"].keys()
    for name in weights:
        torch.testing.assert_close(weights[name], one_weights[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("config", [replace(CONFIG, kl_coef=0.5), WITH_KL], ids=["lora", "full"])
def test_the_kl_penalty_refers_to_the_base_model(tiny_model_dir, tmp_path, config):
    """[trainer] kl_coef: a step's KL to the RL base is that of the policy it starts from to the base model, measured
    apart (0 at the first step), and the policy's own weights are back for the update."""
    train(tmp_path, tiny_model_dir, config, range(2), 1, resident_trainer=False)
    train(tmp_path / "none", tiny_model_dir, replace(config, kl_coef=0.0), range(2), 1, resident_trainer=False)
    recorded = [json.loads((tmp_path / f"step={s:04d}" / "checkpoint" / "metrics.json").read_text()) for s in (0, 1)]
    without = json.loads((tmp_path / "none" / "step=0001" / "checkpoint" / "metrics.json").read_text())
    assert recorded[1]["entropy"] == without["entropy"]  # the same policy before the update: the penalty's gradient
    # is 0 where the policy is the base, and the reference pass put the policy's weights back
    assert recorded[0]["kl_reference"] == 0.0
    datums = datums_from_table(pq.read_table(tmp_path / "step=0001" / "datums.parquet"))
    base, policy = (load_model(tiny_model_dir, p, config) for p in (None, tmp_path / "step=0000" / "checkpoint"))
    logprobs = [torch.cat([datum_logprobs(m, d)[torch.tensor(d.loss_mask)] for d in datums]) for m in (base, policy)]
    log_ratio = logprobs[0] - logprobs[1]
    assert recorded[1]["kl_reference"] == pytest.approx(float((log_ratio.exp() - 1 - log_ratio).mean()), rel=1e-3)
    assert recorded[1]["kl_reference"] > 1e-6
