"""TrainStep: one PPO update from the step's shards' datums -> checkpoint/ (the policy the next step samples), their
join -> datums.parquet meanwhile, then the step's metrics -> metrics.parquet. Older steps' weights are pruned once this
checkpoint is written ([run] keep_last, keep_every): their metrics and markers stay."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from retool.config.settings import StageSettings
from retool.evaluation.metrics import describe_step, write_step_metrics
from retool.evaluation.tracking import Tracker, scalars
from retool.files.layout import RunFolder
from retool.files.tables import TRAJECTORIES, read_table
from retool.rollout.scoring import trained_groups
from retool.run.joined_datums import join_step_datums
from retool.run.shared import sandbox_for
from retool.sampling.engines import reclaim_sampler_memory, release_sampler_memory
from retool.training.record import describe_metrics
from retool.weights.models import behaviour_policy, rl_base


def train_step(
    shard_datums: Sequence[Path], datums: Path, trajectories: Path, observations: Sequence[Path],
    previous: Path | None, cold_start: Path | None, behaviour: Path | None, checkpoint: Path, metrics: Path,
    timings: Path, stage: StageSettings, step: int,
) -> str:  # fmt: skip
    """`previous`: the checkpoint the update starts from (None: step 0, from the RL base: the cold start's checkpoint
    `cold_start`, or the model setting); `behaviour`: the older step's that sampled it ([rollout] max_staleness);
    `observations` (every round's) and `timings` (the stages' wall times): for the metrics."""
    from retool.run.placement import served_in, train_placed
    from retool.training.checkpoints import prune_checkpoints  # torch: only once a step trains
    from retool.training.resume import StepInputs

    settings, run = stage.settings, stage.settings.run
    num_trajectories, zero_variance_groups = trained_groups(read_table(trajectories, TRAJECTORIES).to_pylist())
    base = rl_base(cold_start, settings.model.name)
    inputs = StepInputs(
        base_model=base,
        datums=tuple(shard_datums),
        num_trajectories=num_trajectories,  # of the groups that train
        zero_variance_groups=zero_variance_groups,
        previous=previous,
        out=checkpoint,
        config=settings.trainer_on_device(),
        served_in=served_in(settings, step),
        behaviour=behaviour_policy(stage.sampled_by, step, behaviour, base),
    )
    with ThreadPoolExecutor(max_workers=1) as beside:  # the update reads the shards: no update waits for the join
        joined = beside.submit(join_step_datums, shard_datums, datums, stage, step, timings)
        release_sampler_memory(settings)  # the sampler's GPU memory is the step's while it trains
        training, joined_datums = train_placed(inputs, settings), joined.result()
        reclaim_sampler_memory(settings)
    steps = [(s, RunFolder(settings.run_dir).step(s).checkpoint) for s in range(step + 1)]
    prune_checkpoints(steps, run.keep_last, run.keep_every)
    extra = {"sandbox_containment": sandbox_for(settings.sandbox).containment.describe()}
    row = write_step_metrics(metrics, step, trajectories, observations, timings, training, **extra)
    Tracker.of(settings).log(step, scalars(row))
    return f"{describe_metrics(training)}\n  datums.parquet: {joined_datums}\n  {describe_step(row)}"
