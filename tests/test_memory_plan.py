"""The memory plan's arithmetic on a known shape, and its refusal."""

from __future__ import annotations

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
    # every weight, and activations in bfloat16.
    mixed = plan_step(shape, TrainerConfig(lora_rank=0, micro_batch_tokens=8192).on("cuda"))
    assert mixed.weights == 16_000_000_000 + 8_000_000_000 and mixed.trainable_state == 3 * 16_000_000_000
    assert mixed.activations == plan.activations
    # Eight processes: FSDP2 (auto for a full fine-tune) keeps an eighth of the weights and state, and two layers
    # whole with their bfloat16 casts; DDP a whole copy in each.
    sharded = plan_step(shape, TrainerConfig(lora_rank=0, micro_batch_tokens=8192).on("cuda"), processes=8)
    assert sharded.weights == 16_000_000_000 // 8 + 2 * 24_000_000_000 // 32
    assert sharded.trainable_state == 3 * 16_000_000_000 // 8
    copies = plan_step(shape, TrainerConfig(lora_rank=0, micro_batch_tokens=8192, data_parallel="ddp").on("cuda"), 8)
    assert (copies.weights, copies.trainable_state) == (mixed.weights, mixed.trainable_state)


def test_a_step_that_does_not_fit_is_refused_naming_the_settings():
    plan = MemoryPlan(weights=2**30, trainable_state=0, activations=2**30, logits=0)
    check_plan(plan, 3 * 2**30)
    with pytest.raises(MemoryPlanError, match="lower \\[trainer\\] micro_batch_tokens"):
        check_plan(plan, 2 * 2**30)
