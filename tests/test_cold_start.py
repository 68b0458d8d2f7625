"""The cold start: conversations read and checked, rendered exactly as a rollout renders the same turns,
trained through the PPO trainer's own step, resumable, and the policy RL step 0 samples from."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy
import pytest
import torch
from safetensors.torch import load_file

from retool.config.cold_start import ColdStartConfig
from retool.config.rollout import RolloutConfig, seed_field
from retool.config.sandbox import SandboxConfig
from retool.config.trainer import TrainerConfig
from retool.data.conversations import read_conversations
from retool.data.examples import DataError
from retool.rollout.conversations import assistant_text, replay_conversation, sft_examples_table
from retool.rollout.datums import trajectory_sequence
from retool.rollout.in_memory import rollout_in_memory
from retool.sampling.scripted import ScriptedSampler
from retool.sandbox.call import Sandbox
from retool.training.cold_start import batch_indices, sft_datums, train_cold_start
from tests.helpers import REPO

SHIPPED = REPO / "data/synthetic_sft.jsonl"
CONFIG = RolloutConfig(
    group_size=1,
    max_code_calls=2,
    max_assistant_turns=3,
    max_trajectory_tokens=1024,
    max_assistant_tokens=200,
    max_tool_response_tokens=128,
    trainer_max_tokens=1024,
)


@pytest.fixture(scope="module")
def conversations():
    found = read_conversations(SHIPPED)
    one_call = next(c for c in found if len(c.turns) == 2)
    corrected = next(c for c in found if len(c.turns) == 3)
    return [one_call, corrected]


def test_the_shipped_solutions_read_and_correct_a_share_of_mistakes():
    found = read_conversations(SHIPPED)
    assert len(found) == 600 and all(c.turns[-1].code is None and "\\boxed{" in c.turns[-1].text for c in found)
    corrected = [c for c in found if len(c.turns) == 3]
    assert 0.1 < len(corrected) / len(found) < 0.5
    assert all(not c.turns[0].trained and c.turns[1].trained for c in corrected)  # the mistake is context only
    assert any("Error" in c.turns[0].output for c in corrected) and any(
        "Error" not in c.turns[0].output for c in corrected
    )


def test_an_sft_sequence_is_what_a_rollout_with_the_same_turns_produces(conversations, protocol):
    """The real rollout, with a sampler that writes the conversation's turns and the real sandbox."""
    sandbox = Sandbox(SandboxConfig(timeout_seconds=20, cpu_seconds=20))
    try:
        for conversation in conversations:

            def script(request, index, turns=conversation.turns):
                turn = turns[seed_field(request.seed, "turn")]
                tokens = protocol.encode(assistant_text(turn, protocol.tool_format)) + [protocol.end_of_turn_token]
                return tokens, [0.0] * len(tokens)

            example = replay_conversation(conversation, protocol, CONFIG).example
            (rolled,) = rollout_in_memory([example], ScriptedSampler(script), sandbox, protocol, CONFIG)
            replayed = replay_conversation(conversation, protocol, CONFIG)
            assert rolled.stop_reason == replayed.stop_reason == "answer" and rolled.correct
            rolled_sequence, replayed_sequence = trajectory_sequence(rolled), trajectory_sequence(replayed)
            assert all(
                numpy.array_equal(getattr(rolled_sequence, name), getattr(replayed_sequence, name))
                for name in ("tokens", "old_logprobs", "is_action", "turn_of")
            )
            assert [t.tool_call.content for t in rolled.turns[:-1]] == [t.output for t in conversation.turns[:-1]]
    finally:
        sandbox.close()


def test_the_loss_mask_covers_exactly_the_assistants_tokens(conversations, protocol):
    table, skipped = sft_examples_table(conversations, protocol, CONFIG)
    assert skipped == 0
    for conversation, row in zip(conversations, table.to_pylist(), strict=True):
        trajectory = replay_conversation(conversation, protocol, CONFIG)
        for earlier, later in zip(trajectory.turns, trajectory.turns[1:]):  # every prompt extends the turn before it
            assert (
                later.prompt_tokens[: len(earlier.prompt_tokens) + len(earlier.completion_tokens)]
                == earlier.prompt_tokens + earlier.completion_tokens
            )
        emitted = [token for token, masked in zip(row["target_tokens"], row["loss_mask"]) if masked]
        trained = [turn.trained for turn in conversation.turns]
        expected = [token for turn, on in zip(trajectory.turns, trained) for token in turn.completion_tokens if on]
        assert emitted == expected  # a mistake ("weight": 0) is context, its correction is trained on
        texts = [assistant_text(turn, protocol.tool_format) for turn in conversation.turns if turn.trained]
        assert protocol.decode(emitted) == "".join(texts)
        context = [token for token, masked in zip(row["target_tokens"], row["loss_mask"]) if not masked]
        with_specials = protocol.tokenizer.decode(context, skip_special_tokens=False)
        assert (
            all(turn.output in with_specials for turn in conversation.turns[:-1])
            and conversation.question in with_specials
        )
        assert with_specials.count("<|im_start|>assistant") == len(conversation.turns)  # the wrappers are context
        assert "<|im_start|>" not in protocol.tokenizer.decode(emitted, skip_special_tokens=False)
        assert emitted[-1] == protocol.end_of_turn_token


def test_conversations_over_the_budgets_are_left_out_and_counted(conversations, protocol):
    table, skipped = sft_examples_table(conversations, protocol, replace(CONFIG, max_code_calls=1))
    assert (table.num_rows, skipped) == (1, 1)  # the corrected solution needs two calls


MALFORMED = {
    "a tool message without a tool call before it": [
        {"role": "user", "content": "q"},
        {"role": "tool", "content": "1"},
    ],
    "unknown tool 'python'": [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": '{"code": "1"}'}}],
        },
    ],
    "field 'content' is missing": [{"role": "user"}, {"role": "assistant", "content": "\\boxed{1}"}],
    "arguments are not valid JSON": [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "code_interpreter", "arguments": "{code: 1"}}],
        },
    ],
    "not answered by a tool message": [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(1)"}}}
            ],
        },
    ],
    "must end with an assistant answer": [{"role": "user", "content": "q"}],
    "field 'weight' must be 0 or 1, got 0.5": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "\\boxed{4}", "weight": 0.5},
    ],
    "no \\'answer\\' field and no": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "it is 4"}],
}


@pytest.mark.parametrize("problem", list(MALFORMED))
def test_a_malformed_conversation_is_one_error_naming_the_file_and_line(problem, tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\\boxed{4}"}]}
    path = tmp_path / "solutions.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": MALFORMED[problem]}) + "\n")
    with pytest.raises(DataError, match=rf"solutions.jsonl line 2.*{problem}"):
        read_conversations(path)


def test_batches_are_a_pure_function_of_the_step():
    first_epoch = [i for step in range(4) for i in batch_indices(10, 5, step, seed=3)][:10]
    assert sorted(first_epoch) == list(range(10))
    assert batch_indices(10, 5, 7, seed=3) == batch_indices(10, 5, 7, seed=3) != batch_indices(10, 5, 7, seed=4)


@pytest.fixture(scope="module")
def tiny_datums(tiny_model_dir, tokenizer):
    from retool.protocol.chat import BUNDLED_TEMPLATE, ChatProtocol

    protocol = ChatProtocol(tokenizer, tool_format="hermes", chat_template=BUNDLED_TEMPLATE)
    table, _ = sft_examples_table(read_conversations(SHIPPED)[:6], protocol, CONFIG)
    return sft_datums(table)


TRAINER = TrainerConfig(
    objective="sft",
    lora_rank=0,
    learning_rate=1e-3,
    loss_aggregation="token_mean",
    micro_batch_items=2,
    autocast_bfloat16="false",
).on("cpu")


def test_sft_steps_lower_the_loss_and_publish_full_weights(tiny_model_dir, tiny_datums, tmp_path):
    losses = train_cold_start(
        tiny_model_dir,
        tiny_datums,
        TRAINER,
        ColdStartConfig(steps=6, batch_size=6, save_every=2),
        tmp_path / "checkpoint",
        tmp_path / "progress",
    )
    assert [row["step"] for row in losses] == list(range(6)) and losses[-1]["loss"] < losses[0]["loss"] - 0.5
    assert (tmp_path / "checkpoint" / "_SUCCESS").exists() and (
        tmp_path / "checkpoint" / "model" / "config.json"
    ).exists()
    assert not (tmp_path / "progress").exists()


def test_a_lora_cold_start_is_merged_into_full_weights(tiny_model_dir, tiny_datums, tmp_path):
    train_cold_start(
        tiny_model_dir,
        tiny_datums,
        replace(TRAINER, lora_rank=4, lora_alpha=8),
        ColdStartConfig(steps=1, batch_size=2),
        tmp_path / "checkpoint",
        tmp_path / "progress",
    )
    merged, base = (
        load_file(tmp_path / "checkpoint/model/model.safetensors"),
        load_file(tiny_model_dir / "model.safetensors"),
    )
    assert merged.keys() == base.keys() and any(not torch.equal(merged[k], base[k]) for k in base)


def test_a_stopped_cold_start_resumes_to_the_same_weights(tiny_model_dir, tiny_datums, tmp_path):
    config = ColdStartConfig(steps=4, batch_size=3, save_every=2)
    train_cold_start(tiny_model_dir, tiny_datums, TRAINER, config, tmp_path / "whole", tmp_path / "whole-progress")

    def stop_after_step_two(row):
        if row["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_cold_start(
            tiny_model_dir,
            tiny_datums,
            TRAINER,
            config,
            tmp_path / "resumed",
            tmp_path / "progress",
            on_step=stop_after_step_two,
        )
    assert json.loads((tmp_path / "progress" / "losses.json").read_text())[-1]["step"] == 1
    losses = train_cold_start(tiny_model_dir, tiny_datums, TRAINER, config, tmp_path / "resumed", tmp_path / "progress")
    assert [row["step"] for row in losses] == [0, 1, 2, 3]
    whole, resumed = (
        load_file(tmp_path / "whole/model/model.safetensors"),
        load_file(tmp_path / "resumed/model/model.safetensors"),
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
