"""The [reward] section: what the advantage is computed from. Correctness alone (+1 / -1) by default; the ReTool
recipes' tool-use shaping and DAPO's overlong handling as settings (see retool/rollout/scoring.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retool.config.checks import require

OVERLONG = ("keep", "mask", "penalty")


@dataclass(frozen=True)
class RewardConfig:
    SECTION: ClassVar[str] = "reward"  # its luigi.cfg section, named by `require`
    # verl's ReTool recipe: a wrong answer scores min(wrong_answer_cap, -1 + this x code calls), so that trying the
    # tool pays a little even when the answer is wrong (verl: 0.1, i.e. 0.05 per message turn); 0 = off
    wrong_answer_call_credit: float = 0.0
    wrong_answer_cap: float = -0.6  # the most a wrong answer scores with the credit (verl's -0.6)
    valid_call_bonus: float = 0.0  # added per code call that ran without an error or a timeout, to any answer
    # Trajectories stopped by a budget (a stop reason other than answer or invalid): keep (trained as any other) |
    # mask (left out of the loss; still in their group's mean) | penalty (DAPO's soft overlong penalty: 0 up to
    # overlong_buffer_tokens before [rollout] max_trajectory_tokens, falling linearly to -1 at it; any trajectory)
    overlong: str = "keep"
    overlong_buffer_tokens: int = 256  # penalty: the tokens before the budget over which it grows

    def __post_init__(self) -> None:
        require(self, "overlong", self.overlong in OVERLONG, f"one of {', '.join(OVERLONG)}")
        require(self, "wrong_answer_call_credit", self.wrong_answer_call_credit >= 0, ">= 0 (0: off)")
        require(self, "wrong_answer_cap", -1 <= self.wrong_answer_cap < 1, "in [-1, 1)")
        require(self, "valid_call_bonus", self.valid_call_bonus >= 0, ">= 0 (0: off)")
        require(self, "overlong_buffer_tokens", self.overlong_buffer_tokens > 0, "positive")

    @property
    def shaped(self) -> bool:
        """Whether the reward the advantage is computed from differs from correctness alone."""
        return bool(self.wrong_answer_call_credit or self.valid_call_bonus) or self.overlong == "penalty"
