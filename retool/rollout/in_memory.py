"""The rollout of a step in one process: the state machine's rounds in a loop, then the end of the step. The benchmark
against the pipeline and the tests run it; the pipeline runs the same steps one stage at a time and must give the
same result. Apart from state.py and scoring.py, so that neither imports the other."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from retool.config.reward import RewardConfig
from retool.config.rollout import RolloutConfig
from retool.data.examples import MathExample
from retool.protocol.chat import ChatProtocol
from retool.rollout.scoring import end_step
from retool.rollout.state import (
    Trajectory,
    apply_results,
    apply_samples,
    execute,
    plan_requests,
    sampling_settings,
    start_trajectories,
)
from retool.sampling.contract import Sampler, sample_checked
from retool.sandbox.call import Sandbox


def rollout_in_memory(
    examples: Sequence[MathExample],
    sampler: Sampler,
    sandbox: Sandbox,
    protocol: ChatProtocol,
    config: RolloutConfig,
    step: int = 0,
    on_round: Callable[[int, Sequence[Trajectory]], None] | None = None,
    keep_limit: int | None = None,
    reward: RewardConfig = RewardConfig(),
) -> list[Trajectory]:
    """The whole state machine in one process: rounds until every trajectory ends, then the end of the step
    (`end_step`, under `reward`, the run's [reward]). The pipeline runs the same steps one stage at a time and must
    give the same result."""
    trajectories = start_trajectories(examples, protocol, config)
    settings = sampling_settings(config, protocol)
    round_index = 0
    # Each round: one batched sampling call for every live branch (round 0: one request of n per question),
    # then the round's tool calls concurrently, then the barrier: no branch starts round r+1 before all end r.
    while requests := plan_requests(trajectories, protocol, config, step):
        replies = sample_checked(sampler, requests, settings)
        pendings = apply_samples(trajectories, requests, replies, protocol, config)
        apply_results(pendings, execute(pendings, sandbox), sandbox, protocol, config)
        if on_round:
            on_round(round_index, trajectories)
        round_index += 1
    return end_step(trajectories, keep_limit, reward, config.max_trajectory_tokens)
