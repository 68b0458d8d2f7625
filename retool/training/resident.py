"""The trainer's state kept in this process between steps, so that a run of one training process does not load
the policy and its Adam state from disk at every step (the checkpoint is still written: it is what the sampler
loads and what another process resumes from).

A step takes the held state only when it is exactly the checkpoint the step starts from (same folder, same
marker file, same settings); anything else (a restart, a deleted and re-made output, another run) loads from
disk. At the end of the command, a held state whose checkpoint is not a full save is saved in full, so that the
next command resumes without replaying."""

from __future__ import annotations

import atexit
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from retool.config.trainer import TrainerConfig
from retool.training import parallel
from retool.training.checkpoints import random_state, save_checkpoint, set_random_state
from retool.training.record import StepMetrics
from retool.weights.checkpoint import Checkpoint


@dataclass
class Held:
    """A trained policy as its step left it."""

    checkpoint: Path  # the checkpoint it equals
    stamp: tuple[int, int]  # that checkpoint's marker (inode, mtime): rewritten means another state
    base_model: Path  # the weights a LoRA applies to
    config: TrainerConfig  # the settings it trained under (save_every aside)
    model: Any  # the model, made trainable
    trained: Any  # the model as this process trains it (itself, or its DDP or FSDP2 wrapper)
    optimizer: Any  # its Adam optimizer
    rng: dict  # the random state at the end of the step
    device: str  # where it trains; it is held on the host while a sampler in this process uses the GPU


_held: Held | None = None
_saves_at_exit = False  # save_at_exit is registered to run when the process ends


def _stamp(checkpoint: Path) -> tuple[int, int]:
    status = Checkpoint(checkpoint).marker.stat()
    return status.st_ino, status.st_mtime_ns


def _same_settings(a: TrainerConfig, b: TrainerConfig) -> bool:
    return replace(a, save_every=1) == replace(b, save_every=1)


def hold(
    checkpoint: Path, base_model: Path, config: TrainerConfig, model, trained, optimizer, device: str, on: str
) -> None:
    """Keeps the state that `checkpoint` was just written from, on `on` (the host, or the training device)."""
    global _held, _saves_at_exit
    drop()
    _move(trained, optimizer, on)
    stamp = _stamp(checkpoint)
    _held = Held(checkpoint, stamp, base_model, config, model, trained, optimizer, random_state(), device)
    if parallel.rank_and_world()[1] == 1 and not _saves_at_exit:  # a training group saves it itself, all together
        atexit.register(save_at_exit)
        _saves_at_exit = True


def take(checkpoint: Path | None, base_model: Path, config: TrainerConfig) -> Held | None:
    """The held state if it is `checkpoint`'s, on its training device and with its random state back; it is then
    the caller's. Else None (and what was held is freed)."""
    global _held
    held, _held = _held, None
    if held is None or checkpoint is None:
        return None
    marker = Checkpoint(checkpoint).marker
    same = held.checkpoint == checkpoint and marker.exists() and held.stamp == _stamp(checkpoint)
    if not (same and held.base_model == base_model and _same_settings(held.config, config)):
        return None
    _move(held.trained, held.optimizer, held.device)
    set_random_state(held.rng)
    return held


def held_weights(checkpoint: Path | None) -> dict[str, torch.Tensor] | None:
    """The full weights of the held policy, by name as its checkpoint saves them, if it is exactly
    `checkpoint`'s: a sampler in this process loads them from here rather than reading the files back. None for
    another checkpoint, a LoRA (vLLM takes adapters only from files) or a training group's state (its processes
    hold it). The tensors are the held model's own: a sampler copies them before the next step trains it."""
    held = _held
    if held is None or checkpoint is None or hasattr(held.model, "peft_config") or parallel.rank_and_world()[1] > 1:
        return None
    marker = Checkpoint(checkpoint).marker
    if held.checkpoint.resolve() != checkpoint.resolve() or not marker.exists() or held.stamp != _stamp(checkpoint):
        return None
    from transformers.core_model_loading import revert_weight_conversion

    # Under the names save_pretrained writes (a published checkpoint's, which the engine maps from).
    return revert_weight_conversion(held.model, parallel.untied(held.model, held.model.state_dict()))


def drop() -> None:
    """Forgets the held state (its memory is freed with the last reference)."""
    global _held
    _held = None


def save_at_exit() -> None:
    """The command ends: the held step saved in full, unless it is already (or its checkpoint is gone). In a
    training group every process calls it: they gather the state together, the first writes it."""
    global _held
    held, _held = _held, None
    checkpoint = Checkpoint(held.checkpoint) if held is not None else None
    if checkpoint is None or checkpoint.holds_state or not checkpoint.marker.exists():
        return
    set_random_state(held.rng)
    _move(held.trained, held.optimizer, held.device)
    gathered = parallel.whole_state(held.model, held.optimizer, held.trained)
    if parallel.rank_and_world()[0]:
        return
    metrics = StepMetrics(**json.loads(checkpoint.metrics.read_text()))
    inputs = json.loads(checkpoint.inputs.read_text()) if checkpoint.inputs.exists() else None
    save_checkpoint(
        held.checkpoint, held.model, held.optimizer, metrics, held.config, held.base_model,
        {"inputs.json": inputs} if inputs else None, gathered,
    )  # fmt: skip


def _move(trained, optimizer, device: str) -> None:
    """The model as this process trains it, and Adam's moments, to `device` (no copy where they are already there).
    The object that trains moves, not the model inside it: FSDP2's own `_apply` re-points the shards it gathers
    from, which moving an inner module skips (its forward would then read the weights from before the move)."""
    trained.to(device)
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and name != "step":
                state[name] = value.to(device)
