"""The GPU smoke check: `python -m bench.gpu [--out gpu-check.json]` on a CUDA machine, in a few minutes.

Needs only torch, transformers, peft and safetensors (no vLLM, no data, no model weights). Writes one
JSON file with three parts:
  tiny_qwen35  a tiny random model of Qwen3.5's architecture, saved the way the published checkpoint is:
               loaded in bfloat16 with gradient checkpointing, one PPO step, saved, the adapter's tensor
               names checked against the modules the trainer trains and renamed for vLLM's engine;
  memory       a random-weight model of Qwen3.5-4B's shape: the peak memory of one micro-batch of the
               shipped settings next to the memory plan's estimate and the share vLLM leaves free;
  throughput   PPO tokens/s on that micro-batch and model FLOPs utilisation.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from retool.config.sampler import SamplerConfig
from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.sampling.adapters import ADAPTER_WEIGHTS, adapter_for_engine
from retool.training.memory_plan import GIB, plan_step, shape_of
from retool.training.step import load_policy, prepare_policy, train_step

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
# Dense bfloat16 peak FLOP/s by device name, for model FLOPs utilisation.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


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

    from retool.training.checkpoints import save_checkpoint

    started = time.perf_counter()
    base = build_tiny_qwen35(workdir / "tiny-qwen35")
    config = TrainerConfig(lora_rank=8, lora_alpha=16, dtype="bfloat16", gradient_checkpointing=True)
    model, optimizer = load_policy(base, None, config, device)
    metrics = train_step(model, optimizer, random_datums(4, 256, TINY_QWEN35["vocab_size"]), config, 4, device)
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


def check_memory_and_throughput(shape: dict, device: str) -> dict:
    """Peak memory and speed of one micro-batch of the shipped settings on a random model of `shape`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = TrainerConfig()  # the shipped [trainer] section: LoRA 32, bfloat16 on CUDA, checkpointing
    text_config = Qwen3_5TextConfig(**shape)
    torch.cuda.reset_peak_memory_stats()
    free_before, total = torch.cuda.mem_get_info()
    with torch.device(device):
        model = Qwen3_5ForCausalLM(text_config).to(torch.bfloat16)
    model, optimizer = prepare_policy(model, None, config, device)
    datums = random_datums(config.micro_batch_tokens // 8192, 8192, shape["vocab_size"])
    plan = plan_step(shape_of(text_config), config, device)
    timings = []
    for _ in range(2):  # the first warms the kernels up and allocates Adam's moments
        torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = train_step(model, optimizer, datums, replace(config, learning_rate=1e-9), len(datums), device)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated()
    tokens = sum(d.num_tokens for d in datums)
    parameters = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name()
    peak_flops = next((value for key, value in PEAK_BF16.items() if key in name), None)
    flops_per_second = 6 * parameters * tokens / timings[-1]  # model FLOPs: 6 per parameter and token
    left_by_sampler = total * (1 - SamplerConfig().gpu_memory_utilization)
    return {
        "memory": {
            "micro_batch_tokens": config.micro_batch_tokens,
            "plan_gib": round(plan.total / GIB, 2),
            "plan_parts_gib": {k: round(v / GIB, 2) for k, v in asdict(plan).items()},
            "peak_allocated_gib": round(peak / GIB, 2),
            "plan_over_peak": round(plan.total / peak, 3),
            "free_before_gib": round(free_before / GIB, 2),
            "left_free_by_the_sampler_gib": round(left_by_sampler / GIB, 2),
            "peak_fits_beside_the_sampler": peak < left_by_sampler,
        },
        "throughput": {
            "tokens_per_second": round(tokens / timings[-1]),
            "step_seconds": [round(t, 2) for t in timings],
            "model_flops_utilisation": round(flops_per_second / peak_flops, 3) if peak_flops else None,
            "parameters": parameters,
            "loss": metrics.loss,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu", description="GPU smoke check of the trainer; figures to one JSON file."
    )
    parser.add_argument(
        "--out", type=Path, default=Path("gpu-check.json"), help="JSON file for the figures (default: %(default)s)"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to run the tiny Qwen3.5 part alone")
    args = parser.parse_args()
    figures = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="retool-gpu-check-") as workdir:
        figures["tiny_qwen35"] = check_tiny_qwen35(Path(workdir), args.device)
    if args.device == "cuda":
        figures.update(check_memory_and_throughput(QWEN35_4B, args.device))
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
