"""`python -m bench train-io`: what a training step spends outside its computation (loading the policy, saving the
checkpoint) and the bytes it reads and writes, with the trainer loaded from disk each step and held in memory
(checkpoints by cadence), side by side on the default model; and the bytes a step of a 4B model writes."""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.benchmarks import _random_datums
from bench.gpu import QWEN35_4B
from retool.config.trainer import TrainerConfig, saves_in_full
from retool.files.tables import DATUMS, table_from_rows, write_table_atomically
from retool.training import resident
from retool.training.memory_plan import shape_of
from retool.training.resume import StepInputs, train_from_files
from retool.weights.checkpoint import Checkpoint
from retool.weights.models import build_default_model

STEPS = 4  # steps per mode; the first loads the base model in both and is left out of the averages
MIB, GB = 2**20, 1e9
SAVE_EVERY = TrainerConfig().save_every


def _size(paths) -> int:
    return sum(
        f.stat().st_size for p in paths if p.exists() for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()
    )


def _loaded_from(checkpoint: Path) -> list[Path]:
    """What a step that loads its predecessor reads: the weights (or adapter), Adam state and random state."""
    return list(Checkpoint(checkpoint).weights_and_state)


def run_mode(folder: Path, config: TrainerConfig, held: bool) -> dict[str, float]:
    """STEPS steps as a command trains them; averages over steps 1.. of seconds and bytes, and the end's save."""
    model_dir, datums = build_default_model(), _random_datums(6)
    path = folder / "datums.parquet"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, **asdict(d), "num_tokens": d.num_tokens} for d in datums]
    write_table_atomically(table_from_rows(rows, DATUMS), path)
    totals = {"seconds": 0.0, "training": 0.0, "read": 0.0, "written": 0.0}
    for step in range(STEPS):
        previous = folder / f"step{step - 1}" if step else None
        full = not held or saves_in_full(step, SAVE_EVERY)
        served_in = "" if full else "bfloat16"
        inputs = StepInputs(model_dir, (path,), 6, 0, previous, folder / f"step{step}", config, served_in)
        started = time.perf_counter()
        metrics = train_from_files(inputs, "cpu", "cpu" if held else "")
        seconds = time.perf_counter() - started
        if step:
            totals["seconds"] += seconds / (STEPS - 1)
            totals["training"] += metrics.seconds / (STEPS - 1)
            totals["read"] += (0 if held else _size(_loaded_from(previous))) / (STEPS - 1)
            totals["written"] += _size([inputs.out]) / (STEPS - 1)
    started = time.perf_counter()
    before = _size([folder / f"step{STEPS - 1}"])
    resident.save_at_exit()  # the command's end: the held step saved in full
    totals["end seconds"] = time.perf_counter() - started
    totals["end written"] = _size([folder / f"step{STEPS - 1}"]) - before if held else 0
    return totals


def bytes_per_step_4b(lora_rank: int, save_every: int) -> float:
    """Bytes a step of Qwen3.5-4B writes on average: the engine's bfloat16 weights (or the float32 adapter) each
    step, and every `save_every` steps the float32 weights and Adam's two moments."""
    from transformers import Qwen3_5TextConfig

    shape = shape_of(Qwen3_5TextConfig(**QWEN35_4B))
    trained = shape.lora_parameters * lora_rank if lora_rank else shape.parameters
    served = trained * 4 if lora_rank else trained * 2
    full = trained * 4 + trained * 8
    return (full + served * (save_every - 1)) / save_every


def bench_train_io(workdir: Path) -> list[tuple[str, str]]:
    rows = [("CPU", f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")]
    base = TrainerConfig(micro_batch_items=4, micro_batch_tokens=2048, gradient_checkpointing=False).on("cpu")
    for name, config in (("full fine-tune", replace(base, lora_rank=0, learning_rate=1e-5)), ("LoRA 32", base)):
        for label, held in (("loaded each step", False), (f"held, save_every {SAVE_EVERY}", True)):
            f = run_mode(workdir / "train-io" / f"{config.lora_rank}-{held}", config, held)
            other = f["seconds"] - f["training"]
            rows.append(
                (
                    f"{name}, {label}",
                    f"{f['seconds']:.2f} s a step, of which training {f['training']:.2f} s, other {other:.2f} s "
                    f"({other / f['training']:.1%}); read {f['read'] / MIB:.0f} MiB, written {f['written'] / MIB:.0f}"
                    f" MiB; the command's end {f['end seconds']:.2f} s, {f['end written'] / MIB:.0f} MiB",
                )
            )
    for name, rank in (("4B full fine-tune", 0), ("4B LoRA 32", 32)):
        rows.append(
            (
                f"{name}: bytes written a step",
                f"{bytes_per_step_4b(rank, 1) / GB:.1f} GB saving in full each step; "
                f"{bytes_per_step_4b(rank, SAVE_EVERY) / GB:.2f} GB with save_every {SAVE_EVERY} (goal <= 10 GB)",
            )
        )
    return rows
