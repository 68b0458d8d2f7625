"""What the sampler's GPU check (bench.gpu_vllm) asks an engine and how it compares what comes back: the questions,
their greedy tokens, and the trainer's logprobs of the sampled tokens against the sampler's, by position."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.gpu_harness import position_buckets
from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum
from retool.sampling.contract import SampledSequence, SampleRequest, SamplingSettings
from retool.training.packing import MicroBatch
from retool.training.step import policy_pass

QUESTIONS = (
    "What is the sum of the first 50 odd numbers? Use Python to check.",
    "How many primes are there below 1000?",
    "Find the remainder of 7**222 divided by 13.",
    "A rectangle has perimeter 46 and area 120. What is its diagonal?",
)
TEMPERATURE = 0.7  # a sampling temperature other than 1: the logprobs must be of the tempered distribution
GREEDY = SamplingSettings(temperature=0.0)


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
    for name, start, end in position_buckets():
        chosen = (positions >= start) & (positions < end if end is not None else True)
        if chosen.any():
            figures["by_position"][name] = {
                "mean": float(gaps[chosen].mean()),
                "max": float(gaps[chosen].max()),
                "tokens": int(chosen.sum()),
            }
    return figures
