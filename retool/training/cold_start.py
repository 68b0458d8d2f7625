"""The cold start: supervised fine-tuning on tool-integrated solutions before RL.

A solution is a conversation in the chat-messages layout of the public ReTool SFT sets: the user's
question, assistant messages whose `tool_calls` run `code_interpreter`, the `tool` messages with the
output, and a final assistant answer with `\\boxed{}`. Each one is rendered by replaying it through the
rollout's own state machine (the assistant's text as the sampled completion, the recorded output as
the observation), so an SFT sequence is token for token what a rollout with the same turns produces,
and its loss mask covers exactly the tokens the model would have emitted.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy
import pyarrow as pa

from retool.config.cold_start import ColdStartConfig
from retool.config.rollout import RolloutConfig
from retool.data.conversations import Conversation, SolutionTurn
from retool.data.examples import MathExample
from retool.files.tables import SFT_EXAMPLES, SFT_LOSSES, table_from_rows
from retool.protocol.chat import ChatProtocol
from retool.protocol.tool_calls import neutralise, tool_call_text
from retool.rollout.datums import Datum, build_datum, trajectory_sequence
from retool.rollout.state import Trajectory, apply_samples, finish_advance, plan_requests, start_trajectories
from retool.sampling.contract import SampledSequence
from retool.sandbox.call import ExecutionResult
from retool.weights.checkpoint import Checkpoint

if TYPE_CHECKING:
    from retool.config.trainer import TrainerConfig


# -- rendering through the rollout --------------------------------------------------------------------


def assistant_text(turn: SolutionTurn, tool_format: str) -> str:
    return turn.text if turn.code is None else tool_call_text(turn.code, tool_format, turn.text.strip())


def replay_conversation(conversation: Conversation, protocol: ChatProtocol, config: RolloutConfig) -> Trajectory | None:
    """The trajectory a rollout produces when the model writes exactly these turns and the tool
    answers with the recorded output; None when it does not fit the rollout's budgets."""
    config = replace(config, group_size=1)
    example = MathExample(conversation.id, conversation.question, conversation.answer, conversation.data_source)
    (trajectory,) = start_trajectories([example], protocol, config)
    for turn in conversation.turns:
        requests = plan_requests([trajectory], protocol, config, step=0)
        tokens = protocol.encode(assistant_text(turn, protocol.tool_format))
        if turn.code is None:
            tokens.append(protocol.end_of_turn_token)  # an answer turn ends on the end-of-turn token
        if not requests or len(tokens) > requests[0].max_tokens:
            return None
        sequence = SampledSequence(tuple(tokens), (0.0,) * len(tokens), "stop")
        pendings = apply_samples([trajectory], requests, [[sequence]], protocol, config)
        if turn.code is None or not pendings:
            break
        result = ExecutionResult("ok", turn.output or "", "", 0.0, 0)
        finish_advance(
            pendings[0], result, neutralise(turn.output or "(no output)", protocol.forbidden_strings), protocol, config
        )
    fits = trajectory.stop_reason == "answer" and len(trajectory.turns) == len(conversation.turns)
    return trajectory if fits else None


def sft_examples_table(
    conversations: Sequence[Conversation], protocol: ChatProtocol, config: RolloutConfig
) -> tuple[pa.Table, int]:
    """The SFT examples, one row per conversation that fits the run's budgets and turn limits (a
    rollout could not have produced the others), and how many did not fit."""
    rows = []
    for conversation in conversations:
        trajectory = replay_conversation(conversation, protocol, config)
        if trajectory is None:
            continue
        trajectory.advantage = 1.0  # build_datum puts it on exactly the tokens the model emitted
        datum = build_datum(trajectory, config.trainer_max_tokens)
        untrained = {number for number, turn in enumerate(conversation.turns) if not turn.trained}
        if untrained:  # turns kept as context only: their tokens leave the loss
            turn_of = trajectory_sequence(trajectory).turn_of[1:]
            datum = replace(datum, loss_mask=datum.loss_mask & ~numpy.isin(turn_of, sorted(untrained)))
        rows.append(
            {
                "example_id": conversation.id,
                "line": conversation.line,
                "num_turns": len(trajectory.turns),
                "code_calls": trajectory.code_calls,
                "input_tokens": datum.input_tokens,
                "target_tokens": datum.target_tokens,
                "loss_mask": datum.loss_mask,
                "num_tokens": datum.num_tokens,
            }
        )
    return table_from_rows(rows, SFT_EXAMPLES), len(conversations) - len(rows)


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
    from retool.training.parallel import whole_state
    from retool.training.step import load_policy, release_memory, set_seed, train_step

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
        metrics = train_step(model, optimizer, batch, trainer, len(batch), device)
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
