"""The phases of the trainer's GPU check (bench.gpu, whose docstring lists them all) that exercise the trainer's
GPU-only branches: fork_check (CUDA left uninitialised by the machine check, for forked children),
fsdp_held_round_trip (FSDP2's state held on the host between steps) and gated_delta (Qwen3.5's linear attention,
its trainer's and its sampler's forms). Each also runs on the CPU, with gloo, float64 and smaller shapes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bench.gpu_harness import position_buckets, random_datums, recipe, synchronize
from retool.config.trainer import TrainerConfig
from retool.training.step import update_policy

# The model FSDP2 shards in fsdp_held_round_trip: a small Qwen3 on a GPU, a tiny one on the CPU.
FSDP_QWEN3 = dict(
    vocab_size=32_000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
)  # fmt: skip
TINY_QWEN3 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
)  # fmt: skip


# Run in a fresh interpreter that imports torch alone (transformers may ask torch about CUDA on import): the device
# check as the machine check makes it (NVML-based) or plainly, then a forked child that uses the device.
FORK_PROBE = """
import json, os, sys
mode, device = sys.argv[1], sys.argv[2]
if mode == "nvml":
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
else:
    os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
import torch
available, count = torch.cuda.is_available(), torch.cuda.device_count()
initialized = torch.cuda.is_initialized()
read, write = os.pipe()
child = os.fork()
if child == 0:
    os.close(read)
    try:
        ok, error = float((torch.ones(4, device=device) * 2).sum()) == 8.0, ""
    except BaseException as failure:
        ok, error = False, f"{type(failure).__name__}: {failure}"
    os.write(write, error[-2000:].encode())
    os._exit(0 if ok else 1)
os.close(write)
error = b""
while chunk := os.read(read, 4096):
    error += chunk
_, status = os.waitpid(child, 0)
print(json.dumps({
    "is_available": available, "device_count": count, "parent_cuda_initialized": initialized,
    "parent_cuda_initialized_after_fork": torch.cuda.is_initialized(),
    "forked_child_ok": os.waitstatus_to_exitcode(status) == 0, "forked_child_error": error.decode(),
}))
"""


def fork_check(device: str) -> dict:
    """Whether a process may still fork children that use CUDA after checking the machine: with the NVML-based
    check (PYTORCH_NVML_BASED_CUDA_CHECK=1, as the project's machine check sets it) torch.cuda.is_available() and
    device_count() ask NVML and leave the driver alone; a plain is_available() initialises the driver, though
    torch.cuda.is_initialized() still says False, and a forked child's first CUDA call then fails. On the CPU the
    same code runs and the child adds on the CPU."""
    figures = {}
    for mode in ("nvml", "plain"):
        done = subprocess.run(
            [sys.executable, "-c", FORK_PROBE, mode, device], capture_output=True, text=True, timeout=180
        )
        if done.returncode:
            raise RuntimeError(f"the {mode} probe failed:\n{done.stderr[-3000:]}")
        figures[f"{mode}_check"] = json.loads(done.stdout.splitlines()[-1])
    nvml = figures["nvml_check"]
    figures["nvml_check_keeps_fork_usable"] = nvml["forked_child_ok"] and not nvml["parent_cuda_initialized"]
    return figures


def _shard(model):
    """The model as a training group's process trains it under FSDP2 (retool.training.parallel.data_parallel):
    token_logprobs as the root's forward, each decoder layer a unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    from retool.training.parallel import TokenLogprobs

    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module)
    return fully_shard(TokenLogprobs(model))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a plain one as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def fsdp_held_round_trip(workdir: Path, device: str) -> dict:
    """Under FSDP2 in one process: a step, the state (the sharded root and Adam's moments) moved to the host and
    back as a held step moves it (retool.training.resident), then the forward of the next step against the same
    weights gathered and applied to an unsharded copy (torch.func.functional_call), and the next update against
    an identical run whose state never left the device. On the CPU, gloo and a round trip through float64 in place
    of the device move."""
    import torch.distributed as dist

    cuda = device == "cuda"
    shape = FSDP_QWEN3 if cuda else TINY_QWEN3
    tokens = 512 if cuda else 64
    config = replace(recipe(TrainerConfig(lora_rank=0, learning_rate=1e-3), device), micro_batch_tokens=4 * tokens)
    first, second = (random_datums(4, tokens, shape["vocab_size"], seed=seed) for seed in (1, 2))
    if cuda:
        torch.cuda.set_device(0)
    rendezvous = (workdir / "rendezvous").resolve().as_uri()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=rendezvous, rank=0, world_size=1)
    try:
        runs = _stepped_twice(shape, config, first, device)
        model, root, optimizer = runs["held"]
        left, returned = _round_trip(root, optimizer, cuda)
        forward = _next_forward_against_gathered(model, root, shape, second, config, device)
        losses, update = _next_updates(runs, second, config, device)
        return {
            "backend": dist.get_backend(),
            "round_trip": "cuda -> cpu -> cuda" if cuda else "float32 -> float64 -> float32 (CPU)",
            "adam_fused": bool(optimizer.defaults.get("fused")),
            "state_left_the_device": left,
            "state_came_back": returned,
            "next_forward_max_difference_against_gathered": forward,
            "next_update_max_difference_against_stayed": update,
            "next_loss_held_and_stayed": [losses["held"], losses["stayed"]],
        }
    finally:
        dist.destroy_process_group()


def _stepped_twice(shape: dict, config: TrainerConfig, datums: list, device: str) -> dict[str, tuple]:
    """Two identical sharded runs after one step: "held" goes through the host, "stayed" is what it must match."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from retool.training.step import optimizer_for, trainable

    runs = {}
    for name in ("held", "stayed"):
        torch.manual_seed(0)
        model = trainable(Qwen3ForCausalLM(Qwen3Config(**shape)), None, config)
        root = _shard(model)  # moves the shards to the device
        optimizer = optimizer_for(model, None, config, device)
        update_policy(root, optimizer, datums, config, len(datums), device)
        runs[name] = model, root, optimizer
    return runs


def _round_trip(root, optimizer, cuda: bool) -> tuple[bool, bool]:
    """The state moved away and back as a held step moves it: whether every shard left, and whether each came back
    (on the CPU the move is to float64 and back, as no second device is there)."""
    from retool.training import resident

    away, back = ("cpu", "cuda") if cuda else (torch.float64, torch.float32)
    resident._move(root, optimizer, away)
    moved = [_local(p) for p in root.parameters()] + [
        _local(v) for state in optimizer.state.values() for k, v in state.items() if k != "step"
    ]
    left = all(t.device.type == away if cuda else t.dtype == away for t in moved)
    resident._move(root, optimizer, back)
    returned = all(t.device.type == "cuda" if cuda else t.dtype == back for t in map(_local, root.parameters()))
    return left, returned


def _next_forward_against_gathered(model, root, shape: dict, datums: list, config: TrainerConfig, device: str):
    """The largest difference of the sharded forward after the round trip from the same weights gathered and
    applied to an unsharded copy: the shards that came back are the weights, whole and in place."""
    from torch.func import functional_call
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from retool.training import parallel
    from retool.training.parallel import TokenLogprobs

    ids = torch.tensor([d.input_tokens for d in datums], device=device)
    targets = torch.tensor([d.target_tokens for d in datums], device=device)
    arguments = (ids, torch.ones_like(ids), targets, torch.ones_like(ids, dtype=torch.bool))
    autocast = torch.autocast(
        torch.device(device).type, torch.bfloat16, enabled=config.autocast_bfloat16 == "true", cache_enabled=False
    )
    with torch.no_grad(), autocast:
        sharded = root(*arguments, config.logprob_chunk_tokens)
        weights, _ = parallel.whole_state(model, None, root)
        plain = TokenLogprobs(Qwen3ForCausalLM(Qwen3Config(**shape)).to(device)).eval()
        whole = {f"policy.{k}": v.to(device) for k, v in weights.items()}
        unsharded = functional_call(plain, whole, (*arguments, config.logprob_chunk_tokens))
    return float((sharded - unsharded).abs().max())


def _next_updates(runs: dict[str, tuple], datums: list, config: TrainerConfig, device: str) -> tuple[dict, float]:
    """The next step of both runs: their losses, and the largest difference of their weights after it (Adam's
    moments that came back must update as those that stayed)."""
    from retool.training import parallel

    losses, weights = {}, {}
    for name, (model, root, optimizer) in runs.items():
        losses[name] = update_policy(root, optimizer, datums, config, len(datums), device).loss
        weights[name] = parallel.whole_state(model, None, root)[0]
    return losses, max(float((weights["held"][k] - weights["stayed"][k]).abs().max()) for k in weights["held"])


def recurrent_with_state_in(query, key, value, g, beta, state_dtype: torch.dtype) -> torch.Tensor:
    """transformers' recurrent gated delta rule with the recurrent state stored in `state_dtype` between tokens
    (each token's arithmetic in float32), as a decoding kernel that keeps its state in the model's dtype does."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

    query, key = (l2norm(x.float(), dim=-1, eps=1e-6) for x in (query, key))
    query = query / query.shape[-1] ** 0.5
    query, key, value, g, beta = (x.transpose(1, 2).float() for x in (query, key, value, g, beta))
    batch, heads, length, key_dim = key.shape
    state = torch.zeros(batch, heads, key_dim, value.shape[-1], dtype=state_dtype, device=key.device)
    out = torch.zeros_like(value)
    for t in range(length):
        current = state.float() * g[:, :, t].exp()[..., None, None]
        delta = (value[:, :, t] - (current * key[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        current = current + key[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (current * query[:, :, t, :, None]).sum(-2)
        state = current.to(state_dtype)
    return out.transpose(1, 2)


def by_position(difference: torch.Tensor) -> dict:
    """Max and mean of |difference| ([batch, tokens, heads, dim]) over each bucket of positions."""
    difference = difference.abs().float()
    buckets = {}
    for name, start, end in position_buckets():
        part = difference[:, start:end]
        if part.numel():
            buckets[name] = {"max": float(part.max()), "mean": float(part.mean())}
    return buckets


def gated_delta(device: str, dry_run: bool) -> dict:
    """Qwen3.5's gated delta rule (its linear attention) on random inputs of the 4B's shape: transformers' own torch
    forms, chunked (the trainer's pass) and recurrent (token by token, as a sampler decodes), the recurrent state
    kept in float32 and in bfloat16, and flash-linear-attention's kernels where they import; each against the
    chunked form, by position. The dry run: 256 tokens of a smaller shape, in float32."""
    tokens, heads, dim = (256, 4, 32) if dry_run else (4096, 32, 128)  # 4B: 32 value heads of 128
    dtype = torch.float32 if dry_run else torch.bfloat16
    inputs = _gated_delta_inputs(tokens, heads, dim, dtype, device)
    timed = _Timed(device)
    reference, outputs, own = _torch_forms(inputs, dtype, timed)
    figures = {
        "tokens": tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "output_mean_abs": float(reference.abs().mean()),
        # the bfloat16-state loop with a float32 state against transformers' own: the loop itself is faithful
        "own_float32_loop_against_transformers_max": float((own - outputs["recurrent_state_float32"]).abs().max()),
    }
    _flash_linear_attention(inputs, device, timed, figures, outputs)
    figures["against_chunked"] = {name: by_position(out - reference) for name, out in outputs.items()}
    figures["seconds"] = timed.seconds
    return figures


def _gated_delta_inputs(tokens: int, heads: int, dim: int, dtype: torch.dtype, device: str) -> tuple:
    """Query, key, value, decay and beta of one sequence, seeded, so that every form sees the same inputs."""
    generator = torch.Generator().manual_seed(0)

    def random(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device)

    query, key, value = (random(1, tokens, heads, dim).to(dtype) for _ in range(3))
    g = torch.nn.functional.logsigmoid(3 * random(1, tokens, heads) + 3)  # per-token decay from ~0.5 to ~1, float32
    beta = torch.sigmoid(random(1, tokens, heads)).to(dtype)
    return query, key, value, g, beta


class _Timed:
    """Runs each form once, its device's queued work waited for before and after, so that its seconds are its own."""

    def __init__(self, device: str):
        self.device = device
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        synchronize(self.device)
        started = time.perf_counter()
        out = run()
        synchronize(self.device)
        self.seconds[name] = round(time.perf_counter() - started, 3)
        return out.float()


def _torch_forms(inputs: tuple, dtype: torch.dtype, timed: _Timed) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """transformers' chunked form (the reference), its recurrent form and the loop with a bfloat16 state (the
    compared outputs), and the loop with a float32 state (which shows the loop itself faithful)."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    # transformers swaps in flash-linear-attention's kernels where installed: its torch forms are the wrapped ones.
    chunked = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    recurrent = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)
    reference = timed("chunked", lambda: chunked(*inputs, use_qk_l2norm_in_kernel=True)[0])
    outputs = {
        "recurrent_state_float32": timed("recurrent", lambda: recurrent(*inputs, use_qk_l2norm_in_kernel=True)[0]),
        "recurrent_state_bfloat16": timed(
            "recurrent_bfloat16_state", lambda: recurrent_with_state_in(*inputs, torch.bfloat16).to(dtype)
        ),
    }
    own = timed("own_recurrent", lambda: recurrent_with_state_in(*inputs, torch.float32).to(dtype))
    return reference, outputs, own


def _flash_linear_attention(inputs: tuple, device: str, timed: _Timed, figures: dict, outputs: dict) -> None:
    """flash-linear-attention's chunked and recurrent kernels into `outputs` where they import and run (a GPU),
    as a sampler or a trainer may run them in place of transformers' forms; why not in `figures`."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as error:
        figures["flash_linear_attention"] = f"not importable: {type(error).__name__}: {error}"[:500]
        return
    if device != "cuda":
        figures["flash_linear_attention"] = "its kernels run on a GPU only"
        return
    figures["flash_linear_attention"] = "imported"
    for name, kernel in (("fla_chunk", chunk_gated_delta_rule), ("fla_recurrent", fused_recurrent_gated_delta_rule)):
        try:
            outputs[name] = timed(name, lambda kernel=kernel: kernel(*inputs, use_qk_l2norm_in_kernel=True)[0])
        except Exception as error:
            figures[name] = f"failed: {type(error).__name__}: {error}"[:500]
