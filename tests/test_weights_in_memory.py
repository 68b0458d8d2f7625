"""A trained policy handed to the sampler from the resident trainer's memory rather than read back from its files:
the same weights, so the same samples; vLLM engines on a GPU take them through vLLM's weight-transfer API."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from retool.config.sampler import SamplerConfig, takes_weights_in_memory
from retool.config.settings import RunSettings
from retool.sampling.contract import SamplingSettings
from retool.sampling.hf import HFSampler
from retool.sampling.server import server_command, server_environment
from retool.training import resident
from retool.training.resident import held_weights
from retool.weights.checkpoint import Checkpoint
from tests.test_hf_sampler import requests_for
from tests.test_resume import train
from tests.test_trainer import CONFIG

FULL = replace(CONFIG, lora_rank=0, learning_rate=1e-3, save_every=20)  # step 1 saves only what the sampler loads


@pytest.fixture
def trained(tiny_model_dir, tmp_path):
    """Steps 0 and 1 of a full fine-tune, step 1 held in memory; its checkpoint."""
    train(tmp_path / "run", tiny_model_dir, FULL, range(2), 20)
    yield tmp_path / "run" / "step=0001" / "checkpoint"
    resident.drop()


def test_the_held_weights_are_those_the_checkpoint_wrote_for_the_sampler(trained, tmp_path):
    saved = load_file(Checkpoint(trained).model / "model.safetensors")
    weights = held_weights(trained)
    assert sorted(weights) == sorted(saved)  # as saved: a tied output layer once
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(weights[name].to(tensor.dtype), tensor), name
    assert held_weights(tmp_path / "run" / "step=0000" / "checkpoint") is None  # another step's
    Checkpoint(trained).marker.unlink()
    Checkpoint(trained).marker.write_text("")  # the checkpoint written again: another policy
    assert held_weights(trained) is None


def test_a_lora_or_a_dropped_state_hands_over_nothing(tiny_model_dir, tmp_path):
    train(tmp_path / "lora", tiny_model_dir, replace(CONFIG, save_every=20), range(1), 20)
    assert held_weights(tmp_path / "lora" / "step=0000" / "checkpoint") is None  # vLLM takes adapters from files
    resident.drop()
    train(tmp_path / "full", tiny_model_dir, FULL, range(1), 20)
    resident.drop()
    assert held_weights(tmp_path / "full" / "step=0000" / "checkpoint") is None


def test_the_transformers_sampler_samples_the_held_policy_as_from_its_files(tiny_model_dir, trained):
    policy = Checkpoint(trained).policy(tiny_model_dir)
    from_files = HFSampler(tiny_model_dir, dtype=torch.bfloat16)
    requests = requests_for(from_files)
    base = from_files.sample(requests, SamplingSettings())
    from_files.use_policy(policy)
    expected = from_files.sample(requests, SamplingSettings())
    assert expected != base
    from_memory = HFSampler(tiny_model_dir, dtype=torch.bfloat16)
    (Checkpoint(trained).model / "model.safetensors").unlink()  # nothing to read back
    from_memory.use_policy(policy, held_weights(trained))
    assert from_memory.sample(requests, SamplingSettings()) == expected
    for parameter in resident._held.model.parameters():  # the next step trains the held model in place
        parameter.data.add_(1.0)
    assert from_memory.sample(requests, SamplingSettings()) == expected  # the sampler holds its own copy


def test_weights_are_handed_over_in_memory_only_where_vllm_can_load_them_in_place(tiny_model_dir):
    settings = RunSettings().changed(run={"device": "cpu"}, model={"name": str(tiny_model_dir)})
    gpu = SamplerConfig()
    assert takes_weights_in_memory(gpu, "cuda", 0, colocated=True)
    assert not takes_weights_in_memory(gpu, "cpu", 0, colocated=True)  # the CPU engine loads each policy afresh
    assert not takes_weights_in_memory(gpu, "cuda", 8, colocated=True)  # vLLM loads adapters from files only
    assert not takes_weights_in_memory(SamplerConfig(tensor_parallel_size=2), "cuda", 0, colocated=True)
    assert not takes_weights_in_memory(gpu, "cuda", 0, colocated=False)  # CUDA IPC: the trainer on the same GPU
    on_gpu = settings.changed(run={"device": "cuda"}, trainer={"lora_rank": 0})
    command = server_command(on_gpu, 8300)
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "ipc"}'
    assert server_environment(on_gpu)["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    split = on_gpu.changed(sampler={"sleep_while_training": False})  # servers on GPUs of their own
    assert "--weight-transfer-config" not in server_command(split, 8300)
    assert "--weight-transfer-config" not in server_command(settings, 8300)


@pytest.mark.vllm
def test_the_weights_sent_to_vllm_are_cast_as_the_checkpoint_writes_them(trained):
    from retool.sampling.weight_transfer import served_weights

    saved = load_file(Checkpoint(trained).model / "model.safetensors")
    source = served_weights(held_weights(trained), torch.bfloat16)
    sent = list(source)
    assert [(meta.name, meta.dtype, meta.shape) for meta in source.metadata()] == [
        (name, tensor.dtype, tuple(tensor.shape)) for name, tensor in sent
    ]
    assert len(sent) == len(saved) and all(torch.equal(tensor, saved[name]) for name, tensor in sent)


def test_qwen35_weights_are_handed_over_under_the_published_names(tmp_path):
    """transformers renames Qwen3.5's text model on saving (model.language_model.*); the held weights go to the
    engine under the same names as the files, which vLLM maps from."""
    from bench.gpu import build_tiny_qwen35

    build_tiny_qwen35(tmp_path / "base")
    train(tmp_path / "run", tmp_path / "base", FULL, range(1), 20)
    checkpoint = tmp_path / "run" / "step=0000" / "checkpoint"
    try:
        weights = held_weights(checkpoint)
    finally:
        resident.drop()
    saved = load_file(Checkpoint(checkpoint).model / "model.safetensors")
    assert sorted(weights) == sorted(saved) and all(
        name.startswith(("model.language_model.", "lm_head.")) for name in saved
    )
    assert all(torch.equal(weights[name].to(tensor.dtype), tensor) for name, tensor in saved.items())
