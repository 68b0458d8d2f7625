"""The in-memory rollout of one step on the embedded default model (CPU, transformers sampler)."""

from __future__ import annotations

import time
from collections import Counter

from jobs.data import read_examples, take_batch
from jobs.hf_sampler import HFSampler
from jobs.models import build_default_model
from jobs.protocol import BUNDLED_TEMPLATE, ChatProtocol
from jobs.rollout import RolloutConfig, degenerate_groups, rollout_in_memory
from jobs.sandbox import Sandbox


def main() -> None:
    config = RolloutConfig(group_size=4, max_code_calls=2, max_assistant_turns=3, max_trajectory_tokens=1536,
                           max_assistant_tokens=192, max_tool_response_tokens=128, trainer_max_tokens=2048)
    sampler = HFSampler(build_default_model())
    protocol = ChatProtocol(sampler.tokenizer, chat_template=BUNDLED_TEMPLATE)
    examples = take_batch(read_examples("data/synthetic_train.jsonl"), step=0, batch_size=2)
    started = time.perf_counter()
    trajectories = rollout_in_memory(examples, sampler, Sandbox(), protocol, config, step=0,
                                     on_round=lambda r, ts: print(f"round {r}: {sum(not t.done for t in ts)} trajectories still live"))
    seconds = time.perf_counter() - started
    tokens = sum(len(turn.completion_tokens) for t in trajectories for turn in t.turns)
    print(f"{len(trajectories)} trajectories in {seconds:.1f} s ({tokens / seconds:.1f} sampled tokens/s)")
    print(f"reward mean {sum(t.reward for t in trajectories) / len(trajectories):+.2f}, degenerate groups {degenerate_groups(trajectories)}")
    print("stop reasons:", dict(Counter(t.stop_reason for t in trajectories)))


if __name__ == "__main__":
    main()
