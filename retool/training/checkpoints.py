"""Checkpoints on disk: written whole beside their place and renamed (a killed write leaves nothing
that looks complete, a failed one nothing at all, and a full disk fails in one line naming the checkpoint), with the
random state that makes a resumed run equal an uninterrupted one, and pruned to the retention policy."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retool.config.trainer import TrainerConfig
from retool.files.atomic import write_folder_atomically
from retool.training.parallel import untied, whole_state
from retool.training.record import StepMetrics
from retool.weights.checkpoint import TOKENIZER_FILES, Checkpoint


def random_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_random_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_rng(path: Path) -> None:
    torch_save(random_state(), path)


def torch_save(value, path: Path) -> None:
    """torch.save through an open file: on a full disk its OSError (ENOSPC) is what torch's error came from, where
    torch.save to a path says only "unexpected pos"."""
    with open(path, "wb") as file:
        torch.save(value, file)


def restore_rng(path: Path) -> None:
    if path.exists():
        set_random_state(torch.load(path, weights_only=False))


def save_checkpoint(
    folder: Path,
    model,
    optimizer,
    metrics: StepMetrics,
    config: TrainerConfig,
    tokenizer_source: Path,
    extra: dict[str, Any] | None = None,
    gathered: tuple[dict | None, dict] | None = None,
    served_in: str = "",
) -> None:
    """Writes the whole checkpoint beside its final place, marks it _SUCCESS, then renames it: a
    killed write leaves no folder that looks complete, a failed one (a full disk: a DiskFullError naming `folder`)
    removes what it wrote and leaves an earlier `folder` as it was. A PEFT model saves its adapter, any other
    model its full weights with the tokenizer; the Adam state by parameter name; `extra` adds JSON
    files. `gathered`: the weights and Adam state that every process gathered from their shards
    (see parallel.whole_state); None: this process's own. `served_in`: not a full save, only what a sampler
    loads: full weights in that dtype (the engine's), no Adam or random state."""
    weights, optimizer_state = gathered or whole_state(model, None if served_in else optimizer)
    if served_in and not hasattr(model, "peft_config"):
        dtype = getattr(torch, served_in)
        weights = untied(
            model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in (weights or model.state_dict()).items()}
        )

    def write(temporary: Path) -> None:
        checkpoint = Checkpoint(temporary)
        for name, value in (extra or {}).items():
            (temporary / name).write_text(json.dumps(value, indent=1) + "\n")
        if hasattr(model, "peft_config"):
            model.save_pretrained(checkpoint.adapter, state_dict=weights)
        else:
            model.save_pretrained(checkpoint.model, state_dict=weights)
            for name in TOKENIZER_FILES:
                if (tokenizer_source / name).exists():
                    shutil.copy(tokenizer_source / name, checkpoint.model / name)
        if not served_in:
            torch_save(optimizer_state, checkpoint.optimizer)
            save_rng(checkpoint.rng)
        checkpoint.metrics.write_text(json.dumps(asdict(metrics), indent=2) + "\n")
        checkpoint.trainer_config.write_text(json.dumps(asdict(config), indent=2) + "\n")
        checkpoint.marker.write_text("")

    write_folder_atomically(folder, write)


def prune_checkpoints(checkpoints: list[tuple[int, Path]], keep_last: int, keep_every: int) -> list[Path]:
    """Drops the weights and optimizer state of old checkpoints (inputs, metrics and _SUCCESS stay): keeps
    the newest `keep_last`, every step divisible by `keep_every` (0 = none), and the newest full save (which a
    resume replays the later steps from). Returns what it pruned."""
    pruned = []
    ordered = sorted(checkpoints)
    resume_point = next((folder for _, folder in reversed(ordered) if Checkpoint(folder).holds_state), None)
    for step, folder in ordered[: max(0, len(ordered) - keep_last)]:
        if (keep_every and step % keep_every == 0) or folder == resume_point:
            continue
        for target in Checkpoint(folder).weights_and_state:
            if target.is_dir():
                shutil.rmtree(target)
                pruned.append(target)
            elif target.exists():
                target.unlink()
                pruned.append(target)
    return pruned
