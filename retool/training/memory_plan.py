"""What one training step needs on the GPU, estimated before the model is loaded: the weights, the
trainable state, the activations of one micro-batch and the output layer's logits chunk, against
the memory free beside the sampler. A step that cannot fit is refused with the setting to change."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from retool.config.trainer import TrainerConfig

GIB = 2**30
MIB = 2**20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ALLOCATOR_MARGIN = 1.10  # the caching allocator's fragmentation and the kernels' workspaces


@dataclass(frozen=True)
class ModelShape:
    parameters: int  # every weight of the model
    lora_parameters: int  # the weights a LoRA of rank 1 adds to every linear layer but the output layer
    layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int


@dataclass(frozen=True)
class MemoryPlan:
    weights: int  # bytes of the model's weights in the training dtype (and autocast's bfloat16 copies of them)
    # The trained weights' gradients and Adam moments (and LoRA's own weights); Adam is fused on CUDA, so no
    # temporary the size of every trained weight (its default there, foreach, would add one: 16 GiB at 4B float32).
    trainable_state: int
    activations: int  # of one micro-batch, at the peak of its backward pass
    logits: int  # one chunk of output-layer logits, their softmax and its gradient, in float32

    @property
    def total(self) -> int:
        return int((self.weights + self.trainable_state + self.activations + self.logits) * ALLOCATOR_MARGIN)

    def describe(self) -> str:
        parts = ("weights", "trainable_state", "activations", "logits")
        unit, size = ("GiB", GIB) if self.total >= GIB else ("MiB", MIB)  # a small model's figures in MiB
        figures = ", ".join(f"{p} {getattr(self, p) / size:.1f}" for p in parts)
        return f"{self.total / size:.1f} {unit} ({figures})"


def model_shape(model_dir: Path) -> ModelShape:
    """The shape of a model folder's architecture (no weights are read)."""
    from transformers import AutoConfig

    return shape_of(AutoConfig.from_pretrained(str(model_dir)))


def shape_of(config) -> ModelShape:
    """The shape of the causal LM a transformers config describes, counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    output_layer = model.get_output_embeddings()
    lora = sum(
        module.in_features + module.out_features
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not output_layer
    )
    text = getattr(config, "text_config", config)
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        lora_parameters=lora,
        layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size,
    )


def plan_step(shape: ModelShape, config: TrainerConfig, processes: int = 1) -> MemoryPlan:
    """The estimate for one micro-batch of `micro_batch_tokens` (padding included) under `config`, in each of
    `processes` training processes (FSDP2 shares the weights and the trained state out among them)."""
    config.check_resolved()
    size = DTYPE_BYTES[config.dtype]
    compute = DTYPE_BYTES["bfloat16"] if config.autocast_bfloat16 == "true" else size
    weights = shape.parameters * size
    if config.lora_rank:
        # PEFT keeps adapter weights in float32: weight, gradient and two Adam moments.
        trainable = shape.lora_parameters * config.lora_rank * 4 * 4
    else:
        trainable = shape.parameters * size * 3  # gradient and two Adam moments in the weights' dtype
    sharded = processes > 1 and config.data_parallel == "fsdp"
    # The residual stream between layers (each layer's saved input): in the weights' dtype under autocast, whose
    # sums of float32 and bfloat16 stay float32; in bfloat16 where FSDP2 gathers the weights so.
    residual = compute if sharded else size
    if sharded:
        # Each process holds 1/K of every weight and of the trained state, and two layers whole at a time (one
        # prefetched), gathered in the products' dtype (parallel.mixed_precision).
        weights, trainable = (
            weights // processes + 2 * shape.parameters * compute // shape.layers,
            trainable // processes,
        )
    elif compute < size and not config.lora_rank:
        weights += shape.parameters * compute  # autocast's bfloat16 copy of each weight, cached for the backward pass
    tokens = config.micro_batch_tokens
    # One layer's forward and backward intermediates: attention projections and output, the MLP's gate,
    # up and product, norms, and their gradients (about twice the forward's).
    one_layer = 2 * tokens * compute * (6 * shape.hidden_size + 4 * shape.intermediate_size)
    if config.gradient_checkpointing:
        activations = shape.layers * tokens * shape.hidden_size * residual + one_layer  # saved inputs, one recomputed
    else:
        activations = shape.layers * one_layer
    logits = 3 * min(config.logprob_chunk_tokens, tokens) * shape.vocab_size * 4
    return MemoryPlan(weights, trainable, activations, logits)


class MemoryPlanError(RuntimeError):
    """A training step would not fit in the GPU memory that is free."""


class TrainerOutOfMemoryError(MemoryPlanError):
    """A training step ran out of memory again after its micro-batches were made smaller (or, among several
    training processes, once: one cannot retry alone)."""


def datum_count(count: int) -> str:
    return f"{count} datum" + ("" if count == 1 else "s")


def micro_batch_bounds(config: TrainerConfig) -> str:
    return f"{datum_count(config.micro_batch_items)} / {config.micro_batch_tokens} padded tokens"


def smaller_micro_batches(config: TrainerConfig, items: int, padded_tokens: int) -> TrainerConfig:
    """`config` with micro-batches half the size of one of `items` datums and `padded_tokens` that ran out of memory
    (half the bounds, where those are smaller); a datum longer than the token bound still gets one of its own."""
    return replace(
        config,
        micro_batch_items=max(1, min(config.micro_batch_items, items) // 2),
        micro_batch_tokens=max(1, min(config.micro_batch_tokens, padded_tokens) // 2),
    )


def out_of_memory_advice(plan: MemoryPlan, config: TrainerConfig) -> str:
    """The memory plan at the micro-batch bounds that ran out of memory, and the settings that lower it."""
    return (
        f"memory plan at {micro_batch_bounds(config)} per micro-batch: {plan.describe()}: lower [trainer] "
        "micro_batch_tokens (activations) or logprob_chunk_tokens (logits), keep gradient_checkpointing on, train a "
        "LoRA (lora_rank > 0), or shorten [rollout] max_trajectory_tokens (a datum is never split)"
    )


def check_plan(plan: MemoryPlan, free_bytes: int, sharding: str = "") -> None:
    """Refuses a plan above `free_bytes`, naming the settings that lower it (and `sharding`: see sharded_fit)."""
    if plan.total > free_bytes:
        raise MemoryPlanError(
            f"one training step needs about {plan.describe()}, but {free_bytes / GIB:.1f} GiB of GPU memory is "
            "free: lower [trainer] micro_batch_tokens (activations) or logprob_chunk_tokens (logits), keep "
            "gradient_checkpointing on, train a LoRA (lora_rank > 0) rather than every weight, or give the "
            f"sampler less with [sampler] gpu_memory_utilization{sharding}"
        )


def sharded_fit(shape: ModelShape, config: TrainerConfig, processes: int, free_bytes: int) -> str:
    """For a full fine-tune that does not fit in `processes` GPUs: the fewest GPUs whose FSDP2 shards fit in as much
    free memory each, as a clause of the refusal ("" for a LoRA, or where no node of up to 64 GPUs would do)."""
    if config.lora_rank:
        return ""
    for gpus in (2, 4, 8, 16, 32, 64):
        plan = plan_step(shape, replace(config, data_parallel="fsdp"), gpus)
        if gpus > processes and plan.total <= free_bytes:
            return (
                f"; or shard it with FSDP2 over {gpus} GPUs, {plan.describe()} each: [run] train_processes = {gpus} "
                "with [trainer] data_parallel = auto"
            )
    return ""


def check_memory(base_model: Path, config: TrainerConfig, device: str, processes: int = 1) -> None:
    """On a GPU, before the model loads: the step's memory plan, printed, and refused when it does not fit the
    memory free now (beside the sampler, which sleeps while a step trains)."""
    if device.startswith("cuda"):
        import torch

        shape = model_shape(base_model)
        plan = plan_step(shape, config, processes)
        print(f"memory plan of the training step: {plan.describe()}", flush=True)
        free = torch.cuda.mem_get_info()[0]
        check_plan(plan, free, sharded_fit(shape, config, processes, free))
