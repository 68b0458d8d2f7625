"""One training step, PPO or supervised (the cold start): the policy (base model + LoRA, or full
fine-tune), the clipped loss on sampled tokens (or the negative log-likelihood), gradient
accumulation over micro-batches, data parallel over torch.distributed, checkpoints.

`torchrun --nproc-per-node K -m retool.training.worker --inputs FILE` trains one step on K processes (gloo on CPU,
NCCL on GPU) under torch's data parallelism, DDP or FSDP2 (see parallel.py): each process takes every K-th
micro-batch, and the gradients are summed before the optimizer step.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy
import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.training import parallel
from retool.training.checkpoints import restore_rng
from retool.training.losses import (
    clip_band,
    importance_weights,
    k3,
    kl_to_reference,
    limited_by_correction,
    token_loss,
)
from retool.training.out_of_memory import MicroBatchPlan, out_of_memory_in, repacked
from retool.training.packing import MicroBatch, loss_token_weights, pack_micro_batches
from retool.training.record import StepMetrics
from retool.weights.checkpoint import Checkpoint, Policy

log = logging.getLogger(__name__)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_policy(base_model: Path, previous: Path | None, config: TrainerConfig, device: str = "cpu"):
    """The trainable model and its Adam optimizer, restored from the previous checkpoint if any."""
    model = load_model(base_model, previous, config, device)
    return model, optimizer_for(model, previous, config, device)


def load_model(base_model: Path, previous: Path | None, config: TrainerConfig, device: str = "cpu", on: str = ""):
    """The policy's weights from the previous checkpoint (or `base_model`) for training on `device`, made trainable;
    `on`: where they load, if not there (FSDP2 shards them from host memory)."""
    from transformers import AutoModelForCausalLM

    config.check_resolved()
    dtype = getattr(torch, config.dtype)
    policy = Checkpoint(previous).policy(base_model) if previous is not None else Policy(base_model)
    model = AutoModelForCausalLM.from_pretrained(str(policy.weights), dtype=dtype).to(on or device)
    return trainable(model, previous, config)


def prepare_policy(model, previous: Path | None, config: TrainerConfig, device: str = "cpu"):
    """A loaded model made trainable (no KV cache, checkpointing, LoRA) with its Adam optimizer."""
    model = trainable(model, previous, config)
    return model, optimizer_for(model, previous, config, device)


def trainable(model, previous: Path | None, config: TrainerConfig):
    """No KV cache, checkpointed activations, and the LoRA adapter (the previous checkpoint's, or a new one)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model.config.use_cache = False  # training never decodes: no KV cache
    if config.gradient_checkpointing:  # activations of each layer recomputed in the backward pass
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not config.lora_rank:
        return model
    if previous is not None:
        return PeftModel.from_pretrained(model, str(Checkpoint(previous).adapter), is_trainable=True)
    torch.manual_seed(config.seed)  # LoRA's A matrices start random
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def optimizer_for(model, previous: Path | None, config: TrainerConfig, device: str = "cpu"):
    """Adam over the model's trainable weights (as this process holds them: sharded under FSDP2), with the previous
    checkpoint's state and random state."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    # On CUDA one fused kernel: the default there (foreach) allocates temporaries the size of every trained weight.
    fused = {"fused": True} if device.startswith("cuda") else {}
    optimizer = torch.optim.Adam(parameters, lr=config.learning_rate, betas=(config.beta1, config.beta2), **fused)
    if previous is not None:
        parallel.restore_optimizer(model, optimizer, Checkpoint(previous).optimizer, device)
        restore_rng(Checkpoint(previous).rng)
    return optimizer


def _micro_batch_tensors(
    datums: list[Datum], batch: MicroBatch, weights: list[float], device: str
) -> dict[str, torch.Tensor]:
    """Right-padded rows; padding has mask 0 and weight 0, so it never reaches the loss. Rows are filled as numpy
    arrays (a datum read from its file holds views of the file's columns, not Python values)."""
    rows = [datums[i] for i in batch.indices]

    def padded(values, fill, dtype):
        array = numpy.full((len(rows), batch.width), fill, dtype=dtype)
        for row, value in zip(array, values, strict=True):
            row[: len(value)] = value
        return torch.from_numpy(array).to(device)

    masks = [numpy.asarray(d.loss_mask, dtype=bool) for d in rows]
    references = [d.reference_logprobs for d in rows]
    reference = {} if any(r is None for r in references) else {"reference": padded(references, 0.0, numpy.float32)}
    return {
        **reference,
        "input_ids": padded([d.input_tokens for d in rows], 0, numpy.int64),
        "attention_mask": padded([numpy.ones(d.num_tokens) for d in rows], 0, numpy.int64),
        "targets": padded([d.target_tokens for d in rows], 0, numpy.int64),
        "loss_mask": padded(masks, False, bool),
        "old_logprobs": padded([d.old_logprobs for d in rows], 0.0, numpy.float32),
        "advantages": padded([d.advantages for d in rows], 0.0, numpy.float32),
        "weights": padded([numpy.where(m, weights[i], 0.0) for i, m in zip(batch.indices, masks)], 0.0, numpy.float32),
    }


@dataclass
class PolicyPass:
    """What one pass over this process's micro-batches saw on their loss tokens, micro-batch by micro-batch."""

    logprobs: list[torch.Tensor]  # the policy's logprob of each loss token (detached)
    entropies: list[torch.Tensor]  # the entropy of its next-token distribution there
    sampler_logprobs: list[torch.Tensor]  # the sampler's logprob of the same tokens
    reference_logprobs: list[torch.Tensor] = field(default_factory=list)  # the RL base's there ([trainer] kl_coef)
    padded: list[torch.Tensor] = field(default_factory=list)  # each micro-batch's logprobs as its rows (detached)
    loss: float = 0.0  # weighted loss summed over the pass (gradient passes only)
    clipped: int = 0  # loss tokens where the PPO clip was active (gradient passes only)


def policy_pass(
    model,
    datums: list[Datum],
    batches: list[MicroBatch],
    config: TrainerConfig,
    device: str = "cpu",
    weights: list[float] | None = None,
    proximal: list[torch.Tensor] | None = None,
) -> PolicyPass:
    """One pass over this process's share of the micro-batches. With `weights` it backpropagates the
    loss (gradients add up in .grad); without, it only measures, under no_grad. `proximal`: the proximal
    policy's logprobs of each micro-batch (the `padded` of a pass over the same ones before the first update)."""
    seen = PolicyPass([], [], [])
    for position, (batch, counted, last) in enumerate(parallel.share_of_micro_batches(batches)):
        tensors = _micro_batch_tensors(datums, batch, (weights if counted else None) or [0.0] * len(datums), device)
        mask = tensors["loss_mask"]
        # FSDP2 gathers each layer's weights in bfloat16 itself (its mixed-precision policy): no autocast around it.
        in_bfloat16 = config.autocast_bfloat16 == "true" and not parallel.sharded(model)
        autocast = torch.autocast(torch.device(device).type, torch.bfloat16, enabled=in_bfloat16)
        # DDP reduces the gradients in the last backward pass only: the earlier ones accumulate locally.
        no_sync = model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext()
        with torch.set_grad_enabled(weights is not None), autocast, no_sync, out_of_memory_in(batch):
            logprobs, entropy = parallel.logprobs_of(model)(
                tensors["input_ids"],
                tensors["attention_mask"],
                tensors["targets"],
                mask,
                config.logprob_chunk_tokens,
                with_entropy=True,
                temperature=config.temperature,
            )
            seen.padded.append(logprobs.detach())
            if weights is not None:
                before = proximal[position] if proximal is not None else None
                loss, clipped = token_loss(
                    logprobs, tensors["old_logprobs"], tensors["advantages"], config, before, tensors.get("reference")
                )
                # DDP and FSDP2 average over the processes; the weights already make the sum the mini-batch's gradient.
                (loss * tensors["weights"]).sum().mul(parallel.rank_and_world()[1]).backward()
                seen.loss += float((loss.detach() * tensors["weights"]).sum())
                seen.clipped += int(clipped[mask].sum()) if counted else 0
        if not counted:
            continue
        seen.logprobs.append(logprobs.detach()[mask])
        seen.entropies.append(entropy[mask])
        seen.sampler_logprobs.append(tensors["old_logprobs"][mask])
        if "reference" in tensors:
            seen.reference_logprobs.append(tensors["reference"][mask])
    return seen


def accumulate_gradients(
    model,
    datums: list[Datum],
    batches: list[MicroBatch],
    weights: list[float],
    config: TrainerConfig,
    device: str = "cpu",
    proximal: list[torch.Tensor] | None = None,
) -> PolicyPass:
    """Backward over this process's share of the micro-batches; gradients add up in .grad."""
    return policy_pass(model, datums, batches, config, device, weights, proximal)


def drift_sums(before: PolicyPass, after: PolicyPass | None, config: TrainerConfig) -> dict[str, float]:
    """Sums over loss tokens of the step's diagnostics. Sampler vs trainer before the update: |gap| and
    the k3 estimate of KL(sampler || trainer). Before vs after the update, on tokens drawn from the policy
    before it: the k1 and k3 estimates of KL(before || after), and the tokens whose ratio after/before
    left the clip range."""
    old = torch.cat(before.logprobs) if before.logprobs else torch.zeros(0)
    sampler = torch.cat(before.sampler_logprobs) if before.logprobs else torch.zeros(0)
    gap = old - sampler if config.objective == "ppo" else torch.zeros_like(old)  # supervised data has no sampler
    sums = {
        "tokens": float(old.numel()),
        "entropy": float(torch.cat(before.entropies).sum()) if before.entropies else 0.0,
        "gap": float(gap.abs().sum()),
        "kl_sampler": float(k3(gap).sum()),
        "kl_k1": 0.0,
        "kl_k3": 0.0,
        "outside_clip": 0.0,
        "importance_weight": float(importance_weights(old, sampler, config).sum())
        if config.objective == "ppo"
        else 0.0,
        "importance_limited": float(limited_by_correction(old, sampler, config).sum()),
        "kl_reference": float(kl_to_reference(old, torch.cat(before.reference_logprobs)).sum())
        if before.reference_logprobs
        else 0.0,
    }
    if after is not None and after.logprobs:
        log_ratio = torch.cat(after.logprobs) - old  # log pi_after / pi_before
        ratio, (low, high) = torch.exp(log_ratio), clip_band(config)
        sums["kl_k1"] = float(-log_ratio.sum())
        sums["kl_k3"] = float(k3(log_ratio).sum())
        sums["outside_clip"] = float(((ratio < low) | (ratio > high)).sum())
    return sums


def mini_batches(num_datums: int, count: int) -> list[list[int]]:
    """The datums of each PPO mini-batch: every `count`-th, so that each mixes the step's groups."""
    return [members for m in range(count) if (members := list(range(m, num_datums, count)))]


def _micro_batches(chosen: list[Datum], config: TrainerConfig) -> list[MicroBatch]:
    # Micro-batches bound the padded tokens in memory at once.
    return pack_micro_batches([d.num_tokens for d in chosen], config.micro_batch_items, config.micro_batch_tokens)


def _update(
    model, optimizer, parameters, chosen, config, num_samples, device, proximal=None, plan=None
) -> tuple[PolicyPass, float]:
    """One optimizer step on the `chosen` datums; what its gradient pass saw, and the gradient norm. `plan`: the
    step's micro-batch bounds, which retry a gradient pass that runs out of memory before the optimizer steps."""
    # Each loss token's weight is fixed for the whole mini-batch first, so that summing micro-batch gradients gives
    # exactly the mini-batch's gradient.
    weights = loss_token_weights([d.loss_tokens for d in chosen], config.loss_aggregation, num_samples)

    def gradient_pass(bounds: TrainerConfig) -> PolicyPass:
        batches = _micro_batches(chosen, bounds)
        optimizer.zero_grad(set_to_none=True)
        before = repacked(proximal, batches, chosen)
        return accumulate_gradients(model, chosen, batches, weights, bounds, device, before)

    seen = plan.run(gradient_pass) if plan is not None else gradient_pass(config)
    # Clipping bounds a step that a few extreme-advantage tokens would otherwise dominate.
    grad_norm = parallel.as_number(torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return seen, grad_norm


def update_policy(
    model,
    optimizer,
    datums: list[Datum],
    config: TrainerConfig,
    num_trajectories: int,
    device: str = "cpu",
    zero_variance_groups: int = 0,
) -> StepMetrics:
    """`ppo_epochs` x `ppo_mini_batches` optimizer steps over a training step's datums (none if there are
    none), then, for PPO, a no-grad pass of the updated weights that measures how far the policy moved. A pass that
    runs out of memory is retried once in smaller micro-batches (MicroBatchPlan): a gradient pass before its
    optimizer step, so that no update is applied twice."""
    started = time.perf_counter()
    parameters = [p for p in model.parameters() if p.requires_grad]
    model.train()
    plan = MicroBatchPlan(model, optimizer, config, device)
    groups = mini_batches(len(datums), config.ppo_mini_batches)

    def measured(some: list[Datum], bounds: TrainerConfig) -> tuple[list[MicroBatch], PolicyPass]:
        batches = _micro_batches(some, bounds)  # a no-grad pass
        return batches, policy_pass(model, some, batches, bounds, device)

    # A single update sees the policy it starts from in its own gradient pass; several need a pass before them.
    single = len(groups) * config.ppo_epochs == 1
    before = None if single or not datums else plan.run(lambda bounds: measured(datums, bounds))[1]
    # Decoupled PPO's proximal policy, the one before the first update, on each mini-batch's micro-batches as its
    # updates pack them (a single update has it in its own gradient pass).
    chosen = [[datums[i] for i in members] for members in groups]
    proximal = [None] * len(groups)
    if config.correction != "none" and not single:
        proximal = [plan.run(lambda bounds, some=some: measured(some, bounds)) for some in chosen]
        proximal = [(batches, seen.padded) for batches, seen in proximal]
    # sample_mean divides by every trajectory of the step (or only those with datums): a group that carries no
    # signal still counts, so a step of mostly equal rewards moves the policy less.
    samples = max(len(datums) if config.filter_zero_variance_groups else num_trajectories, 1)
    loss, clipped, grad_norms = 0.0, 0, []
    # PPO: several optimizer steps on the same samples; the clip keeps each token's ratio to the sampling policy
    # near 1, so later mini-batches cannot move the policy far from what sampled them.
    for _ in range(config.ppo_epochs):
        for m, members in enumerate(groups):
            share = samples * len(members) / len(datums)  # sample_mean's denominator: this mini-batch's part
            seen, grad_norm = _update(model, optimizer, parameters, chosen[m], config, share, device, proximal[m], plan)
            before = before or seen
            loss, clipped = loss + seen.loss / (len(groups) * config.ppo_epochs), clipped + seen.clipped
            grad_norms.append(grad_norm)
    # The updated policy, measured on the same tokens: how far the step moved it (KL, ratios outside the clip).
    after = plan.run(lambda bounds: measured(datums, bounds))[1] if config.objective == "ppo" and datums else None
    whole = _micro_batches(datums, plan.config)  # as the step ended (smaller after an out-of-memory retry)
    sums = parallel.summed_over_processes(
        {"loss": loss, "clipped": clipped, **drift_sums(before or PolicyPass([], [], []), after, config)}, device
    )
    seconds = time.perf_counter() - started
    metrics = _step_metrics(datums, whole, sums, grad_norms, config, seconds, num_trajectories, zero_variance_groups)
    return replace(metrics, oom_retries=plan.retries)


def _step_metrics(
    datums: list[Datum],
    whole: list[MicroBatch],
    sums: dict[str, float],
    grad_norms: list[float],
    config: TrainerConfig,
    seconds: float,
    num_trajectories: int,
    zero_variance_groups: int,
) -> StepMetrics:
    """The step's record from the sums over every process's loss tokens."""
    tokens, real_tokens = max(sums["tokens"], 1.0), sum(d.num_tokens for d in datums)
    return StepMetrics(
        datums=len(datums),
        trajectories=num_trajectories,
        zero_variance_groups=zero_variance_groups,
        updates=len(grad_norms),
        loss_tokens=int(sums["tokens"]),
        tokens=real_tokens,
        padded_tokens=sum(b.padded_tokens for b in whole),
        micro_batches=len(whole),
        loss=sums["loss"],
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        clip_fraction=sums["clipped"] / (tokens * config.ppo_epochs),
        logprob_gap=sums["gap"] / tokens,
        kl_sampler_trainer=sums["kl_sampler"] / tokens,
        entropy=sums["entropy"] / tokens,
        kl_k1=sums["kl_k1"] / tokens,
        kl_k3=sums["kl_k3"] / tokens,
        ratio_outside_clip=sums["outside_clip"] / tokens,
        importance_weight=sums["importance_weight"] / tokens if sums["tokens"] else 1.0,
        importance_limited=sums["importance_limited"] / tokens,
        kl_reference=sums["kl_reference"] / tokens,
        seconds=seconds,
        tokens_per_second=real_tokens / seconds if seconds > 0 else 0.0,
        skipped=not datums,
    )
