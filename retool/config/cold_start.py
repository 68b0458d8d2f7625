"""The [cold_start] section: supervised fine-tuning on worked solutions before RL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retool.config.checks import require


@dataclass(frozen=True)
class ColdStartConfig:
    SECTION: ClassVar[str] = "cold_start"  # its luigi.cfg section, named by `require`
    # JSONL of tool-integrated solutions to fine-tune on before RL; "" or "none" (the way to say it on a command
    # line, where Luigi drops an empty value): no cold start, RL starts from the model
    data: str = ""
    steps: int = 8  # optimizer steps of supervised fine-tuning
    batch_size: int = 8  # conversations per step
    learning_rate: float = 1e-4  # Adam's step size for the supervised steps
    lora_rank: int = 32  # 0 = full fine-tune; LoRA weights are merged into full weights at the end
    save_every: int = 4  # steps between resume points (sft/progress/); 0 = none
    seed: int = 0  # order in which conversations are visited

    def __post_init__(self) -> None:
        if self.data.strip().lower() == "none":
            object.__setattr__(self, "data", "")  # recorded as no cold start, the same as ""
        for name in ("steps", "batch_size", "learning_rate"):
            require(self, name, getattr(self, name) > 0, "> 0")
        require(self, "save_every", self.save_every >= 0, ">= 0 (0: no resume points)")
        require(self, "lora_rank", self.lora_rank >= 0, ">= 0 (0: full fine-tuning)")
