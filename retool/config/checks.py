"""The one way a section's dataclass refuses a value: `require`, naming the setting, its value and what is
allowed, as a SettingsError (`setting [trainer] learning_rate = -1.0: must be > 0`)."""

from __future__ import annotations


class SettingsError(ValueError):
    """A setting is invalid or does not fit this machine; the message names the setting."""


def require(config: object, name: str, ok: bool, allowed: str) -> None:
    """`config` is a section's dataclass, whose SECTION names its luigi.cfg section."""
    if not ok:
        raise SettingsError(f"setting [{config.SECTION}] {name} = {getattr(config, name)!r}: must be {allowed}")
