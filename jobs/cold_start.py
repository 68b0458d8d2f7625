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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from jobs.data import DataError, MathExample
from jobs.datums import Datum, build_datum, trajectory_sequence
from jobs.protocol import TOOL_NAME, ChatProtocol, neutralise, tool_call_text
from jobs.reward import last_boxed
from jobs.rollout import Trajectory, apply_samples, finish_advance, plan_requests, start_trajectories
from jobs.rollout_config import RolloutConfig
from jobs.sampling import SampledSequence
from jobs.sandbox import ExecutionResult
from jobs.tables import SFT_EXAMPLES, SFT_LOSSES, table_from_rows

if TYPE_CHECKING:
    from jobs.trainer_config import TrainerConfig


@dataclass(frozen=True)
class SolutionTurn:
    text: str  # what the assistant writes before its call, or its whole final answer
    code: str | None = None  # the code its tool call runs; None for the final answer
    output: str | None = None  # the tool message that answered the call
    trained: bool = True  # false ("weight": 0 on the message): context only, e.g. a mistake that is then corrected


@dataclass(frozen=True)
class Conversation:
    id: str  # from the file, or "<file stem>-<line>"
    line: int  # line of the file it came from
    question: str  # the user message
    answer: str  # reference answer: the row's "answer", else the final \boxed{}
    turns: tuple[SolutionTurn, ...]  # assistant turns; the last one answers
    data_source: str = "cold-start"  # the row's "data_source" (a synthetic problem's family), if it has one


@dataclass(frozen=True)
class ColdStartConfig:
    data: str = ""  # JSONL of tool-integrated solutions to fine-tune on before RL; "" = RL starts from the model
    steps: int = 8  # optimizer steps of supervised fine-tuning
    batch_size: int = 8  # conversations per step
    learning_rate: float = 1e-4
    lora_rank: int = 32  # 0 = full fine-tune; LoRA weights are merged into full weights at the end
    save_every: int = 4  # steps between resume points (sft/progress/); 0 = none
    seed: int = 0  # order in which conversations are visited

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0 or self.save_every < 0 or self.lora_rank < 0:
            raise ValueError(
                f"ColdStartConfig needs steps > 0, batch_size > 0, save_every >= 0 and lora_rank >= 0, got {self}"
            )
        if self.learning_rate <= 0:
            raise ValueError(f"ColdStartConfig.learning_rate must be positive, got {self.learning_rate}")


# -- reading conversations ----------------------------------------------------------------------------


def _call_code(call: Any, where: str) -> str:
    """The code of one tool call, in the OpenAI layout (arguments as a JSON string) or the Hugging
    Face layout (arguments as an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise DataError(f"{where}: a tool call needs a 'function' object")
    if function.get("name") != TOOL_NAME:
        raise DataError(f"{where}: unknown tool {function.get('name')!r} (only {TOOL_NAME!r} exists)")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: tool call arguments are not valid JSON ({error.msg})") from None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str) or not arguments["code"].strip():
        raise DataError(f"{where}: tool call arguments need a non-empty string 'code'")
    return arguments["code"]


def _trained(message: dict, where: str) -> bool:
    """An assistant message's optional "weight" (as in OpenAI's fine-tuning layout): 1 trains on it, 0 keeps it
    as context only."""
    weight = message.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise DataError(f"{where}: field 'weight' must be 0 or 1, got {weight!r}")
    return weight == 1


def _content(message: dict, where: str, allow_empty: bool = False) -> str:
    content = message.get("content")
    if content is None and allow_empty:
        return ""
    if not isinstance(content, str) or (not allow_empty and not content.strip()):
        raise DataError(f"{where}: field 'content' is missing or empty")
    return content


def conversation_from_row(row: Any, line: int, where: str, default_id: str) -> Conversation:
    """One conversation: an optional system message (the run's protocol supplies its own), the
    question, then assistant turns, each call answered by a tool message, ending on an answer."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise DataError(f"{where}: expected an object with a 'messages' list")
    messages = [m for m in row["messages"] if not (isinstance(m, dict) and m.get("role") == "system")]
    if not messages or not isinstance(messages[0], dict) or messages[0].get("role") != "user":
        raise DataError(f"{where}: the first message after the system prompt must be the user's question")
    question = _content(messages[0], f"{where} message 1")
    turns: list[SolutionTurn] = []
    position = 1
    while position < len(messages):
        message, at = messages[position], f"{where} message {position + 1}"
        if not isinstance(message, dict) or message.get("role") not in ("assistant", "tool"):
            raise DataError(f"{at}: expected an assistant or tool message, got {message!r:.80}")
        if message["role"] == "tool":
            raise DataError(f"{at}: a tool message without a tool call before it")
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list) or len(calls) > 1:
            raise DataError(
                f"{at}: an assistant message may make one tool call, got "
                f"{len(calls) if isinstance(calls, list) else calls!r}"
            )
        if not calls:
            turns.append(SolutionTurn(_content(message, at), trained=_trained(message, at)))
            position += 1
            continue
        code = _call_code(calls[0], at)
        reply = messages[position + 1] if position + 1 < len(messages) else None
        if not isinstance(reply, dict) or reply.get("role") != "tool":
            raise DataError(f"{at}: its tool call is not answered by a tool message")
        turns.append(
            SolutionTurn(
                _content(message, at, allow_empty=True),
                code,
                _content(reply, f"{where} message {position + 2}", allow_empty=True),
                _trained(message, at),
            )
        )
        position += 2
    if not turns or turns[-1].code is not None:
        raise DataError(f"{where}: the conversation must end with an assistant answer")
    answer = row.get("answer")
    answer = (
        str(answer)
        if isinstance(answer, (str, int, float)) and not isinstance(answer, bool)
        else last_boxed(turns[-1].text)
    )
    if not answer:
        raise DataError(f"{where}: no 'answer' field and no \\boxed{{}} in the final answer")
    source = row.get("data_source")
    source = source if isinstance(source, str) and source else "cold-start"
    return Conversation(str(row.get("id") or default_id), line, question, answer, tuple(turns), source)


def read_conversations(path: str | Path) -> list[Conversation]:
    """All conversations of a JSONL file; any malformed one is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: cold-start data file does not exist")
    conversations = []
    with path.open(encoding="utf-8") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {line}: not valid JSON ({error.msg})") from None
            conversations.append(conversation_from_row(row, line, f"{path} line {line}", f"{path.stem}-{line}"))
    if not conversations:
        raise DataError(f"{path}: cold-start data file has no conversations")
    return conversations


def conversation_row(conversation: Conversation) -> dict:
    """The JSONL row of a conversation (the inverse of conversation_from_row)."""
    messages: list[dict] = [{"role": "user", "content": conversation.question}]
    for number, turn in enumerate(conversation.turns, start=1):
        weight = {} if turn.trained else {"weight": 0}
        if turn.code is None:
            messages.append({"role": "assistant", "content": turn.text, **weight})
            continue
        call = {
            "id": f"call_{number}",
            "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"code": turn.code})},
        }
        messages.append({"role": "assistant", "content": turn.text, "tool_calls": [call], **weight})
        messages.append({"role": "tool", "tool_call_id": f"call_{number}", "content": turn.output})
    return {
        "id": conversation.id,
        "answer": conversation.answer,
        "data_source": conversation.data_source,
        "messages": messages,
    }


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
            datum = replace(datum, loss_mask=[m and turn_of[i] not in untrained for i, m in enumerate(datum.loss_mask)])
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
    from jobs.checkpoints import save_checkpoint
    from jobs.trainer import load_policy, release_memory, set_seed, train_step

    if (out / "_SUCCESS").exists():  # published, but the losses table was not written yet
        return json.loads((out / "losses.json").read_text())
    resume = progress if (progress / "_SUCCESS").exists() else None
    losses = json.loads((progress / "losses.json").read_text()) if resume else []
    if resume is None:
        set_seed(trainer.seed)
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
            save_checkpoint(progress, model, optimizer, metrics, trainer, base_model, extra={"losses.json": losses})
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()  # RL starts from full weights, whatever the cold start trained
    save_checkpoint(out, model, optimizer, metrics, trainer, base_model, extra={"losses.json": losses})
    shutil.rmtree(progress, ignore_errors=True)
    del model, optimizer
    release_memory(device)
    return losses


def losses_table(losses: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(losses, schema=SFT_LOSSES)


def describe_cold_start(losses: list[dict]) -> str:
    return f"{len(losses)} SFT steps, loss {losses[0]['loss']:.3f} -> {losses[-1]['loss']:.3f}"
