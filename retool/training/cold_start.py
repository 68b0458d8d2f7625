"""The cold start: supervised fine-tuning on tool-integrated solutions before RL.

A solution is a conversation in the chat-messages layout of the public ReTool SFT sets: the user's
question, assistant messages whose `tool_calls` run `code_interpreter`, the `tool` messages with the
output, and a final assistant answer with `\\boxed{}`; retool/rollout/conversations.py renders each one
through the rollout's own state machine (sft/examples.parquet), and this trains on them.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from retool.config.cold_start import ColdStartConfig
from retool.files.tables import SFT_LOSSES
from retool.rollout.datums import Datum
from retool.weights.checkpoint import Checkpoint

if TYPE_CHECKING:
    from retool.config.trainer import TrainerConfig


def sft_datums(examples: pa.Table) -> list[Datum]:
    """Datums of the SFT objective: the trainer reads only tokens, targets and the loss mask."""
    return [
        Datum(
            index,
            0,
            row["input_tokens"],
            row["target_tokens"],
            [0.0] * row["num_tokens"],
            [1.0 if m else 0.0 for m in row["loss_mask"]],
            row["loss_mask"],
        )
        for index, row in enumerate(examples.to_pylist())
    ]


# -- training -----------------------------------------------------------------------------------------


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples of SFT step `step`: consecutive slices of per-epoch shuffles, a pure function of
    the step, so a resumed cold start visits exactly the examples an uninterrupted one would."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_examples)
        order = list(range(num_examples))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        indices.append(order[offset])
    return indices


LOSSES = "losses.json"  # in a cold-start checkpoint: the loss of every step so far


def train_cold_start(
    base_model: Path,
    datums: list[Datum],
    trainer: TrainerConfig,
    config: ColdStartConfig,
    out: Path,
    progress: Path,
    device: str = "cpu",
    on_step=None,
) -> list[dict]:
    """Supervised fine-tuning through the PPO trainer's own step (objective sft), resuming from the
    last resume point under `progress`. Publishes `out` with full weights (a LoRA is merged in), so
    RL starts from it as from any base model. Returns the loss of every step."""
    from retool.training.checkpoints import save_checkpoint
    from retool.training.memory_plan import check_memory
    from retool.training.out_of_memory import release_memory
    from retool.training.parallel import whole_state
    from retool.training.step import load_policy, set_seed, update_policy

    if Checkpoint(out).marker.exists():  # published, but the losses table was not written yet
        return json.loads((out / LOSSES).read_text())
    resume = progress if Checkpoint(progress).marker.exists() else None
    losses = json.loads((progress / LOSSES).read_text()) if resume else []
    if resume is None:
        set_seed(trainer.seed)
    check_memory(base_model, trainer, device)
    model, optimizer = load_policy(base_model, resume, trainer, device)
    for step in range(len(losses), config.steps):
        batch = [datums[i] for i in batch_indices(len(datums), config.batch_size, step, config.seed)]
        metrics = update_policy(model, optimizer, batch, trainer, len(batch), device)
        release_memory(device)  # each step's activations differ in size: without it the heap grows step by step
        losses.append(
            {
                "step": step,
                "loss": metrics.loss,
                "examples": len(batch),
                "loss_tokens": metrics.loss_tokens,
                "grad_norm": metrics.grad_norm,
                "seconds": metrics.seconds,
            }
        )
        if on_step:
            on_step(losses[-1])
        if config.save_every and (step + 1) % config.save_every == 0 and step + 1 < config.steps:
            save_checkpoint(progress, model, optimizer, metrics, trainer, base_model, extra={LOSSES: losses})
    trained_state = whole_state(model, optimizer)  # Adam's state by the names of what it trained
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()  # RL starts from full weights, whatever the cold start trained
    save_checkpoint(out, model, optimizer, metrics, trainer, base_model, extra={LOSSES: losses}, gathered=trained_state)
    shutil.rmtree(progress, ignore_errors=True)
    del model, optimizer
    release_memory(device)
    return losses


def losses_table(losses: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(losses, schema=SFT_LOSSES)


def describe_cold_start(losses: list[dict]) -> str:
    return f"{len(losses)} SFT steps, loss {losses[0]['loss']:.3f} -> {losses[-1]['loss']:.3f}"
