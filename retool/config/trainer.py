"""The [trainer] section: the policy's parameterisation, the PPO objective, the optimizer, micro-batches and
precision (apart from the trainer itself, so that reading settings never imports torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from retool.config.checks import SettingsError, require
from retool.config.precision import bfloat16_native

OBJECTIVES = ("ppo", "sft")
CORRECTIONS = ("none", "tis", "mis")
DTYPES = ("auto", "float32", "bfloat16")
SWITCHES = ("auto", "true", "false")
DATA_PARALLEL = ("auto", "ddp", "fsdp")


@dataclass(frozen=True)
class TrainerConfig:
    SECTION: ClassVar[str] = "trainer"  # its luigi.cfg section, named by `require`
    objective: str = "ppo"  # ppo (clipped surrogate on sampled tokens) | sft (negative log-likelihood, the cold start)
    lora_rank: int = 32  # 0 trains every weight
    lora_alpha: int = 64  # LoRA scale: the adapter's update is multiplied by lora_alpha / lora_rank
    learning_rate: float = 4e-5  # Adam's step size
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    max_grad_norm: float = 1.0  # the gradient is clipped to this norm before each optimizer step
    clip_low: float = 0.2  # ratio may fall to 1 - clip_low
    clip_high: float = 0.28  # and rise to 1 + clip_high (clip-higher)
    loss_aggregation: str = "token_mean"  # token_mean | sample_mean (see retool.training.packing)
    ppo_mini_batches: int = 1  # optimizer steps per pass over a step's datums, each on every k-th datum
    ppo_epochs: int = 1  # passes over a step's datums; updates after the first are off-policy, bounded by the clip
    micro_batch_items: int = 8  # datums per micro-batch, at most
    micro_batch_tokens: int = 16384  # padded tokens per micro-batch
    # Tokens sampled by another policy than the trainer's (an older checkpoint with [rollout] max_staleness, or a
    # sampler's numerical drift): none (PPO's ratio against the sampler's logprobs) | tis | mis (decoupled PPO: the
    # ratio against the trainer's own policy before the update, each token weighted by that policy over the
    # sampler's, the weight truncated at correction_cap (tis), or the token dropped outside
    # [correction_floor, correction_cap] (mis, masked importance sampling))
    correction: str = "none"
    correction_cap: float = 2.0  # the importance weight's upper bound (tis), the band's top (mis)
    correction_floor: float = 0.5  # mis: tokens whose importance weight falls below are dropped
    filter_zero_variance_groups: bool = False  # sample_mean over datums only, not all trajectories
    # A penalty on each loss token, kl_coef x the k3 estimate of KL(policy || RL base), the policy RL starts from (the
    # cold start): it pulls the policy back where it drifts from that base; 0 = none (no reference pass is taken)
    kl_coef: float = 0.0
    # The weights' dtype: auto (float32 for a full fine-tune, bfloat16 for a LoRA's frozen base on CUDA) | float32
    # | bfloat16 (a full fine-tune in pure bfloat16 loses updates smaller than half a unit in the last place)
    dtype: str = "auto"
    # Mixed precision: matrix products in bfloat16 over weights kept in `dtype`: auto (where the device computes
    # bfloat16 natively: CUDA, a CPU with AVX512-BF16 or AMX; 1.6x faster there) | true | false
    autocast_bfloat16: str = "auto"
    # How [run] train_processes > 1 share a step: ddp (a whole copy each, gradients summed) | fsdp (FSDP2: weights,
    # gradients and Adam state sharded) | auto (fsdp for a full fine-tune, ddp for a LoRA)
    data_parallel: str = "auto"
    gradient_checkpointing: bool = True  # recompute activations in the backward pass (a run does so only on CUDA)
    logprob_chunk_tokens: int = 1024  # loss tokens whose vocabulary-wide logits exist at once
    max_sampler_gap: float = 0.0  # fail a step whose mean |trainer - sampler| logprob exceeds this; 0 = no check
    seed: int = 42  # initial LoRA weights
    # Steps between full saves (Adam state, random state, weights in the trainer's dtype): the other steps write
    # only what the sampler loads, and a resume replays them from their datums (30: a 4B full fine-tune writes
    # under 10 GB a step on average, docs/training.md); 1 = every step. A command's last step always saves in full.
    save_every: int = 30
    # The sampling temperature the logprobs are taken at, so that PPO's ratio is against the distribution the
    # sampler drew from (set by the code: the run's [rollout] temperature; 1 for the cold start)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        require(self, "lora_rank", self.lora_rank >= 0, ">= 0 (0: full fine-tuning)")
        require(self, "learning_rate", self.learning_rate > 0, "> 0")
        require(self, "max_grad_norm", self.max_grad_norm > 0, "> 0")
        require(self, "clip_low", 0 < self.clip_low < 1, "in (0, 1)")
        require(self, "clip_high", self.clip_high > 0, "> 0")
        require(self, "kl_coef", self.kl_coef >= 0, ">= 0 (0: no penalty)")
        require(self, "objective", self.objective in OBJECTIVES, f"one of {', '.join(OBJECTIVES)}")
        aggregations = ", ".join(LOSS_AGGREGATIONS)
        require(self, "loss_aggregation", self.loss_aggregation in LOSS_AGGREGATIONS, f"one of {aggregations}")
        require(self, "dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}")
        require(self, "correction", self.correction in CORRECTIONS, f"one of {', '.join(CORRECTIONS)}")
        require(self, "correction_cap", self.correction_cap >= 1, ">= 1 (a weight of 1 is on-policy)")
        band = 0 < self.correction_floor <= 1
        require(self, "correction_floor", band, "in (0, 1] (a weight of 1 is on-policy)")
        require(self, "data_parallel", self.data_parallel in DATA_PARALLEL, f"one of {', '.join(DATA_PARALLEL)}")
        # true and false also as JSON booleans (config.json of runs frozen when the setting was one)
        autocast = str(self.autocast_bfloat16).lower()
        require(self, "autocast_bfloat16", autocast in SWITCHES, "auto, true or false")
        object.__setattr__(self, "autocast_bfloat16", autocast)
        for name in ("micro_batch_items", "micro_batch_tokens", "ppo_mini_batches", "ppo_epochs", "save_every"):
            require(self, name, getattr(self, name) > 0, "> 0")

    def on(self, device: str) -> TrainerConfig:
        """This config with every `auto` resolved for `device`, once, where training starts (a run's settings:
        RunSettings.on_device; a tool or a test: here). The trainer reads the resolved values and refuses `auto`."""
        return replace(
            self,
            dtype=resolved_dtype(self.dtype, device, self.lora_rank),
            autocast_bfloat16=resolved_autocast(self.autocast_bfloat16, device),
            data_parallel=resolved_data_parallel(self.data_parallel, self.lora_rank),
        )

    def check_resolved(self) -> None:
        """Refuses a config whose `auto` values were never resolved for a device (see `on`)."""
        unresolved = [name for name in ("dtype", "autocast_bfloat16", "data_parallel") if getattr(self, name) == "auto"]
        if unresolved:
            raise SettingsError(
                f"[trainer] {', '.join(unresolved)} = auto reached the trainer unresolved: resolve the config for its "
                "device first (TrainerConfig.on(device))"
            )


def saves_in_full(step: int, save_every: int) -> bool:
    """Whether RL step `step` writes a full save (Adam and random state) by the cadence."""
    return (step + 1) % save_every == 0


def replayed_steps(step: int, save_every: int) -> range:
    """The steps a resume of `step` may replay: those after the newest full save before it by the cadence."""
    last_full = max((s for s in range(step) if saves_in_full(s, save_every)), default=-1)
    return range(last_full + 1, step)


def resolved_dtype(dtype: str, device: str, lora_rank: int) -> str:
    """The weights' dtype `auto` stands for: bfloat16 for the frozen base of a LoRA on CUDA; float32 for the weights
    Adam updates in a full fine-tune, on any device (mixed precision: the products run in bfloat16 through
    autocast_bfloat16). In bfloat16 itself, an update of lr 1e-5 is below half a unit in the last place of any
    weight above about 0.004 in magnitude, so most weights would never change."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") and lora_rank else "float32"


def resolved_data_parallel(data_parallel: str, lora_rank: int) -> str:
    """What data_parallel = auto stands for: FSDP2 where the trained state is the whole model, DDP for a LoRA."""
    if data_parallel != "auto":
        return data_parallel
    return "ddp" if lora_rank else "fsdp"


def resolved_autocast(autocast_bfloat16: str, device: str) -> str:
    """What autocast_bfloat16 = auto stands for on a device: true where it computes bfloat16 natively."""
    if autocast_bfloat16 != "auto":
        return autocast_bfloat16
    return "true" if bfloat16_native(device) else "false"


LOSS_AGGREGATIONS = ("sample_mean", "token_mean")
