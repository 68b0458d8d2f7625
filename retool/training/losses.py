"""Per-token quantities of the policy: the logprob of each target, the entropy of the distribution it was
drawn from, and the loss of each objective (PPO-clip on sampled tokens, or the negative log-likelihood)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from retool.config.trainer import TrainerConfig


def _target_logprobs_and_entropy(
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.log_softmax(lm_head(hidden).float() / temperature, dim=-1)
    with torch.no_grad():  # a diagnostic: no gradient flows through the entropy
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    where: torch.Tensor | None = None,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target (and, `with_entropy`, the entropy of the next-token distribution there) under
    the distribution the sampler drew from, logits / `temperature` (the behaviour policy of PPO's ratio);
    with `where`, only at those positions (0 elsewhere): the output layer and its softmax over the whole
    vocabulary then run on the loss tokens alone, which on a small model is most of the step's cost,
    `chunk_tokens` at a time. Under autograd each chunk's logits are recomputed in the backward pass rather
    than kept, so no [loss tokens x vocabulary] tensor of a whole micro-batch is ever alive (a 248k
    vocabulary makes that gigabytes)."""
    if where is None:
        where = torch.ones_like(targets, dtype=torch.bool)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT injects LoRA in place
    hidden = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden, chosen = hidden[where], targets[where]
    logprob_pieces, entropy_pieces = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        chunk = (
            causal_lm.lm_head,
            hidden[start : start + chunk_tokens],
            chosen[start : start + chunk_tokens],
            temperature,
        )
        if torch.is_grad_enabled():
            logprobs, entropy = torch.utils.checkpoint.checkpoint(
                _target_logprobs_and_entropy, *chunk, use_reentrant=False
            )
        else:
            logprobs, entropy = _target_logprobs_and_entropy(*chunk)
        logprob_pieces.append(logprobs)
        entropy_pieces.append(entropy)

    def scattered(pieces: list[torch.Tensor]) -> torch.Tensor:
        selected = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
        return torch.zeros(targets.shape, dtype=selected.dtype, device=selected.device).masked_scatter(where, selected)

    logprobs = scattered(logprob_pieces)
    return (logprobs, scattered(entropy_pieces)) if with_entropy else logprobs


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || q) on tokens drawn from p, `log_ratio` = log q - log p: r - 1 - log r.
    Never negative and unbiased; its gradient in log q is r - 1."""
    return torch.exp(log_ratio) - 1 - log_ratio


def clip_band(config: TrainerConfig) -> tuple[float, float]:
    """PPO's range for the ratio of the policy to the one the clip keeps it near: [1 - clip_low, 1 + clip_high]."""
    return 1.0 - config.clip_low, 1.0 + config.clip_high


def corrected(weight: torch.Tensor, config: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's importance weight under [trainer] correction, and whether the correction limited it: truncated
    at correction_cap (tis), or 0 outside [correction_floor, correction_cap] (mis); 1 without a correction."""
    if config.correction == "tis":
        return torch.clamp(weight, max=config.correction_cap), weight > config.correction_cap
    if config.correction == "mis":
        inside = (weight >= config.correction_floor) & (weight <= config.correction_cap)
        return torch.where(inside, weight, torch.zeros_like(weight)), ~inside
    return torch.ones_like(weight), torch.zeros_like(weight, dtype=torch.bool)


def importance_weights(proximal: torch.Tensor, behaviour: torch.Tensor, config: TrainerConfig) -> torch.Tensor:
    """Each token's weight in decoupled PPO: the proximal policy's probability of it over the behaviour policy's
    (the sampler's), as the correction bounds it (`corrected`)."""
    return corrected(torch.exp(proximal - behaviour), config)[0]


def limited_by_correction(proximal: torch.Tensor, behaviour: torch.Tensor, config: TrainerConfig) -> torch.Tensor:
    """The tokens whose importance weight the correction truncated (tis) or dropped (mis)."""
    return corrected(torch.exp(proximal - behaviour), config)[1]


def ppo_token_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    config: TrainerConfig,
    proximal: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss and where clipping was active. Without a correction, PPO: the ratio of
    the policy to the behaviour policy that sampled the tokens (`behaviour`: the sampler's logprobs). With one
    (decoupled PPO), the ratio is to the proximal policy, the trainer's own before the step's first update
    (`proximal`; None: the policy being trained, when the step takes one update), which the clip keeps each
    update near; the gap between proximal and behaviour policy (an older checkpoint, or the sampler's numerical
    drift) is corrected by importance weights instead, bounded so that rare tokens cannot dominate."""
    if config.correction == "none":
        ratio, weight = torch.exp(logprobs - behaviour), torch.ones_like(logprobs)
    else:
        proximal = logprobs.detach() if proximal is None else proximal
        ratio, weight = torch.exp(logprobs - proximal), importance_weights(proximal, behaviour, config)
    clipped_ratio = torch.clamp(ratio, *clip_band(config))
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages) * weight
    clipped = (ratio * advantages > clipped_ratio * advantages).detach()
    return loss, clipped


def kl_to_reference(logprobs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) on tokens the policy sampled, r = reference / policy; its
    gradient in the policy's logprob, 1 - r, pulls each token's logprob toward the reference's."""
    return k3(reference - logprobs)


def token_loss(
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    config: TrainerConfig,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of the configured objective, and where PPO clipping was active; with `reference` (the RL base
    policy's logprobs) and [trainer] kl_coef, plus kl_coef x KL to it, outside the clip."""
    if config.objective == "sft":
        return -logprobs, torch.zeros_like(logprobs, dtype=torch.bool)
    loss, clipped = ppo_token_loss(logprobs, behaviour, advantages, config, proximal)
    if config.kl_coef and reference is not None:
        loss = loss + config.kl_coef * kl_to_reference(logprobs, reference)
    return loss, clipped
