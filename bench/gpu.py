"""The GPU check: `python -m bench.gpu [--out gpu-check.json]` on a CUDA machine, within 9 minutes.

Needs only torch, transformers, peft and safetensors (no vLLM, no data, no weights, no network: every model is built
from a config in code). Writes its JSON after every phase. A phase that raises is recorded under "failed" (the error
and its traceback's last lines), its memory freed, and the next one runs; the exit status is 1 when any failed. A
phase that would start past --deadline-seconds is named under "skipped"; one that cannot run on this machine, under
"not_run" with the reason. What a phase writes is removed after it (the disk of a bare node is 64 GiB).
`--dry-run` runs every phase on the CPU with tiny shapes (the suite does); `--fail-phase NAME` checks the check.
bench.gpu_harness runs the phases; lora_step_4b, full and save_load are in bench.gpu_speed, and the phases of
the GPU-only branches (fork_check, fsdp_held_round_trip, gated_delta) in bench.gpu_branches.

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
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.gpu_branches import fork_check, fsdp_held_round_trip, gated_delta
from bench.gpu_harness import add_phase_options, random_datums, recipe, report, run_checked, synchronize
from bench.gpu_speed import add_utilisation_of_measured_peak, policy_step, save_load
from retool.config.trainer import TrainerConfig
from retool.sampling.adapters import ADAPTER_WEIGHTS, adapter_for_engine
from retool.training.checkpoints import save_checkpoint
from retool.training.memory_plan import GIB
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
# Dense bfloat16 peak FLOP/s by device name, for model FLOPs utilisation.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


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
    synchronize(device)
    started, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        a @ b
    synchronize(device)
    measured = 2 * n**3 * repeats / (time.perf_counter() - started)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cuda": torch.version.cuda,
        "disk_free_gib": round(shutil.disk_usage(workdir).free / GIB, 1),
        "measured_matmul_tflops": float(f"{measured / 1e12:.3g}"),  # 3 figures: a dry run's CPU is under 0.1
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


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description="GPU check of the trainer; one JSON file.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="the JSON file (default: %(default)s)")
    add_phase_options(parser, dry_run="every phase on the CPU with tiny shapes")
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
        run_checked(parser, args, phases, figures, started, device, scratch)
    add_utilisation_of_measured_peak(figures, ("lora_step_4b", "full"))
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return report(figures)


if __name__ == "__main__":
    sys.exit(main())
