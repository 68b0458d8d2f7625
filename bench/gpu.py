"""The GPU check: `python -m bench.gpu [--out gpu-check.json]` on a CUDA machine, within 9 minutes.

Needs only torch, transformers, peft and safetensors (no vLLM, no data, no weights, no network: every model is built
from a config in code). Writes its JSON after every phase. A phase that raises is recorded under "failed" (the error
and its traceback's last lines), its memory freed, and the next one runs; the exit status is 1 when any failed. A
phase that would start past --deadline-seconds is named under "skipped"; one that cannot run on this machine, under
"not_run" with the reason. What a phase writes is removed after it (the disk of a bare node is 64 GiB).
`--dry-run` runs every phase on the CPU with tiny shapes (the suite does); `--fail-phase NAME` checks the check.

Phases, with their estimated seconds on one H100 (about 6 minutes in all, model builds and imports included):
  environment (10)        versions, the device, free disk, and a measured bfloat16 matrix-product peak
  fork_check (20)         in fresh processes: whether CUDA stays uninitialised after the machine check (NVML-based
                          device count) and after a plain torch.cuda.is_available(), and whether a forked child can
                          then use CUDA
  checkpoint_keys (10)    a full step of a tiny Qwen3.5 saved as published (multimodal): its names are the published
                          language-model names, which vLLM's served classes map
  tiny_lora (10)          a LoRA step of the tiny Qwen3.5: adapter names against the trained modules, renamed for vLLM
  bfloat16_updates (30)   the share of weights one Adam step changes at lr 4e-6, 1e-5 and 4e-5: weights held in
                          bfloat16 against float32 master weights with bfloat16 products (what `auto` trains)
  lora_step_4b (60)       Qwen3.5-4B's shape, LoRA 32 as the recipe resolves it: the memory plan against the reserved
                          peak after the build, step seconds, model FLOPs utilisation (4 FLOPs a parameter and token)
  full (60)               a full fine-tune as the recipe resolves it (float32 weights and Adam state, bfloat16
                          products, Adam from the trainer's own code) on 12 of the 4B's 32 layers: the same figures
                          (6 FLOPs a parameter and token)
  save_load (60)          seconds to save a full step's checkpoint (weights, Adam state) of 4 of the 4B's layers
                          and to load it back
  resident (20)           three steps of the tiny Qwen3.5 held on the host between steps against three that load from
                          disk: the largest difference of the final weights, LoRA and full fine-tune
  fsdp_held_round_trip (20)  a small model under FSDP2 (one process): its state to the host and back as a held step
                          moves it, then the next forward against the gathered weights and the next update against a
                          run that stayed on the GPU
  gated_delta (30)        Qwen3.5's gated delta rule over 4096 tokens in bfloat16: the recurrent form (the state
                          kept in float32, and in bfloat16) and flash-linear-attention's kernels against the chunked
                          form, by position
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from retool.config.settings import RunSettings
from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.sampling.adapters import ADAPTER_WEIGHTS, adapter_for_engine
from retool.training.checkpoints import save_checkpoint
from retool.training.memory_plan import GIB, plan_step, shape_of
from retool.training.step import load_policy, prepare_policy, update_policy

# The text model of Qwen3.5-4B as published (model_type qwen3_5_text).
QWEN35_4B = dict(
    vocab_size=248_320,
    hidden_size=2560,
    intermediate_size=9216,
    num_hidden_layers=32,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)
# A 4B full fine-tune holds 16 bytes a weight (float32 weights, gradients, two Adam moments): 67 GB, and the memory
# plan 87 GiB with activations and logits, over one 80 GB H100 (a node shards it over 8 GPUs with FSDP2). 12 of its
# layers (2.0B weights, plan 44 GiB) keep the 4B's layer, vocabulary and micro-batch shapes and fit one GPU.
FULL_LAYERS = 12
# A 4B step's checkpoint is 47 GB (float32 weights and Adam moments); 4 layers (1.1B weights) write 13 GB, enough to
# measure the rates beside the 64 GiB disk's other contents.
SAVE_LOAD_LAYERS = 4
# A tiny model of the same architecture: one linear-attention and one full-attention layer.
TINY_QWEN35 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
# The model FSDP2 shards in fsdp_held_round_trip: a small Qwen3 on a GPU, a tiny one on the CPU.
FSDP_QWEN3 = dict(
    vocab_size=32_000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
)  # fmt: skip
TINY_QWEN3 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
)  # fmt: skip
# Dense bfloat16 peak FLOP/s by device name, for model FLOPs utilisation.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}
POSITION_BUCKETS = (0, 16, 64, 256, 1024)  # differences by position: [0, 16), [16, 64), ..., [1024, end)


class NotRunHere(Exception):
    """A phase that cannot run on this machine: its reason is recorded under "not_run" (not a failure)."""


def random_datums(count: int, tokens: int, vocab: int, seed: int = 0) -> list[Datum]:
    """Datums of `tokens` tokens whose second half is sampled (loss tokens), with mixed advantages."""
    rng = random.Random(seed)
    datums = []
    for index in range(count):
        ids = [rng.randrange(vocab) for _ in range(tokens + 1)]
        mask = [position >= tokens // 2 for position in range(tokens)]
        advantage = 1.0 if index % 2 else -1.0
        datums.append(
            Datum(0, index, ids[:-1], ids[1:], [-2.0 if m else 0.0 for m in mask], [advantage * m for m in mask], mask)
        )
    return datums


def recipe(trainer: TrainerConfig, device: str) -> TrainerConfig:
    """`trainer` with every `auto` resolved for `device` as a run's settings resolve it."""
    return RunSettings().changed(run={"device": device}).on_device(trainer)


def layers_of(shape: dict, layers: int) -> dict:
    """`shape` with its first `layers` decoder layers (at most all of them)."""
    layers = min(layers, shape["num_hidden_layers"])
    return {**shape, "num_hidden_layers": layers, "layer_types": list(shape["layer_types"][:layers])}


def build_tiny_qwen35(folder: Path) -> Path:
    """A random Qwen3.5 checkpoint saved as the published one is: Qwen3_5ForConditionalGeneration."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TINY_QWEN35, vision_config=TINY_VISION))
    model.save_pretrained(folder)
    return folder


def check_tiny_qwen35(workdir: Path, device: str) -> dict:
    """One PPO step of LoRA on the tiny Qwen3.5 in bfloat16 with checkpointing; its adapter names."""
    from safetensors.torch import load_file

    started = time.perf_counter()
    base = build_tiny_qwen35(workdir / "tiny-qwen35")
    config = TrainerConfig(
        lora_rank=8, lora_alpha=16, dtype="bfloat16", gradient_checkpointing=True, autocast_bfloat16=_autocast(device)
    ).on(device)
    model, optimizer = load_policy(base, None, config, device)
    metrics = update_policy(model, optimizer, random_datums(4, 256, TINY_QWEN35["vocab_size"]), config, 4, device)
    save_checkpoint(workdir / "checkpoint", model, optimizer, metrics, config, base)
    adapter = workdir / "checkpoint" / "adapter"
    trained = set(load_file(str(adapter / ADAPTER_WEIGHTS)))
    modules = {name for name, _ in model.named_modules()}
    unmatched = sorted(k for k in trained if k.rsplit(".lora_", 1)[0] not in modules)
    served = set(load_file(str(adapter_for_engine(adapter, base, workdir / "served") / ADAPTER_WEIGHTS)))
    return {
        "loss": metrics.loss,
        "grad_norm": metrics.grad_norm,
        "adapter_tensors": len(trained),
        "adapter_tensors_matching_no_trained_module": unmatched,
        "linear_attention_tensors": sum("linear_attn" in k for k in trained),
        "served_under_language_model": all(k.startswith("base_model.model.model.language_model.") for k in served),
        "seconds": round(time.perf_counter() - started, 1),
    }


def resident_steps(workdir: Path, device: str) -> dict:
    """Three steps of the tiny Qwen3.5, LoRA and full fine-tune, the state held on the host between steps (as
    beside a sampler on the same GPU) against each step loading its predecessor from disk: the largest difference
    between their final weights (0 on a CPU; on a GPU, what nondeterministic kernels leave)."""
    from safetensors.torch import load_file

    from retool.files.tables import DATUMS, table_from_rows, write_table_atomically
    from retool.training import resident
    from retool.training.resume import StepInputs, train_from_files

    base = build_tiny_qwen35(workdir / "tiny-qwen35")
    rows = [
        {"step": 0, **asdict(d), "num_tokens": d.num_tokens} for d in random_datums(4, 256, TINY_QWEN35["vocab_size"])
    ]
    write_table_atomically(table_from_rows(rows, DATUMS), workdir / "datums.parquet")
    figures = {}
    try:
        for name, rank in (("lora", 8), ("full", 0)):
            config = TrainerConfig(
                lora_rank=rank, lora_alpha=16, learning_rate=1e-4, autocast_bfloat16=_autocast(device),
                gradient_checkpointing=device == "cuda", micro_batch_tokens=1024,
            ).on(device)  # fmt: skip
            final = {}
            for mode, hold_on in (("held", "cpu"), ("loaded", "")):
                folder = workdir / f"{name}-{mode}"
                for step in range(3):
                    previous = folder / f"step{step - 1}" if step else None
                    out = folder / f"step{step}"
                    train_from_files(StepInputs(base, (workdir / "datums.parquet",), 4, 0, previous, out, config),
                                     device, hold_on)  # fmt: skip
                resident.drop()
                weights = "adapter/" + ADAPTER_WEIGHTS if rank else "model/model.safetensors"
                final[mode] = load_file(str(folder / "step2" / weights))
            differences = [
                float((final["held"][k].float() - final["loaded"][k].float()).abs().max()) for k in final["held"]
            ]
            figures[f"{name}_max_difference_held_against_loaded"] = max(differences)
    finally:
        resident.drop()  # a failed step must not leave its state held for the phases after it
    return figures


def _autocast(device: str) -> str:
    """bfloat16 products on a GPU; on the CPU of a dry run, float32 (it checks that phases run, not speed)."""
    return "true" if device == "cuda" else "false"


def environment(device: str, workdir: Path) -> dict:
    """Versions, the device, the disk free for the phases' files, and the bfloat16 matrix-product rate measured on
    the device (the MFU denominators)."""
    import peft
    import transformers

    n = 8192 if device == "cuda" else 256
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    _synchronize(device)
    started, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        a @ b
    _synchronize(device)
    measured = 2 * n**3 * repeats / (time.perf_counter() - started)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cuda": torch.version.cuda,
        "disk_free_gib": round(shutil.disk_usage(workdir).free / GIB, 1),
        "measured_matmul_tflops": round(measured / 1e12, 1),
        "listed_bfloat16_tflops": next((v / 1e12 for k, v in PEAK_BF16.items() if k in name), None),
    }


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


def checkpoint_keys(workdir: Path, device: str) -> dict:
    """A full fine-tune step of the tiny multimodal Qwen3.5 saved: the names it holds against the published ones."""
    from safetensors.torch import load_file

    base = build_tiny_qwen35(workdir / "published")
    config = TrainerConfig(
        lora_rank=0, learning_rate=1e-4, gradient_checkpointing=False, autocast_bfloat16=_autocast(device)
    ).on(device)
    model, optimizer = load_policy(base, None, config, device)
    metrics = update_policy(model, optimizer, random_datums(2, 64, TINY_QWEN35["vocab_size"]), config, 2, device)
    save_checkpoint(workdir / "full-step", model, optimizer, metrics, config, base)
    saved = set(load_file(str(workdir / "full-step" / "model" / "model.safetensors")))
    published = set(load_file(str(base / "model.safetensors")))
    language_model = {name for name in published if not name.startswith("model.visual.")}
    return {
        "saved_tensors": len(saved),
        "missing_language_model_names": sorted(language_model - saved),
        "names_not_published": sorted(saved - published),
    }


def bfloat16_updates(device: str, dry_run: bool) -> dict:
    """The share of weights that one Adam step changes: weights in bfloat16, and float32 master weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    shape = TINY_QWEN35 if dry_run else {**TINY_QWEN35, "hidden_size": 1024, "intermediate_size": 3072, "head_dim": 128}
    datums = random_datums(2, 128, shape["vocab_size"])
    shares = {}
    for learning_rate in (4e-6, 1e-5, 4e-5):
        for name, dtype in (("bfloat16_weights", "bfloat16"), ("float32_master", "float32")):
            torch.manual_seed(0)
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape)).to(device)
            config = TrainerConfig(
                lora_rank=0,
                learning_rate=learning_rate,
                dtype=dtype,
                autocast_bfloat16="true",
                gradient_checkpointing=False,
            ).on(device)
            model = model.to(getattr(torch, dtype))
            model, optimizer = prepare_policy(model, None, config, device)
            before = [p.detach().clone() for p in model.parameters()]
            update_policy(model, optimizer, datums, config, len(datums), device)
            shares[f"lr {learning_rate:g}, {name}"] = round(share_updated(model, optimizer, before), 4)
            del model, optimizer, before
    return shares


def share_updated(model, optimizer, before: list[torch.Tensor]) -> float:
    """Of the weights that had a gradient (Adam's first moment is not 0: an embedding row of a token no datum
    holds has none), the share whose value changed in the optimizer step."""
    changed = moved = 0
    for parameter, old in zip(model.parameters(), before):
        if parameter in optimizer.state:
            had_gradient = optimizer.state[parameter]["exp_avg"] != 0
            changed += int(((parameter.detach() != old) & had_gradient).sum())
            moved += int(had_gradient.sum())
    return changed / moved


def policy_step(shape: dict, config: TrainerConfig, device: str) -> dict:
    """One micro-batch of `config` on a random model of `shape`, built in the config's weight dtype and made
    trainable with its optimizer by the trainer's own code: plan, reserved peak, step time, MFU."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text_config = Qwen3_5TextConfig(**shape)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(text_config).to(getattr(torch, config.dtype))
    model, optimizer = prepare_policy(model, None, config, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # after the build, whose float32 copy of a LoRA's base no step holds
    tokens_per_datum = min(8192, config.micro_batch_tokens)
    datums = random_datums(max(1, config.micro_batch_tokens // tokens_per_datum), tokens_per_datum, shape["vocab_size"])
    plan = plan_step(shape_of(text_config), config)
    timings = []
    for _ in range(2):  # the first warms the kernels up and allocates Adam's moments
        _synchronize(device)
        started = time.perf_counter()
        update_policy(model, optimizer, datums, replace(config, learning_rate=1e-9), len(datums), device)
        _synchronize(device)
        timings.append(time.perf_counter() - started)
    tokens = sum(d.num_tokens for d in datums)
    parameters = sum(p.numel() for p in model.parameters() if not p.requires_grad or not config.lora_rank)
    flops_per_token = (4 if config.lora_rank else 6) * parameters  # LoRA computes no gradient of the frozen weights
    figures = {
        "layers": shape["num_hidden_layers"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainer": {name: getattr(config, name) for name in ("dtype", "autocast_bfloat16", "data_parallel")},
        "adam_fused": bool(optimizer.defaults.get("fused")),
        "plan_gib": round(plan.total / GIB, 2),
        "plan_parts_gib": {k: round(v / GIB, 2) for k, v in asdict(plan).items()},
        "step_seconds": [round(t, 3) for t in timings],
        "tokens_per_second": round(tokens / timings[-1]),
        "model_flops_per_second": flops_per_token * tokens / timings[-1],
    }
    if device == "cuda":
        reserved, total = torch.cuda.max_memory_reserved(), torch.cuda.mem_get_info()[1]
        figures.update(
            reserved_peak_gib=round(reserved / GIB, 2),
            plan_over_reserved_peak=round(plan.total / reserved, 3),
            fits_with_the_sampler_asleep=reserved < total,  # vLLM sleeps while a step trains
        )
    del model, optimizer
    return figures


def save_load(workdir: Path, shape: dict, config: TrainerConfig, device: str) -> dict:
    """Seconds to write a full fine-tune step's checkpoint (weights, Adam state, RNG) and to load it back."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    with torch.device(device):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape)).to(getattr(torch, config.dtype))
    model, optimizer = prepare_policy(model, None, config, device)
    metrics = update_policy(model, optimizer, random_datums(1, 256, shape["vocab_size"]), config, 1, device)
    parameters = sum(p.numel() for p in model.parameters())
    base = workdir / "base"
    model.config.save_pretrained(base)
    started = time.perf_counter()
    save_checkpoint(workdir / "step", model, optimizer, metrics, config, base)
    saved = time.perf_counter() - started
    del model, optimizer
    started = time.perf_counter()
    loaded = load_policy(base, workdir / "step", config, device)
    _synchronize(device)
    load_seconds = time.perf_counter() - started
    del loaded
    size = sum(f.stat().st_size for f in (workdir / "step").rglob("*") if f.is_file())
    return {
        "layers": shape["num_hidden_layers"],
        "parameters": parameters,
        "save_seconds": round(saved, 2),
        "load_seconds": round(load_seconds, 2),
        "checkpoint_mib": round(size / 2**20, 1),
        "save_gb_per_second": round(size / 1e9 / saved, 2),
        "load_gb_per_second": round(size / 1e9 / load_seconds, 2),
    }


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
    from torch.func import functional_call
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from retool.training import parallel, resident
    from retool.training.parallel import TokenLogprobs
    from retool.training.step import optimizer_for, trainable

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
        runs = {}
        for name in ("held", "stayed"):
            torch.manual_seed(0)
            model = trainable(Qwen3ForCausalLM(Qwen3Config(**shape)), None, config)
            root = _shard(model)  # moves the shards to the device
            optimizer = optimizer_for(model, None, config, device)
            update_policy(root, optimizer, first, config, len(first), device)
            runs[name] = model, root, optimizer
        model, root, optimizer = runs["held"]
        away, back = ("cpu", "cuda") if cuda else (torch.float64, torch.float32)
        resident._move(root, optimizer, away)
        moved = [_local(p) for p in root.parameters()] + [
            _local(v) for state in optimizer.state.values() for k, v in state.items() if k != "step"
        ]
        left = all(t.device.type == away if cuda else t.dtype == away for t in moved)
        resident._move(root, optimizer, back)
        returned = all(t.device.type == "cuda" if cuda else t.dtype == back for t in map(_local, root.parameters()))

        ids = torch.tensor([d.input_tokens for d in second], device=device)
        targets = torch.tensor([d.target_tokens for d in second], device=device)
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
        losses = {}
        for name, (model, root, optimizer) in runs.items():
            losses[name] = update_policy(root, optimizer, second, config, len(second), device).loss
            runs[name] = parallel.whole_state(model, None, root)[0]
        update = max(float((runs["held"][k] - runs["stayed"][k]).abs().max()) for k in runs["held"])
        return {
            "backend": dist.get_backend(),
            "round_trip": "cuda -> cpu -> cuda" if cuda else "float32 -> float64 -> float32 (CPU)",
            "adam_fused": bool(optimizer.defaults.get("fused")),
            "state_left_the_device": left,
            "state_came_back": returned,
            "next_forward_max_difference_against_gathered": float((sharded - unsharded).abs().max()),
            "next_update_max_difference_against_stayed": update,
            "next_loss_held_and_stayed": [losses["held"], losses["stayed"]],
        }
    finally:
        dist.destroy_process_group()


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
    for start, end in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:] + (None,), strict=True):
        part = difference[:, start:end]
        if part.numel():
            buckets[f"{start}-{end or 'end'}"] = {"max": float(part.max()), "mean": float(part.mean())}
    return buckets


def gated_delta(device: str, dry_run: bool) -> dict:
    """Qwen3.5's gated delta rule (its linear attention) on random inputs of the 4B's shape: transformers' own torch
    forms, chunked (the trainer's pass) and recurrent (token by token, as a sampler decodes), the recurrent state
    kept in float32 and in bfloat16, and flash-linear-attention's kernels where they import; each against the
    chunked form, by position. The dry run: 256 tokens of a smaller shape, in float32."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    # transformers swaps in flash-linear-attention's kernels where installed: its torch forms are the wrapped ones.
    chunked = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    recurrent = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)
    tokens, heads, dim = (256, 4, 32) if dry_run else (4096, 32, 128)  # 4B: 32 value heads of 128
    dtype = torch.float32 if dry_run else torch.bfloat16
    generator = torch.Generator().manual_seed(0)

    def random(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device)

    query, key, value = (random(1, tokens, heads, dim).to(dtype) for _ in range(3))
    g = torch.nn.functional.logsigmoid(3 * random(1, tokens, heads) + 3)  # per-token decay from ~0.5 to ~1, float32
    beta = torch.sigmoid(random(1, tokens, heads)).to(dtype)
    inputs = (query, key, value, g, beta)
    timings = {}

    def timed(name: str, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        _synchronize(device)
        started = time.perf_counter()
        out = run()
        _synchronize(device)
        timings[name] = round(time.perf_counter() - started, 3)
        return out.float()

    reference = timed("chunked", lambda: chunked(*inputs, use_qk_l2norm_in_kernel=True)[0])
    outputs = {
        "recurrent_state_float32": timed("recurrent", lambda: recurrent(*inputs, use_qk_l2norm_in_kernel=True)[0]),
        "recurrent_state_bfloat16": timed(
            "recurrent_bfloat16_state", lambda: recurrent_with_state_in(*inputs, torch.bfloat16).to(dtype)
        ),
    }
    own = timed("own_recurrent", lambda: recurrent_with_state_in(*inputs, torch.float32).to(dtype))
    figures = {
        "tokens": tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "output_mean_abs": float(reference.abs().mean()),
        # the bfloat16-state loop with a float32 state against transformers' own: the loop itself is faithful
        "own_float32_loop_against_transformers_max": float((own - outputs["recurrent_state_float32"]).abs().max()),
    }
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as error:
        figures["flash_linear_attention"] = f"not importable: {type(error).__name__}: {error}"[:500]
    else:
        if device != "cuda":
            figures["flash_linear_attention"] = "its kernels run on a GPU only"
        else:
            figures["flash_linear_attention"] = "imported"
            for name, kernel in (
                ("fla_chunk", chunk_gated_delta_rule),
                ("fla_recurrent", fused_recurrent_gated_delta_rule),
            ):
                try:
                    outputs[name] = timed(name, lambda kernel=kernel: kernel(*inputs, use_qk_l2norm_in_kernel=True)[0])
                except Exception as error:
                    figures[name] = f"failed: {type(error).__name__}: {error}"[:500]
    figures["against_chunked"] = {name: by_position(out - reference) for name, out in outputs.items()}
    figures["seconds"] = timings
    return figures


def free_memory(device: str) -> None:
    """What a finished (or failed) phase held, freed before the next one starts."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_phases(
    phases: dict[str, Callable[[], dict]],
    figures: dict,
    out: Path,
    deadline: float,
    device: str,
    fail: Sequence[str] = (),
    scratch: Path | None = None,
) -> bool:
    """Each phase's figures and seconds into `figures`, written to `out` after every phase (what is measured
    survives a later failure). A phase that raises is recorded under "failed" and the next one runs; one that
    raises NotRunHere is named under "not_run" with its reason; one that would start past `deadline`
    (time.monotonic) is named under "skipped"; one named in `fail` raises at its start. With `scratch`, each
    phase's folder there (scratch / name) is made before it and removed after it. Whether none failed."""
    for key, empty in (("skipped", []), ("failed", {}), ("not_run", {})):
        figures.setdefault(key, empty)
    for name, phase in phases.items():
        if time.monotonic() > deadline:
            figures["skipped"].append(name)
        else:
            if scratch is not None:
                (scratch / name).mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            try:
                if name in fail:
                    raise RuntimeError(f"made to fail by --fail-phase {name}")
                figures[name] = phase()
            except NotRunHere as reason:
                figures["not_run"][name] = str(reason)
            except Exception as error:
                figures["failed"][name] = {
                    "error": f"{type(error).__name__}: {error}"[:2000],
                    "traceback": traceback.format_exc().splitlines()[-12:],
                }
            figures[name + "_seconds"] = round(time.monotonic() - started, 1)
            free_memory(device)  # after the except clause, which freed the traceback and its frames' tensors
            if scratch is not None:
                shutil.rmtree(scratch / name, ignore_errors=True)
        out.write_text(json.dumps(figures, indent=2) + "\n")
    return not figures["failed"]


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description="GPU check of the trainer; one JSON file.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="the JSON file (default: %(default)s)")
    parser.add_argument("--deadline-seconds", type=float, default=480.0, help="start no phase after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="every phase on the CPU with tiny shapes")
    parser.add_argument(
        "--fail-phase", action="append", default=[], metavar="NAME",
        help="a check of the check itself: phase NAME raises at its start; it is recorded as failed, the others "
        "still run, and the exit status is 1 (may be given more than once)",
    )  # fmt: skip
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    shape = TINY_QWEN35 if args.dry_run else QWEN35_4B
    lora = recipe(TrainerConfig(), device)  # LoRA 32: a bfloat16 base on CUDA, bfloat16 products
    full = recipe(TrainerConfig(lora_rank=0), device)  # float32 weights and Adam state, bfloat16 products, FSDP2
    if args.dry_run:
        lora, full = (replace(c, micro_batch_tokens=256) for c in (lora, full))
    figures: dict = {"dry_run": args.dry_run}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="retool-gpu-check-") as workdir:
        scratch = Path(workdir)
        phases: dict[str, Callable[[], dict]] = {
            "environment": lambda: environment(device, scratch),
            "fork_check": lambda: fork_check(device),
            "checkpoint_keys": lambda: checkpoint_keys(scratch / "checkpoint_keys", device),
            "tiny_lora": lambda: check_tiny_qwen35(scratch / "tiny_lora", device),
            "bfloat16_updates": lambda: bfloat16_updates(device, args.dry_run),
            "lora_step_4b": lambda: policy_step(shape, lora, device),
            "full": lambda: policy_step(layers_of(shape, FULL_LAYERS), full, device),
            "save_load": lambda: save_load(scratch / "save_load", layers_of(shape, SAVE_LOAD_LAYERS), full, device),
            "resident": lambda: resident_steps(scratch / "resident", device),
            "fsdp_held_round_trip": lambda: fsdp_held_round_trip(scratch / "fsdp_held_round_trip", device),
            "gated_delta": lambda: gated_delta(device, args.dry_run),
        }
        unknown = sorted(set(args.fail_phase) - set(phases))
        if unknown:
            parser.error(f"--fail-phase {', '.join(unknown)}: no such phase (phases: {', '.join(phases)})")
        run_phases(phases, figures, args.out, started + args.deadline_seconds, device, args.fail_phase, scratch)
    measured = figures.get("environment", {}).get("measured_matmul_tflops")
    for name in ("lora_step_4b", "full"):
        if name in figures and measured:
            figures[name]["mfu_of_measured_peak"] = round(
                figures[name]["model_flops_per_second"] / (measured * 1e12), 3
            )
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
