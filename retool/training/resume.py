"""One PPO step from files, in-process or under torchrun: the state it starts from (held in memory from the step
before, loaded from a full save, or replayed from the datums of the steps since the last full save), the update,
and its checkpoint.

A training step is deterministic given its datums and the state it starts from, so the datums files are the
write-ahead log of the trainer: only every [trainer] save_every steps does a checkpoint hold the Adam state and
the random state, and a resume replays the steps since, to the same bits."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from retool.config.trainer import TrainerConfig
from retool.files.tables import DATUMS, read_table
from retool.rollout.datums import datums_from_table
from retool.training import parallel, resident
from retool.training.checkpoints import save_checkpoint
from retool.training.memory_plan import check_memory
from retool.training.record import StepMetrics
from retool.training.step import check_policy_sync, load_model, optimizer_for, release_memory, set_seed, train_step
from retool.weights.checkpoint import Checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """What one PPO step trains from and where it writes: the in-process call and every torchrun process read it;
    the checkpoint keeps it (inputs.json), so that a resume can replay the step."""

    base_model: Path  # the weights RL starts from, which LoRA adapters apply to
    datums: Path  # the step's datums.parquet
    num_trajectories: int  # trajectories of the groups that train (sample_mean's denominator)
    zero_variance_groups: int  # groups of equal rewards, recorded in the metrics
    previous: Path | None  # the checkpoint of the step before (None: the base model)
    out: Path  # the checkpoint this step writes
    config: TrainerConfig  # the [trainer] section for the device, `auto` resolved
    served_in: str = ""  # not a full save: the full weights written in this dtype (the engine's); "" = a full save
    stale: bool = False  # sampled by a checkpoint older than `previous` ([rollout] max_staleness): no sampler-gap check

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> StepInputs:
        fields = json.loads(text)
        names = ("base_model", "datums", "previous", "out")
        paths = {name: Path(fields[name]) if fields[name] else None for name in names}
        return cls(**{**fields, **paths, "config": TrainerConfig(**fields["config"])})


class ResumeError(RuntimeError):
    """A checkpoint to start from holds no Adam state and no record of how to replay it."""


def train_from_files(inputs: StepInputs, device: str = "cpu", hold_on: str = "") -> StepMetrics:
    """One PPO step from the datums file into a checkpoint, after the policy-sync check (see check_policy_sync).
    `hold_on`: keep the trained state in this process for the next step, on that device (the host, while a sampler
    in this process has the GPU); "" = not kept (a torchrun process)."""
    config, base_model = inputs.config, inputs.base_model
    check_memory(base_model, config, device, parallel.rank_and_world()[1])
    model, trained, optimizer = starting_state(inputs, device)
    try:
        datums = datums_from_table(read_table(inputs.datums, DATUMS))
        metrics = train_step(
            trained, optimizer, datums, config, inputs.num_trajectories, device, inputs.zero_variance_groups
        )
        if not inputs.stale:  # the gap to an older policy is the policy's own change, not a sampler's fault
            check_policy_sync(metrics, config, inputs.previous or base_model)
        # Every process takes part; the first writes. Adam's state only for a full save.
        gathered = parallel.whole_state(model, None if inputs.served_in else optimizer, trained)
        if parallel.rank_and_world()[0] == 0:
            extra = {"inputs.json": recorded(inputs)}
            save_checkpoint(
                inputs.out, model, optimizer, metrics, config, base_model, extra, gathered, inputs.served_in
            )
        if hold_on:
            parallel.wait_for_all()  # the checkpoint's marker, which the held state is known by, is written
            resident.hold(inputs.out, base_model, config, model, trained, optimizer, device, hold_on)
    finally:
        del model, optimizer, trained
        release_memory(device, collect=not hold_on)
    return metrics


def starting_state(inputs: StepInputs, device: str):
    """The model (and its data-parallel wrapper) and Adam optimizer as `inputs.previous` left them: held in this
    process, or loaded from the newest full save at or before it, then the steps since replayed from their datums."""
    config, base_model = inputs.config, inputs.base_model
    held = resident.take(inputs.previous, base_model, config)
    if held is not None:
        log.info("%s: starts from the state held in memory", inputs.out)
        return held.model, held.trained, held.optimizer
    replays, start = steps_to_replay(inputs.previous)
    log.info("%s: starts from %s, %d step(s) replayed", inputs.out, start or base_model, len(replays))
    if start is None:
        set_seed(config.seed)
    model = load_model(base_model, start, config, device, parallel.loads_on(config, device))
    trained = parallel.data_parallel(model, config, device)
    optimizer = optimizer_for(model, start, config, device)  # over the weights as this process holds them
    for step in replays:
        # The same update as the first time (the settings it ran with), without the checks it passed then.
        datums = datums_from_table(read_table(step.datums, DATUMS))
        train_step(trained, optimizer, datums, step.config, step.num_trajectories, device, step.zero_variance_groups)
    return model, trained, optimizer


def steps_to_replay(checkpoint: Path | None) -> tuple[list[StepInputs], Path | None]:
    """The steps from the newest full save at or before `checkpoint` (None: the base model) up to it, oldest first,
    and that full save."""
    replays: list[StepInputs] = []
    while checkpoint is not None and not Checkpoint(checkpoint).holds_state:
        if not Checkpoint(checkpoint).inputs.exists():
            raise ResumeError(
                f"checkpoint {checkpoint} holds no Adam state and no inputs.json to replay it from: delete it (and "
                "the steps after it) to train them again"
            )
        replays.append(replay_of(checkpoint))
        checkpoint = replays[-1].previous
    return replays[::-1], checkpoint


# A step's files are recorded relative to its checkpoint, so that a run folder replays wherever it lies.
_RELATIVE = ("datums", "previous", "out")


def recorded(inputs: StepInputs) -> dict:
    """The step's inputs as its checkpoint keeps them (inputs.json)."""
    fields = json.loads(inputs.to_json())
    return {**fields, **{name: os.path.relpath(fields[name], inputs.out) for name in _RELATIVE if fields[name]}}


def replay_of(checkpoint: Path) -> StepInputs:
    """The inputs `checkpoint` was trained from, as its inputs.json records them."""
    fields = json.loads(Checkpoint(checkpoint).inputs.read_text())
    paths = {name: os.path.normpath(checkpoint / fields[name]) for name in _RELATIVE if fields[name]}
    return StepInputs.from_json(json.dumps({**fields, **paths}))
