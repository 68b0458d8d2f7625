"""Where a training step trains: in this process, or in the command's training group (torchrun's processes, one per
GPU); and where the trainer's state waits between steps, so that the next step starts from it rather than from the
files. The run's settings decide it; the trainer (retool/training/) is handed the answer."""

from __future__ import annotations

import multiprocessing
import os

from retool.config.sampler import engine_dtype
from retool.config.settings import RunSettings
from retool.config.trainer import saves_in_full
from retool.files.layout import RunFolder
from retool.sampling.engines import sampler_kind
from retool.training.record import StepMetrics
from retool.training.resume import StepInputs, train_from_files


def trains_in_group(settings: RunSettings) -> bool:
    return settings.run.train_processes > 1


def stays_resident(settings: RunSettings) -> bool:
    """The trainer stays between steps in this process (one training process, Luigi running the tasks here) or in
    the command's training group (several); only then may a step skip the full save, which the held state makes at
    the end of the command."""
    return trains_in_group(settings) or multiprocessing.parent_process() is None


def held_on(settings: RunSettings) -> str:
    """Where the trainer waits between steps: the host while a sampler uses the same GPUs (an engine in this
    process, or servers that sleep while a step trains: colocated); the GPU when the servers have their own."""
    kind = sampler_kind(settings)
    colocated = kind in ("vllm", "hf") or (kind == "vllm-server" and settings.sampler.sleep_while_training)
    device = settings.run.device
    return "cpu" if device == "cuda" and colocated else device


def served_in(settings: RunSettings, step: int) -> str:
    """What step `step`'s checkpoint is saved as: "" a full save (weights, Adam and random state, by [trainer]
    save_every), else the weights alone in the sampler's dtype. A trainer that stays between steps may skip a full
    save: its held state makes one at the command's end."""
    if not stays_resident(settings) or saves_in_full(step, settings.trainer.save_every):
        return ""
    return engine_dtype(settings.sampler, settings.run.device)


def train_placed(inputs: StepInputs, settings: RunSettings) -> StepMetrics:
    """Trains a StepInputs where the settings place it: the command's training group (started at its first step),
    or this process (its state held on afterwards where it stays resident). The sampler's memory is the caller's
    to give back first (retool.sampling.engines.release_sampler_memory)."""
    if trains_in_group(settings):
        from retool.training.group import group_for, train_in_group

        folder = RunFolder(settings.run_dir).trainer_group
        command = multiprocessing.parent_process()  # Luigi's worker processes are the command's children
        pid = group_for(
            folder, settings.run.train_processes, held_on(settings), command.pid if command else os.getpid()
        )
        return train_in_group(folder, pid, inputs)
    return train_from_files(inputs, settings.run.device, held_on(settings) if stays_resident(settings) else "")
