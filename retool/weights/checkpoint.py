"""A checkpoint folder and what it holds, and the policy a sampler or the trainer loads from it.

A checkpoint holds either full weights (`model/`: safetensors, config and tokenizer, as transformers saves
them) or a LoRA adapter (`adapter/`, as PEFT saves it) trained over the run's base weights; then the
optimizer state and the random state (a full save: every [trainer] save_every steps), the step's inputs (what a
resume replays it from), its metrics and the trainer settings, and `_SUCCESS` last."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = (  # copied beside full weights, so that the folder alone serves as a model
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

MARKER = "_SUCCESS"  # written last: a folder without it is not a checkpoint


@dataclass(frozen=True)
class Checkpoint:
    path: Path

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def adapter(self) -> Path:
        return self.path / "adapter"

    @property
    def optimizer(self) -> Path:
        return self.path / "optimizer.pt"

    @property
    def rng(self) -> Path:
        return self.path / "rng.pt"

    @property
    def inputs(self) -> Path:
        return self.path / "inputs.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.json"

    @property
    def trainer_config(self) -> Path:
        return self.path / "trainer_config.json"

    @property
    def marker(self) -> Path:
        return self.path / MARKER

    @property
    def holds_adapter(self) -> bool:
        return self.adapter.is_dir()

    @property
    def holds_state(self) -> bool:
        """A full save: training resumes from it without replaying a step."""
        return self.optimizer.exists()

    @property
    def weights_and_state(self) -> tuple[Path, ...]:
        """What retention prunes from an old checkpoint (its inputs, metrics and marker stay)."""
        return (self.adapter, self.model, self.optimizer, self.rng)

    def policy(self, base_model: Path) -> Policy:
        """What an engine loads to sample from this checkpoint: its full weights, or `base_model` (the weights
        the adapter was trained over) with its adapter."""
        if self.holds_adapter:
            return Policy(base_model, self.adapter)
        return Policy(self.model)


@dataclass(frozen=True)
class Policy:
    """The weights a rollout samples from, as every engine loads them."""

    weights: Path  # a model folder: full weights
    adapter: Path | None = None  # a PEFT adapter folder trained over `weights`, or none
