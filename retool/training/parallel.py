"""The processes of one training step under torchrun (one per GPU; gloo on a CPU): which micro-batches each takes,
the model wrapped in torch's own data parallelism, and the whole state gathered for the checkpoint.

DDP keeps a whole copy of the model and its Adam state in every process and sums the gradients in buckets during
the backward pass; FSDP2 (`fully_shard`) keeps 1/K of the weights, gradients and Adam state in each process and
gathers one layer's weights at a time. `[trainer] data_parallel = auto` takes FSDP2 for a full fine-tune, whose
float32 weights and Adam state are what stops a large model fitting, and DDP for a LoRA, whose trained state is
small. Both average gradients over the processes; the loss is scaled by K so that they sum, as the loss weights
expect (see packing.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from retool.config.trainer import TrainerConfig
from retool.training.losses import token_logprobs
from retool.training.packing import MicroBatch

WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to the first process's memory


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share_of_micro_batches(batches: list[MicroBatch]) -> list[tuple[MicroBatch, bool, bool]]:
    """This process's micro-batches, every K-th of K processes, each with whether it counts and whether it is the
    last. Every process must run as many passes as the others (DDP reduces in each one's last backward pass, and
    FSDP2 gathers weights in every pass): one with fewer repeats a micro-batch at zero weight, which adds nothing."""
    rank, world = rank_and_world()
    mine = [(batch, True) for batch in batches[rank::world]]
    if world > 1 and batches:
        mine += [(mine[0][0] if mine else batches[0], False)] * (-(-len(batches) // world) - len(mine))
    return [(batch, counted, index == len(mine) - 1) for index, (batch, counted) in enumerate(mine)]


class TokenLogprobs(torch.nn.Module):
    """token_logprobs as a module's forward: the data-parallel wrappers act on what runs inside their forward,
    and token_logprobs calls the model's body and its output layer apart (see losses.py)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.policy = model

    def forward(self, *args, **kwargs):
        return token_logprobs(self.policy, *args, **kwargs)


def logprobs_of(model):
    """What takes a micro-batch to its token logprobs: the wrapped model, or token_logprobs of the plain one."""
    return model if isinstance(model, (DDP, FSDPModule)) else functools.partial(token_logprobs, model)


def sharded(model) -> bool:
    """Whether the model as this process trains it is sharded by FSDP2."""
    return isinstance(model, FSDPModule)


def wait_for_all() -> None:
    """Every process of the step reaches this point before any goes on (nothing to wait for alone)."""
    if rank_and_world()[1] > 1:
        dist.barrier()


def data_parallel(model, config: TrainerConfig, device: str):
    """The model as this process trains it: alone, the model itself; under torchrun, its token_logprobs wrapped in
    DDP or sharded by FSDP2 (each decoder layer a unit, then the rest), on `device`."""
    if rank_and_world()[1] == 1:
        return model
    wrapped = TokenLogprobs(model)
    if config.data_parallel == "fsdp":
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = set(getattr(base, "_no_split_modules", None) or ())  # transformers names its decoder layer classes
        policy = mixed_precision(config)
        for module in base.modules():
            if type(module).__name__ in layers:
                fully_shard(module, mp_policy=policy)
        return fully_shard(wrapped, mp_policy=policy)  # moves each process's shards to its device
    device_ids = [torch.cuda.current_device()] if device.startswith("cuda") else None  # torchrun set it per rank
    # Buffers are constants here: synced once at the start, never before each forward pass (which would make every
    # process run the same forward passes); gradients live in DDP's buckets, not in a second copy.
    return DDP(wrapped.to(device), device_ids=device_ids, forward_sync_buffers=False, gradient_as_bucket_view=True)


def mixed_precision(config: TrainerConfig) -> MixedPrecisionPolicy:
    """FSDP2's casts under autocast_bfloat16: each layer gathered in bfloat16 (half the bytes on the wire and in
    memory, no autocast re-casting every weight), gradients reduced in float32 into the float32 shards Adam keeps."""
    if config.autocast_bfloat16 != "true":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def loads_on(config: TrainerConfig, device: str) -> str:
    """Where the weights load: FSDP2 shards them from host memory, so that no GPU ever holds the whole model."""
    sharding = rank_and_world()[1] > 1 and config.data_parallel == "fsdp"
    return "cpu" if sharding else device


def summed_over_processes(sums: dict[str, float], device: str) -> dict[str, float]:
    """Each process measured its own micro-batches: the step's figures are the sums over all of them."""
    if rank_and_world()[1] == 1:
        return sums
    values = torch.tensor(list(sums.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return dict(zip(sums, values.tolist()))


def joined_over_processes(parts: dict) -> dict:
    """Each process's part of a mapping, joined into the whole in every process."""
    if rank_and_world()[1] == 1:
        return parts
    gathered = [None] * rank_and_world()[1]
    dist.all_gather_object(gathered, parts)
    return {key: value for part in gathered for key, value in part.items()}


def as_number(norm: torch.Tensor) -> float:
    """A gradient norm that FSDP2 returns sharded, whole."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def whole_state(model, optimizer, trained=None) -> tuple[dict | None, dict | None]:
    """The weights (None: the model's own, unsharded) and the Adam state by parameter name (None: no `optimizer`),
    whole, in the first process's memory; under FSDP2 (`trained` sharded) every process takes part in gathering."""
    if not sharded(trained):
        return None, get_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    trained.reshard()  # the outermost unit keeps its weights gathered after a forward pass
    weights = untied(model, get_model_state_dict(model, options=WHOLE))
    return weights, get_optimizer_state_dict(model, optimizer, options=WHOLE) if optimizer is not None else None


def untied(model, weights: dict) -> dict:
    """Gathered weights without the second name of a tied weight (an output layer that is the embedding), which
    the gathered copies no longer show as one tensor: as one process saves them."""
    first = {name for name, _ in model.named_parameters()}
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: value for name, value in weights.items() if name not in every - first}


def restore_optimizer(model, optimizer, path: Path, device: str) -> None:
    """The Adam state of a checkpoint, by parameter name (older checkpoints: by position), into this process's
    optimizer, sharded as its weights are."""
    state = torch.load(path, map_location="cpu" if isinstance(next(iter(model.parameters())), DTensor) else device)
    if all(isinstance(key, int) for key in state["state"]):  # by position in the trainable parameters
        names = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
        state = {
            "state": {names[key]: value for key, value in state["state"].items()},
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]
            ],
        }
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
