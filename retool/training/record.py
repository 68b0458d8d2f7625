"""The record of one training step, as the trainer returns it and metrics.json keeps it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepMetrics:
    datums: int
    trajectories: int  # trajectories of the step, datums or not
    zero_variance_groups: int  # questions whose group got equal rewards (no learning signal)
    updates: int  # optimizer steps taken
    loss_tokens: int  # sampled tokens the loss saw
    tokens: int  # real tokens of all datums
    padded_tokens: int  # tokens processed, padding included
    micro_batches: int
    loss: float
    grad_norm: float
    clip_fraction: float  # loss tokens where the clip was active, over every update
    # mean |trainer - sampler logprob| on loss tokens, under the checkpoint that sampled them (NaN: a step sampled by
    # an older checkpoint, [rollout] max_staleness, without the sampler-gap check, which alone takes that pass)
    logprob_gap: float
    kl_sampler_trainer: float  # k3 estimate of KL(sampler || trainer before the update) on loss tokens
    entropy: float  # mean entropy (nats) of the policy's next-token distribution on loss tokens, before the update
    kl_k1: float  # KL(policy before || after the update), k1 estimate on the loss tokens (PPO only)
    kl_k3: float  # the same KL, k3 estimate (never negative)
    ratio_outside_clip: float  # loss tokens whose ratio after/before the update left the clip range (PPO only)
    seconds: float
    tokens_per_second: float
    skipped: bool  # no datum: no optimizer step was taken
    # The off-policy correction ([trainer] correction) on the loss tokens: the mean importance weight it applied
    # (1 without one), and the share of tokens whose weight it truncated (tis) or dropped (mis)
    importance_weight: float = 1.0
    importance_limited: float = 0.0
    # k3 estimate of KL(policy before the update || RL base) on the loss tokens ([trainer] kl_coef > 0; 0 without)
    kl_reference: float = 0.0
    # Passes retried in smaller micro-batches after running out of memory (at most 1: a second time fails the step)
    oom_retries: int = 0


def describe_metrics(metrics: StepMetrics) -> str:
    """The update's line in the log."""
    if metrics.skipped:
        return f"no datums ({metrics.zero_variance_groups} groups, all with equal rewards): update skipped"
    return (
        f"{metrics.datums} datums ({metrics.zero_variance_groups} zero-variance groups), {metrics.loss_tokens} loss "
        f"tokens, {metrics.micro_batches} micro-batches "
        f"({metrics.padded_tokens / max(metrics.tokens, 1):.2f} padded/real), loss {metrics.loss:+.4f}, grad norm "
        f"{metrics.grad_norm:.3f}, "
        f"clip {metrics.clip_fraction:.3f}, sampler gap {metrics.logprob_gap:.2e}, importance weight "
        f"{metrics.importance_weight:.3f} ({metrics.importance_limited:.3f} limited), "
        f"{metrics.tokens_per_second:.0f} tokens/s"
        + (", retried once in smaller micro-batches after running out of memory" if metrics.oom_retries else "")
    )
