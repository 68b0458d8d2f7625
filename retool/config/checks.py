"""The one way a section's dataclass refuses a value: naming the field, its value and what is allowed (the
settings' reader turns `TrainerConfig.learning_rate` into `[trainer] learning_rate`)."""

from __future__ import annotations


def require(config: object, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name} = {getattr(config, name)!r}: must be {allowed}")
