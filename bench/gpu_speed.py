"""The trainer's figures of speed and memory in the GPU check (bench.gpu): a step of the 4B's shape as a recipe
resolves it (the memory plan against the reserved peak, step seconds, model FLOPs utilisation) and the seconds to
save a full step's checkpoint and load it back."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.gpu_harness import random_datums, synchronize
from retool.config.trainer import TrainerConfig
from retool.training.checkpoints import save_checkpoint
from retool.training.memory_plan import GIB, plan_step, shape_of
from retool.training.step import load_policy, prepare_policy, update_policy


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
        synchronize(device)
        started = time.perf_counter()
        update_policy(model, optimizer, datums, replace(config, learning_rate=1e-9), len(datums), device)
        synchronize(device)
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
    synchronize(device)
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


def add_utilisation_of_measured_peak(figures: dict, steps: tuple[str, ...]) -> None:
    """Each measured step's model FLOPs utilisation of the matrix-product rate the environment phase measured (the
    listed peak may be out of reach of this device's clocks and power)."""
    measured = figures.get("environment", {}).get("measured_matmul_tflops")
    for name in steps:
        if name in figures and measured:
            figures[name]["mfu_of_measured_peak"] = round(
                figures[name]["model_flops_per_second"] / (measured * 1e12), 3
            )
