"""The GPU check: `python -m bench.gpu [--out gpu-check.json]` on a CUDA machine, within 8 minutes.

Needs only torch, transformers, peft and safetensors (no vLLM, no data, no weights: every model is built from a
config in code). Writes its JSON after every phase; a phase that would start past --deadline-seconds is skipped
and named under "skipped". `--dry-run` runs every phase on the CPU with tiny shapes (the suite does).
  environment        versions, the device, and a measured bfloat16 matrix-product peak
  checkpoint_keys    a full step of a tiny Qwen3.5 saved as published (multimodal): its names are the published
                     language-model names, which vLLM's served classes map
  tiny_lora          a LoRA step of the tiny Qwen3.5: adapter names against the trained modules, renamed for vLLM
  bfloat16_updates   the share of weights one Adam step changes at lr 4e-6, 1e-5 and 4e-5: weights held in
                     bfloat16 against float32 master weights with bfloat16 products (what `auto` trains)
  lora, full         a model of Qwen3.5-4B's shape, LoRA 32 and a full fine-tune: the memory plan against the
                     reserved peak after the build, step seconds, and model FLOPs utilisation counting the FLOPs
                     each mode does (LoRA 4, full 6 per parameter and token)
  save_load          seconds to save a full step's checkpoint (weights, Adam state) and load it back
  resident           three steps of the tiny Qwen3.5 held on the host between steps against three that load from
                     disk: the largest difference of the final weights, LoRA and full fine-tune
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

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
                inputs = StepInputs(base, (workdir / "datums.parquet",), 4, 0, previous, folder / f"step{step}", config)
                train_from_files(inputs, device, hold_on)
            resident.drop()
            weights = "adapter/" + ADAPTER_WEIGHTS if rank else "model/model.safetensors"
            final[mode] = load_file(str(folder / "step2" / weights))
        differences = [
            float((final["held"][k].float() - final["loaded"][k].float()).abs().max()) for k in final["held"]
        ]
        figures[f"{name}_max_difference_held_against_loaded"] = max(differences)
    return figures


def _autocast(device: str) -> str:
    """bfloat16 products on a GPU; on the CPU of a dry run, float32 (it checks that phases run, not speed)."""
    return "true" if device == "cuda" else "false"


def environment(device: str) -> dict:
    """Versions, the device and the bfloat16 matrix-product rate measured on it (the MFU denominators)."""
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
        "measured_matmul_tflops": round(measured / 1e12, 1),
        "listed_bfloat16_tflops": next((v / 1e12 for k, v in PEAK_BF16.items() if k in name), None),
    }


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
    """One micro-batch of `config` on a random model of `shape`: plan, reserved peak, step time, MFU."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text_config = Qwen3_5TextConfig(**shape)
    weights_dtype = torch.bfloat16 if config.lora_rank and device == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen3_5ForCausalLM(text_config).to(weights_dtype)
    model, optimizer = prepare_policy(model, None, config, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # after the build, whose float32 copy no step holds
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


def save_load(workdir: Path, shape: dict, device: str) -> dict:
    """Seconds to write a full fine-tune step's checkpoint (weights, Adam state, RNG) and to load it back."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = TrainerConfig(
        lora_rank=0, gradient_checkpointing=device == "cuda", autocast_bfloat16=_autocast(device)
    ).on(device)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape))
    model, optimizer = prepare_policy(model, None, config, device)
    metrics = update_policy(model, optimizer, random_datums(1, 256, shape["vocab_size"]), config, 1, device)
    base = workdir / "base"
    model.config.save_pretrained(base)
    started = time.perf_counter()
    save_checkpoint(workdir / "step", model, optimizer, metrics, config, base)
    saved = time.perf_counter() - started
    del model, optimizer
    started = time.perf_counter()
    load_policy(base, workdir / "step", config, device)
    _synchronize(device)
    return {
        "save_seconds": round(saved, 2),
        "load_seconds": round(time.perf_counter() - started, 2),
        "checkpoint_mib": round(sum(f.stat().st_size for f in (workdir / "step").rglob("*") if f.is_file()) / 2**20, 1),
    }


def run_phases(phases: dict[str, Callable[[], dict]], figures: dict, out: Path, deadline: float, device: str) -> None:
    """Each phase's figures and seconds into `figures`, written to `out` after every phase (what is measured
    survives a later failure); a phase that would start past `deadline` (time.monotonic) is named under
    "skipped"."""
    for name, phase in phases.items():
        if time.monotonic() > deadline:
            figures["skipped"].append(name)
        else:
            started = time.monotonic()
            figures[name] = phase()
            figures[name + "_seconds"] = round(time.monotonic() - started, 1)
            if device == "cuda":
                torch.cuda.empty_cache()
        out.write_text(json.dumps(figures, indent=2) + "\n")


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description="GPU check of the trainer; one JSON file.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="the JSON file (default: %(default)s)")
    parser.add_argument("--deadline-seconds", type=float, default=480.0, help="start no phase after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="every phase on the CPU with tiny shapes")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    shape = TINY_QWEN35 if args.dry_run else QWEN35_4B
    lora = TrainerConfig(autocast_bfloat16=_autocast(device), gradient_checkpointing=device == "cuda").on(
        device
    )  # LoRA 32
    full = replace(lora, lora_rank=0)  # float32 master weights and Adam state, bfloat16 products
    if args.dry_run:
        lora, full = (replace(c, micro_batch_tokens=256) for c in (lora, full))
    figures: dict = {"dry_run": args.dry_run, "skipped": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="retool-gpu-check-") as workdir:
        phases: dict[str, Callable[[], dict]] = {
            "environment": lambda: environment(device),
            "checkpoint_keys": lambda: checkpoint_keys(Path(workdir) / "keys", device),
            "tiny_lora": lambda: check_tiny_qwen35(Path(workdir) / "lora", device),
            "bfloat16_updates": lambda: bfloat16_updates(device, args.dry_run),
            "lora": lambda: policy_step(shape, lora, device),
            "full": lambda: policy_step(shape, full, device),
            "save_load": lambda: save_load(Path(workdir) / "save", shape, device),
            "resident": lambda: resident_steps(Path(workdir) / "resident", device),
        }
        run_phases(phases, figures, args.out, started + args.deadline_seconds, device)
    measured = figures.get("environment", {}).get("measured_matmul_tflops")
    for name in ("lora", "full"):
        if name in figures and measured:
            figures[name]["mfu_of_measured_peak"] = round(
                figures[name]["model_flops_per_second"] / (measured * 1e12), 3
            )
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
