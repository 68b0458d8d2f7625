"""The memory plan's arithmetic on a known shape, and its refusal."""

from __future__ import annotations

from dataclasses import replace

import pytest

from retool.config.trainer import TrainerConfig
from retool.training.memory_plan import (
    ALLOCATOR_MARGIN,
    MemoryPlan,
    MemoryPlanError,
    ModelShape,
    check_plan,
    model_shape,
    plan_step,
    sharded_fit,
)


def test_the_shape_of_the_tiny_model_is_counted_without_loading_it(tiny_model_dir):
    shape = model_shape(tiny_model_dir)
    # Per layer, in + out features of q (64->64), k and v (64->32), o (64->64), gate and up (64->128), down (128->64).
    assert shape.lora_parameters == 2 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert (shape.layers, shape.hidden_size, shape.intermediate_size) == (2, 64, 128)
    embedding = shape.vocab_size * 64  # tied with the output layer
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64
    assert shape.parameters == embedding + 2 * per_layer + 64


def test_the_plan_adds_weights_state_activations_and_logits():
    shape = ModelShape(
        parameters=4_000_000_000,
        lora_parameters=10_000_000,
        layers=32,
        hidden_size=2560,
        intermediate_size=9216,
        vocab_size=248_320,
    )
    config = TrainerConfig(lora_rank=32, micro_batch_tokens=8192, logprob_chunk_tokens=1024).on("cuda")
    plan = plan_step(shape, config)  # dtype auto on CUDA: bfloat16
    assert plan.weights == 8_000_000_000
    assert plan.trainable_state == 10_000_000 * 32 * 16
    one_layer = 2 * 8192 * 2 * (6 * 2560 + 4 * 9216)
    assert plan.activations == 32 * 8192 * 2560 * 2 + one_layer
    assert plan.logits == 3 * 1024 * 248_320 * 4
    assert plan.total == int((plan.weights + plan.trainable_state + plan.activations + plan.logits) * ALLOCATOR_MARGIN)
    without_checkpointing = plan_step(shape, TrainerConfig(gradient_checkpointing=False).on("cuda"))
    assert without_checkpointing.activations == 32 * 2 * 16384 * 2 * (6 * 2560 + 4 * 9216)
    full = plan_step(shape, TrainerConfig(lora_rank=0, autocast_bfloat16="false").on("cpu"))  # float32 on a CPU
    assert full.weights == 16_000_000_000 and full.trainable_state == 3 * 16_000_000_000
    # A full fine-tune on a GPU: float32 master weights, gradients and Adam moments, autocast's bfloat16 copy of
    # every weight, products in bfloat16 and the residual stream (each layer's saved input) in float32.
    mixed = plan_step(shape, TrainerConfig(lora_rank=0, micro_batch_tokens=8192).on("cuda"))
    assert mixed.weights == 16_000_000_000 + 8_000_000_000 and mixed.trainable_state == 3 * 16_000_000_000
    assert mixed.activations == 32 * 8192 * 2560 * 4 + one_layer
    # Eight processes: FSDP2 (auto for a full fine-tune) keeps an eighth of the weights and state, and two layers
    # whole, gathered in bfloat16, its residual stream bfloat16; DDP a whole copy in each.
    sharded = plan_step(shape, TrainerConfig(lora_rank=0, micro_batch_tokens=8192).on("cuda"), processes=8)
    assert sharded.weights == 16_000_000_000 // 8 + 2 * 8_000_000_000 // 32
    assert sharded.trainable_state == 3 * 16_000_000_000 // 8
    assert sharded.activations == plan.activations
    copies = plan_step(shape, TrainerConfig(lora_rank=0, micro_batch_tokens=8192, data_parallel="ddp").on("cuda"), 8)
    assert (copies.weights, copies.trainable_state) == (mixed.weights, mixed.trainable_state)


def test_a_step_that_does_not_fit_is_refused_naming_the_settings():
    plan = MemoryPlan(weights=2**30, trainable_state=0, activations=2**30, logits=0)
    check_plan(plan, 3 * 2**30)
    with pytest.raises(MemoryPlanError, match="lower \\[trainer\\] micro_batch_tokens"):
        check_plan(plan, 2 * 2**30)


def test_a_full_fine_tune_that_one_gpu_cannot_hold_is_refused_with_the_gpus_fsdp2_needs():
    """Qwen3.5-4B's shape in float32 with Adam on one 80 GB GPU (about 72 GiB free beside a sleeping sampler)."""
    shape = ModelShape(4_200_000_000, 10_000_000, 32, 2560, 9216, 248_320)
    config = TrainerConfig(lora_rank=0, micro_batch_tokens=8192).on("cuda")
    free = 72 * 2**30
    assert plan_step(shape, config).total > free
    advice = sharded_fit(shape, config, 1, free)
    assert (
        "[run] train_processes = 2 " in advice
        and plan_step(shape, replace(config, data_parallel="fsdp"), 2).total <= free
    )
    with pytest.raises(MemoryPlanError, match="shard it with FSDP2 over 2 GPUs, .* GiB .* each"):
        check_plan(plan_step(shape, config), free, advice)
    assert sharded_fit(shape, replace(config, lora_rank=32), 1, free) == ""  # a LoRA: the other settings


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_trainable_state_planned_is_what_adam_and_the_gradients_allocate(tiny_model_dir, lora_rank):
    """After one step of the project's own optimizer, the trained weights' gradients and Adam moments (and a LoRA's
    own weights) take the bytes the plan counts."""
    import torch

    from retool.training.step import load_model, optimizer_for

    config = TrainerConfig(lora_rank=lora_rank, gradient_checkpointing=False, autocast_bfloat16="false").on("cpu")
    model = load_model(tiny_model_dir, None, config, "cpu")
    optimizer = optimizer_for(model, None, config, "cpu")
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    trained = [p for p in model.parameters() if p.requires_grad]
    allocated = sum(p.grad.nbytes for p in trained) + sum(
        value.nbytes for state in optimizer.state.values() for name, value in state.items() if name != "step"
    )
    if lora_rank:
        allocated += sum(p.nbytes for p in trained)  # the adapter's own weights, which the plan counts here
    # Gradients and two moments of every trained weight (the tied output layer once); a LoRA's adapters of every
    # linear layer but the output layer, in float32.
    assert allocated == plan_step(model_shape(tiny_model_dir), config).trainable_state
