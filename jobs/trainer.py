"""One training step, PPO or supervised (the cold start): the policy (base model + LoRA, or full
fine-tune), the clipped loss on sampled tokens (or the negative log-likelihood), gradient
accumulation over micro-batches, data parallel over torch.distributed, checkpoints.

`torchrun --nproc-per-node K -m jobs.trainer ...` trains one step on K processes (gloo on CPU, NCCL on
GPU); each process takes every K-th micro-batch and gradients are summed before the optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from jobs.checkpoints import restore_rng, save_checkpoint
from jobs.datums import Datum
from jobs.memory_plan import check_plan, model_shape, plan_step
from jobs.packing import MicroBatch, loss_token_weights, pack_micro_batches
from jobs.trainer_config import StepMetrics, TrainerConfig, resolved_dtype


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_policy(base_model: Path, previous: Path | None, config: TrainerConfig, device: str = "cpu"):
    """The trainable model and its Adam optimizer, restored from the previous checkpoint if any."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, resolved_dtype(config.dtype, device))
    weights = previous / "model" if previous is not None and config.lora_rank == 0 else base_model
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=dtype).to(device)
    return prepare_policy(model, previous, config, device)


def prepare_policy(model, previous: Path | None, config: TrainerConfig, device: str = "cpu"):
    """A loaded model made trainable (no KV cache, checkpointing, LoRA) with its Adam optimizer."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model.config.use_cache = False  # training never decodes: no KV cache
    if config.gradient_checkpointing:  # activations of each layer recomputed in the backward pass
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora_rank:
        if previous is not None:
            model = PeftModel.from_pretrained(model, str(previous / "adapter"), is_trainable=True)
        else:
            torch.manual_seed(config.seed)  # LoRA's A matrices start random
            lora = LoraConfig(
                r=config.lora_rank,
                lora_alpha=config.lora_alpha,
                lora_dropout=0.0,
                target_modules="all-linear",
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, lora)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=config.learning_rate, betas=(config.beta1, config.beta2))
    if previous is not None:
        optimizer.load_state_dict(torch.load(previous / "optimizer.pt", map_location=device, weights_only=True))
        restore_rng(previous / "rng.pt")
    return model, optimizer


def _micro_batch_tensors(
    datums: list[Datum], batch: MicroBatch, weights: list[float], device: str
) -> dict[str, torch.Tensor]:
    """Right-padded rows; padding has mask 0 and weight 0, so it never reaches the loss."""
    rows = [datums[i] for i in batch.indices]
    width = batch.width

    def padded(values, fill, dtype):
        return torch.tensor([list(v) + [fill] * (width - len(v)) for v in values], dtype=dtype, device=device)

    return {
        "input_ids": padded([d.input_tokens for d in rows], 0, torch.long),
        "attention_mask": padded([[1] * d.num_tokens for d in rows], 0, torch.long),
        "targets": padded([d.target_tokens for d in rows], 0, torch.long),
        "old_logprobs": padded([d.old_logprobs for d in rows], 0.0, torch.float32),
        "advantages": padded([d.advantages for d in rows], 0.0, torch.float32),
        "weights": padded(
            [[weights[i] if m else 0.0 for m in datums[i].loss_mask] for i in batch.indices], 0.0, torch.float32
        ),
    }


def _target_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(lm_head(hidden).float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    where: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Logprob of each target; with `where`, only at those positions (0 elsewhere): the output layer
    and its softmax over the whole vocabulary then run on the loss tokens alone, which on a small
    model is most of the step's cost, `chunk_tokens` at a time. Under autograd each chunk's logits
    are recomputed in the backward pass rather than kept, so no [loss tokens x vocabulary] tensor of
    a whole micro-batch is ever alive (a 248k vocabulary makes that gigabytes)."""
    if where is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT injects LoRA in place
    hidden = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden, chosen = hidden[where], targets[where]
    pieces = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        chunk = (causal_lm.lm_head, hidden[start : start + chunk_tokens], chosen[start : start + chunk_tokens])
        if torch.is_grad_enabled():
            pieces.append(torch.utils.checkpoint.checkpoint(_target_logprobs, *chunk, use_reentrant=False))
        else:
            pieces.append(_target_logprobs(*chunk))
    selected = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    return torch.zeros(targets.shape, dtype=selected.dtype, device=selected.device).masked_scatter(where, selected)


def ppo_token_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, config: TrainerConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss and where clipping was active. With TIS, the ratio is taken
    against the trainer's own (detached) logprobs and each token is reweighted by the capped
    trainer/sampler ratio, correcting for the sampler's numerical drift."""
    if config.tis_cap > 0:
        ratio = torch.exp(logprobs - logprobs.detach())
        correction = torch.clamp(torch.exp(logprobs.detach() - old_logprobs), max=config.tis_cap)
    else:
        ratio = torch.exp(logprobs - old_logprobs)
        correction = torch.ones_like(ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages) * correction
    clipped = (ratio * advantages > clipped_ratio * advantages).detach()
    return loss, clipped


def token_loss(
    logprobs: torch.Tensor, tensors: dict[str, torch.Tensor], config: TrainerConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of the configured objective, and where PPO clipping was active."""
    if config.objective == "sft":
        return -logprobs, torch.zeros_like(logprobs, dtype=torch.bool)
    return ppo_token_loss(logprobs, tensors["old_logprobs"], tensors["advantages"], config)


def accumulate_gradients(
    model,
    datums: list[Datum],
    batches: list[MicroBatch],
    weights: list[float],
    config: TrainerConfig,
    device: str = "cpu",
) -> torch.Tensor:
    """Backward over this process's share of the micro-batches; gradients add up in .grad. Returns
    sums over its loss tokens: loss, clipped tokens, |logprob gap|, k3 KL, loss tokens (the gap and
    KL against the sampler's logprobs, which supervised data does not have: 0 for sft)."""
    rank, world = _rank_and_world()
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    for batch in batches[rank::world]:
        tensors = _micro_batch_tensors(datums, batch, weights, device)
        mask = tensors["weights"] > 0
        logprobs = token_logprobs(
            model,
            tensors["input_ids"],
            tensors["attention_mask"],
            tensors["targets"],
            mask,
            config.logprob_chunk_tokens,
        )
        loss, clipped = token_loss(logprobs, tensors, config)
        (loss * tensors["weights"]).sum().backward()
        sampled = logprobs.detach() if config.objective == "ppo" else tensors["old_logprobs"]
        log_ratio = (sampled - tensors["old_logprobs"])[mask]
        totals += torch.stack(
            [
                (loss.detach() * tensors["weights"]).sum(),
                clipped[mask].sum(),
                log_ratio.abs().sum(),
                (torch.exp(log_ratio) - 1 - log_ratio).sum(),
                mask.sum(),
            ]
        ).to(totals)
    return totals


def train_step(
    model,
    optimizer,
    datums: list[Datum],
    config: TrainerConfig,
    num_trajectories: int,
    device: str = "cpu",
    zero_variance_groups: int = 0,
) -> StepMetrics:
    """Exactly one optimizer step over all datums of a training step (none if there are none)."""
    started = time.perf_counter()
    parameters = [p for p in model.parameters() if p.requires_grad]
    batches = (
        pack_micro_batches([d.num_tokens for d in datums], config.micro_batch_items, config.micro_batch_tokens)
        if datums
        else []
    )
    num_samples = len(datums) if config.filter_zero_variance_groups else num_trajectories
    weights = loss_token_weights([d.loss_tokens for d in datums], config.loss_aggregation, max(num_samples, 1))
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = accumulate_gradients(model, datums, batches, weights, config, device)
    if _rank_and_world()[1] > 1:
        for parameter in parameters:
            if parameter.grad is None:  # this process had no micro-batch
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    grad_norm = 0.0
    if datums:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    loss_tokens = int(totals[4])
    real_tokens = sum(d.num_tokens for d in datums)
    return StepMetrics(
        datums=len(datums),
        trajectories=num_trajectories,
        zero_variance_groups=zero_variance_groups,
        loss_tokens=loss_tokens,
        tokens=real_tokens,
        padded_tokens=sum(b.padded_tokens for b in batches),
        micro_batches=len(batches),
        loss=float(totals[0]),
        grad_norm=grad_norm,
        clip_fraction=float(totals[1]) / max(loss_tokens, 1),
        logprob_gap=float(totals[2]) / max(loss_tokens, 1),
        kl_sampler_trainer=float(totals[3]) / max(loss_tokens, 1),
        seconds=seconds,
        tokens_per_second=real_tokens / seconds if seconds > 0 else 0.0,
        skipped=not datums,
    )


# -- checkpoints -------------------------------------------------------------------------------------


# -- one step from files, in-process or under torchrun ------------------------------------------------


def train_from_files(
    base_model: Path,
    datums: list[Datum],
    num_trajectories: int,
    previous: Path | None,
    out: Path,
    config: TrainerConfig,
    device: str = "cpu",
    zero_variance_groups: int = 0,
) -> StepMetrics:
    if previous is None:
        set_seed(config.seed)
    if device.startswith("cuda"):
        plan = plan_step(model_shape(base_model), config, device)
        print(f"memory plan of the training step: {plan.describe()}", flush=True)
        check_plan(plan, torch.cuda.mem_get_info()[0])
    model, optimizer = load_policy(base_model, previous, config, device)
    try:
        metrics = train_step(model, optimizer, datums, config, num_trajectories, device, zero_variance_groups)
        check_policy_sync(metrics, config, previous or base_model)
        if _rank_and_world()[0] == 0:
            save_checkpoint(out, model, optimizer, metrics, config, base_model)
    finally:
        del model, optimizer
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # the sampler in this process gets the memory back
    return metrics


class PolicySyncError(RuntimeError):
    """The sampler's logprobs are not the trained policy's: it sampled from other weights."""


def check_policy_sync(metrics: StepMetrics, config: TrainerConfig, policy: Path) -> None:
    """Before anything is saved: the trainer's logprobs of the sampled tokens, under the policy the
    sampler was given, must match the sampler's own within `max_sampler_gap` (mean absolute gap)."""
    if config.objective != "ppo" or not config.max_sampler_gap or not metrics.loss_tokens:
        return
    if metrics.logprob_gap > config.max_sampler_gap:
        raise PolicySyncError(
            f"the sampler does not serve the trained policy {policy}: its logprobs of the {metrics.loss_tokens} "
            f"sampled tokens differ from the trainer's by {metrics.logprob_gap:.3g} on average "
            f"(KL {metrics.kl_sampler_trainer:.3g}), "
            f"over max_sampler_gap = {config.max_sampler_gap:g}. The sampler loaded other weights (a skipped LoRA "
            "adapter, a stale in-place reload, another dtype); nothing was saved"
        )


def main() -> None:
    from jobs.stages.rollout import datums_from_table
    from jobs.tables import DATUMS, read_table

    parser = argparse.ArgumentParser(
        description="Train one PPO step from a datums file (run under torchrun for data parallel)."
    )
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--datums", type=Path, required=True)
    parser.add_argument(
        "--trajectories", type=int, required=True, help="trajectories in the step (sample_mean denominator)"
    )
    parser.add_argument("--zero-variance-groups", type=int, default=0, help="recorded in the metrics")
    parser.add_argument("--previous", type=Path, help="checkpoint of the step before, if any")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True, help="JSON of TrainerConfig fields")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "WORLD_SIZE" in os.environ:
        if device == "cuda":  # before the process group, so that NCCL binds each rank to its own GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    config = TrainerConfig(**json.loads(args.config.read_text()))
    datums = datums_from_table(read_table(args.datums, DATUMS))
    train_from_files(
        args.base_model, datums, args.trajectories, args.previous, args.out, config, device, args.zero_variance_groups
    )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
