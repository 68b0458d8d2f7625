"""SampleRound: one round's assistant turns for every live trajectory of a shard -> samples.parquet."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from retool.config.settings import RunSettings, StageSettings
from retool.files.layout import RoundPaths
from retool.files.tables import write_table_atomically
from retool.rollout.stage_tables import describe_samples, samples_table
from retool.run.shared import replayed_shard
from retool.sampling import engines
from retool.weights.models import policy_of


def resident_weights(checkpoint: Path | None):
    """The policy's full weights as this process's resident trainer holds them, if it does (see
    retool.training.resident.held_weights): the sampler then reads no file."""
    if checkpoint is None:
        return None
    from retool.training.resident import held_weights  # torch: only once there is a trained policy

    return held_weights(checkpoint)


def sample_round(
    prompts: Path,
    rounds: Sequence[RoundPaths],
    checkpoint: Path | None,
    rl_base: Path | None,
    out: Path,
    settings: RunSettings,
    stage: StageSettings,
    step: int,
    shard: int,
    round_index: int,
    status: Callable[[str], None] = lambda message: None,  # the task's status line in the scheduler
) -> str:
    """`rounds`: the shard's rounds before this one; `checkpoint`: the policy to sample (None: the model setting);
    `rl_base`: the cold start's checkpoint, which an RL adapter applies to (None: the model setting); `settings`:
    the run's, whose engine this process keeps; `stage`: what this rollout runs under."""
    protocol, trajectories = replayed_shard(prompts, rounds, stage.settings, shard)
    status(f"sampling for {sum(not t.done for t in trajectories)} live trajectories")

    def sampler():  # loaded, and switched to the policy, only when there is something to sample
        policy = policy_of(checkpoint, rl_base, settings.model.name)
        return engines.sampler_for(settings, policy, shard, resident_weights(checkpoint))

    table = samples_table(trajectories, sampler, protocol, stage.settings.rollout, step, round_index, stage.sampled_by)
    write_table_atomically(table, out)
    return describe_samples(table)
