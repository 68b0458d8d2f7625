"""The rollout's settings (the [rollout] section) and the layout of its sampling seeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retool.config.checks import require

# Seed layout, high bits to low: base seed | step + 1 | question | turn | branch. Every field has its
# own bits, so two different sampling calls can never share a seed (the reference's seed + index +
# 10000 * turn could). The branch sits lowest because vLLM seeds the n children of one request with
# seed + i: child i of a turn's first request is then exactly branch i's seed. 16 + 20 + 12 + 6 + 9 = 63
# bits, a valid seed for every engine. The step is stored plus one so that step -1 (an evaluation of the
# base model) has a place too.
SEED_FIELDS = (("seed", 16), ("step", 20), ("question_index", 12), ("turn", 6), ("group_index", 9))


def sample_seed(seed: int, step: int, question_index: int, group_index: int, turn: int) -> int:
    values = {
        "seed": seed,
        "step": step + 1,
        "question_index": question_index,
        "turn": turn,
        "group_index": group_index,
    }
    packed = 0
    for name, bits in SEED_FIELDS:
        if not 0 <= values[name] < 2**bits:
            raise ValueError(f"{name}={values[name]} does not fit the seed layout (0 <= {name} < {2**bits})")
        packed = (packed << bits) | values[name]
    return packed


def seed_capacity(name: str) -> int:
    """How many values of one field (a step's questions, say) the seed layout tells apart."""
    return 2 ** dict(SEED_FIELDS)[name]


def seed_field(seed: int, name: str) -> int:
    """One field of a packed sampling seed, e.g. the turn it was drawn for (the step field holds step + 1)."""
    names = [field_name for field_name, _ in SEED_FIELDS]
    below = sum(bits for _, bits in SEED_FIELDS[names.index(name) + 1 :])
    return (seed >> below) % seed_capacity(name)


def behaviour_step(step: int, max_staleness: int) -> int:
    """The checkpoint RL step `step` samples from: `max_staleness` steps older than the step before it; -1 (the RL
    base: the cold start's weights or the model) while there is none."""
    return max(step - 1 - max_staleness, -1)


@dataclass(frozen=True)
class RolloutConfig:
    SECTION: ClassVar[str] = "rollout"  # its luigi.cfg section, named by `require`
    group_size: int = 8  # trajectories sampled per question (the GRPO group)
    max_code_calls: int = 4  # tool observations a trajectory may receive
    max_assistant_turns: int = 6  # assistant generations a trajectory may have
    # A call asked for with no calls left: end | answer_turn. end: the trajectory ends there (the seed's rule);
    # answer_turn: the call is not run, the model reads that no calls are left and gets one more turn (past
    # max_assistant_turns, within the token budgets) to answer, once a trajectory
    calls_spent: str = "end"
    max_trajectory_tokens: int = 8192  # prompt + everything appended to it
    max_assistant_tokens: int = 1024  # tokens one assistant turn may generate
    max_tool_response_tokens: int = 512  # tokens one tool observation may hold
    min_tool_response_tokens: int = 16  # room kept free for an observation when a turn may call the tool
    temperature: float = 1.0  # sampling temperature; the trainer takes its logprobs at the same one
    top_p: float = 1.0  # nucleus sampling: 1 in training (see check_training); an evaluation may set its own
    seed: int = 42  # base of every sampling seed (see sample_seed)
    trainer_max_tokens: int = 8192  # the trainer's context; trajectories must fit it
    shards: int = 1  # independent chains of round files per step (the pipeline's unit of parallel work)
    # An evaluation's trajectories per shard, at most (0: [rollout] shards). One worker runs a shard's rounds
    # one after another, so an engine whose KV cache holds a shard reuses its prompts' cache in the next round.
    eval_shard_sequences: int = 0
    # Steps the sampling policy lags behind on-policy: step N samples from step N-1-k's checkpoint, so that with
    # Luigi workers to spare it samples while step N-1 trains (see behaviour_step; 0: on-policy, strictly in turn)
    max_staleness: int = 0

    @property
    def rounds(self) -> int:
        """The rounds a step's rollout may take: one a turn, and with calls_spent = answer_turn the turn after it."""
        return self.max_assistant_turns + (self.calls_spent == "answer_turn")

    def __post_init__(self) -> None:
        for name in (
            "group_size",
            "max_code_calls",
            "max_assistant_turns",
            "max_trajectory_tokens",
            "max_assistant_tokens",
            "max_tool_response_tokens",
            "min_tool_response_tokens",
            "trainer_max_tokens",
            "shards",
        ):
            value = getattr(self, name)
            require(
                self, name, isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive integer"
            )
        require(self, "calls_spent", self.calls_spent in ("end", "answer_turn"), "end or answer_turn")
        require(self, "eval_shard_sequences", self.eval_shard_sequences >= 0, ">= 0")
        require(self, "max_staleness", self.max_staleness >= 0, ">= 0 (0: on-policy)")
        within = self.max_trajectory_tokens <= self.trainer_max_tokens
        context = f"at most trainer_max_tokens = {self.trainer_max_tokens}, else trajectories could not be trained on"
        require(self, "max_trajectory_tokens", within, context)
        fits = self.min_tool_response_tokens <= self.max_tool_response_tokens
        require(
            self,
            "min_tool_response_tokens",
            fits,
            f"at most max_tool_response_tokens = {self.max_tool_response_tokens}",
        )
        require(self, "temperature", self.temperature > 0, "> 0")
        require(self, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        # The seed layout's fields these settings fill: a branch index up to group_size - 1, a turn up to the last.
        last_turn = 0 if self.calls_spent == "answer_turn" else 1  # answer_turn: one turn past the last
        limits = {"seed": ("seed", 0), "group_index": ("group_size", 1), "turn": ("max_assistant_turns", last_turn)}
        for name, bits in SEED_FIELDS:
            if name in limits:
                setting, offset = limits[name]
                fits = 0 <= getattr(self, setting) - offset < 2**bits
                require(self, setting, fits, f"below {2**bits + offset}, for the seed layout's {bits} bits of {name}")
