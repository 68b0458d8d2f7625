"""One PPO step from files, in-process or under torchrun: the state it starts from (held in memory from the step
before, loaded from a full save, or replayed from the datums of the steps since the last full save), the update,
the check that the sampler served the policy it was given, and the checkpoint.

A training step is deterministic given its datums and the state it starts from, so the datums files are the
write-ahead log of the trainer: only every [trainer] save_every steps does a checkpoint hold the Adam state and
the random state, and a resume replays the steps since, to the same bits."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from retool.config.trainer import TrainerConfig, resolved_data_parallel
from retool.files.tables import DATUMS, read_table
from retool.rollout.datums import Datum, step_datums
from retool.training import parallel, resident
from retool.training.checkpoints import save_checkpoint
from retool.training.memory_plan import check_memory
from retool.training.out_of_memory import release_memory
from retool.training.packing import pack_micro_batches, rows_by_datum
from retool.training.record import StepMetrics
from retool.training.step import (
    drift_sums,
    load_model,
    optimizer_for,
    policy_pass,
    set_seed,
    update_policy,
)
from retool.weights.checkpoint import Checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """What one PPO step trains from and where it writes: the in-process call and every torchrun process read it;
    the checkpoint keeps it (inputs.json), so that a resume can replay the step."""

    base_model: Path  # the weights RL starts from, which LoRA adapters apply to
    datums: tuple[Path, ...]  # the step's datums files (its shards'), read as one in (question, branch) order
    num_trajectories: int  # trajectories of the groups that train (sample_mean's denominator)
    zero_variance_groups: int  # groups of equal rewards, recorded in the metrics
    previous: Path | None  # the checkpoint of the step before (None: the base model)
    out: Path  # the checkpoint this step writes
    config: TrainerConfig  # the [trainer] section for the device, `auto` resolved
    served_in: str = ""  # not a full save: the full weights written in this dtype (the engine's); "" = a full save
    # The policy that sampled the datums if older than `previous` ([rollout] max_staleness): its checkpoint, or
    # `base_model` itself; None: `previous`
    behaviour: Path | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> StepInputs:
        fields = json.loads(text)
        fields.pop("stale", None)  # recorded by earlier versions, which made no check of a stale step
        names = ("base_model", "previous", "out", "behaviour")
        paths = {name: Path(fields[name]) if fields.get(name) else None for name in names}
        datums = fields["datums"]  # earlier versions recorded the step's datums.parquet alone
        paths["datums"] = tuple(Path(p) for p in ([datums] if isinstance(datums, str) else datums))
        config = TrainerConfig(**fields["config"])
        if config.data_parallel == "auto":  # recorded unresolved by earlier versions (the only `auto` they left)
            config = replace(config, data_parallel=resolved_data_parallel("auto", config.lora_rank))
        return cls(**{**fields, **paths, "config": config})


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
        datums = with_reference(model, trained, read_datums(inputs.datums), inputs, device)
        # Samples of an older policy are checked against it (their gap to this one is the policy's own change): one
        # pass under its weights, taken for the check only; without the check a stale step's gap is not measured.
        gap = None
        if inputs.behaviour is not None:
            checked = config.max_sampler_gap and config.objective == "ppo" and datums
            gap = gap_to_behaviour(model, trained, datums, inputs, device) if checked else math.nan
        metrics = update_policy(
            trained, optimizer, datums, config, inputs.num_trajectories, device, inputs.zero_variance_groups
        )
        metrics = metrics if gap is None else replace(metrics, logprob_gap=gap)
        check_policy_sync(metrics, config, inputs.behaviour or inputs.previous or base_model)
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
        datums = with_reference(model, trained, read_datums(step.datums), step, device)
        update_policy(trained, optimizer, datums, step.config, step.num_trajectories, device, step.zero_variance_groups)
    return model, trained, optimizer


def read_datums(paths: tuple[Path, ...]) -> list[Datum]:
    """A step's datums files (its shards') as one list, in (question, branch) order."""
    return step_datums([read_table(path, DATUMS) for path in paths])


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
_RELATIVE = ("datums", "previous", "out", "behaviour")


def recorded(inputs: StepInputs) -> dict:
    """The step's inputs as its checkpoint keeps them (inputs.json)."""
    fields = json.loads(inputs.to_json())
    return {**fields, **{name: _paths(fields[name], lambda p: os.path.relpath(p, inputs.out)) for name in _RELATIVE}}


def replay_of(checkpoint: Path) -> StepInputs:
    """The inputs `checkpoint` was trained from, as its inputs.json records them."""
    fields = json.loads(Checkpoint(checkpoint).inputs.read_text())
    paths = {name: _paths(fields.get(name), lambda p: os.path.normpath(checkpoint / p)) for name in _RELATIVE}
    return StepInputs.from_json(json.dumps({**fields, **paths}))


def _paths(value: str | list[str] | None, change):
    """`change` applied to a recorded path, or to each of a list of them (the datums'); None stays None."""
    if not value:
        return value
    return [change(path) for path in value] if isinstance(value, list) else change(value)


class PolicySyncError(RuntimeError):
    """The sampler's logprobs are not the policy's it claims: it sampled from other weights."""


def check_policy_sync(metrics: StepMetrics, config: TrainerConfig, policy: Path) -> None:
    """Before anything is saved: the trainer's logprobs of the sampled tokens, under the policy the
    sampler was given, must match the sampler's own within `max_sampler_gap` (mean absolute gap)."""
    if config.objective != "ppo" or not config.max_sampler_gap or not metrics.loss_tokens:
        return
    if metrics.logprob_gap > config.max_sampler_gap:
        raise PolicySyncError(
            f"the sampler does not serve the trained policy {policy}: its logprobs of the {metrics.loss_tokens} "
            f"sampled tokens differ from the trainer's by {metrics.logprob_gap:.3g} on average, "
            f"over max_sampler_gap = {config.max_sampler_gap:g}. The sampler loaded other weights (a skipped LoRA "
            "adapter, a stale in-place reload, another dtype); nothing was saved"
        )


def gap_to_behaviour(model, trained, datums: list[Datum], inputs: StepInputs, device: str) -> float:
    """The sampler gap of a step sampled by an older policy than the one it trains from ([rollout] max_staleness):
    mean |sampler − trainer| logprob under that policy, `inputs.behaviour`."""
    behaviour = None if inputs.behaviour.resolve() == inputs.base_model.resolve() else inputs.behaviour  # None: base
    _, seen = pass_under(model, trained, behaviour, datums, inputs, device)
    sums = parallel.summed_over_processes(drift_sums(seen, None, inputs.config), device)
    return sums["gap"] / max(sums["tokens"], 1.0)


def with_reference(model, trained, datums: list[Datum], inputs: StepInputs, device: str) -> list[Datum]:
    """The datums, each with the RL base policy's logprobs of its targets ([trainer] kl_coef > 0), from one pass
    under the base's weights; every process gets every datum's, whichever micro-batches it took."""
    if not inputs.config.kl_coef or inputs.config.objective != "ppo" or not datums:
        return datums
    batches, seen = pass_under(model, trained, None, datums, inputs, device)
    mine = [batch for batch, _, _ in parallel.share_of_micro_batches(batches)]  # as the pass took them
    rows = rows_by_datum(mine, seen.padded, [d.num_tokens for d in datums])
    # 0 off the loss tokens, as a pass leaves them
    rows = parallel.joined_over_processes({i: row.float().cpu().numpy() for i, row in rows.items()})
    return [replace(datum, reference_logprobs=rows[i]) for i, datum in enumerate(datums)]


def pass_under(model, trained, weights: Path | None, datums: list[Datum], inputs: StepInputs, device: str):
    """The micro-batches and one no-grad pass over them under other weights: a checkpoint, or None, the base model.
    They go into the model for that pass and this process's own are put back bit for bit, so the memory it needs is
    on the host (a second model there), not on the device; `trained`: the model's data-parallel wrapper."""
    config, base_model = inputs.config, inputs.base_model
    own = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    if next(model.parameters()).device.type == "cpu":  # offloading copied nothing: the values are the weights
        own = {name: value.clone() for name, value in own.items()}
    with torch.random.fork_rng(devices=[]):  # a new LoRA adapter draws its A matrices: leave the step's random state
        other = load_model(base_model, weights, config, "cpu")
    set_model_state_dict(model, other.state_dict(), options=StateDictOptions(full_state_dict=True))
    del other
    try:
        whole = pack_micro_batches([d.num_tokens for d in datums], config.micro_batch_items, config.micro_batch_tokens)
        return whole, policy_pass(trained, datums, whole, config, device)
    finally:
        set_model_state_dict(model, own, options=StateDictOptions())
