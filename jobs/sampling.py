"""The sampler contract: what the rollout asks for, what a sampler returns, and the checks and
retries that sit between them. Engines (scripted, transformers, vLLM) live in their own modules."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)
ENGINES = ("auto", "vllm", "vllm-server", "hf")


@dataclass(frozen=True)
class SamplerConfig:
    # vllm (in-process) | vllm-server (vLLM's OpenAI-compatible server, shared by every process) | hf | auto (vllm
    # on a GPU, hf on a CPU) | scripted:MODULE:FUNCTION (FUNCTION(settings) returns the sampler)
    engine: str = "auto"
    # vLLM's weights and arithmetic: auto (bfloat16 on a GPU, float32 on a CPU, where its logprobs then match the
    # float32 trainer's to 1e-6) | float32 | bfloat16 (1.6x faster on a CPU with AVX512-BF16; the trainer's logprobs
    # then differ by about 0.01 on average, as on a GPU)
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.5  # vLLM on a GPU: the share of its memory the engine may take
    sleep_while_training: bool = True  # vLLM on a GPU: weights to CPU and KV cache freed while a step trains
    servers: str = ""  # vllm-server: comma-separated URLs (shard s uses server s mod count); "" = the run's own
    start_server: bool = True  # vllm-server: start one when none answers (stopped when the command ends)
    server_port: int = 8300  # vllm-server: the port of a server started by `python -m jobs.serve` or a command
    request_timeout_seconds: float = 600.0  # vllm-server: a call that takes longer fails (and is retried)

    def __post_init__(self) -> None:
        scripted = self.engine.startswith("scripted:") and self.engine.count(":") == 2
        if self.engine not in ENGINES and not scripted:
            raise ValueError(
                f"SamplerConfig.engine must be auto, vllm, hf or scripted:MODULE:FUNCTION, got {self.engine!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"SamplerConfig.dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.request_timeout_seconds <= 0:
            raise ValueError(
                f"SamplerConfig.request_timeout_seconds must be positive, got {self.request_timeout_seconds}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"SamplerConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


def engine_dtype(config: SamplerConfig, device: str) -> str:
    """The dtype `auto` stands for on a device: bfloat16 on CUDA, float32 on a CPU."""
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class SampleRequest:
    question_index: int  # which question of the step the sequences belong to
    group_indices: tuple[int, ...]  # the branch each returned sequence is written to, in order
    prompt_tokens: tuple[int, ...]  # the exact model input P(i)
    max_tokens: int  # generation cap for this turn (already inside every budget)
    seed: int  # sampling seed, unique per (step, question, branch, turn)

    @property
    def num_samples(self) -> int:
        return len(self.group_indices)

    def describe(self) -> str:
        return f"request for question {self.question_index}, branches {list(self.group_indices)}, seed {self.seed}"


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # end-of-turn tokens (kept in the output, like vLLM)
    stop_strings: tuple[str, ...] = ()  # text that ends a turn (its tokens are kept)


@dataclass(frozen=True)
class SampledSequence:
    tokens: tuple[int, ...]  # the sampler's own token ids, never re-encoded from text
    logprobs: tuple[float, ...]  # sampler logprob of each token in `tokens`
    finish_reason: str  # "stop" (stop token or string) or "length" (hit max_tokens)


class Sampler(Protocol):
    def sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        """One list of `request.num_samples` sequences per request, in request order."""
        ...


class SamplerContractError(ValueError):
    """A sampler reply breaks the contract; retrying will not help."""


def check_reply(request: SampleRequest, sequences: Sequence[SampledSequence]) -> None:
    if len(sequences) != request.num_samples:
        raise SamplerContractError(
            f"{request.describe()}: asked for {request.num_samples} sequences, got {len(sequences)}"
        )
    for number, sequence in enumerate(sequences):
        if len(sequence.tokens) != len(sequence.logprobs):
            raise SamplerContractError(
                f"{request.describe()}: sequence {number} has {len(sequence.tokens)} tokens but "
                f"{len(sequence.logprobs)} logprobs"
            )
        if len(sequence.tokens) > request.max_tokens:
            raise SamplerContractError(
                f"{request.describe()}: sequence {number} has {len(sequence.tokens)} tokens, over "
                f"max_tokens={request.max_tokens}"
            )


def sample_checked(
    sampler: Sampler,
    requests: Sequence[SampleRequest],
    settings: SamplingSettings,
    attempts: int = 3,
    backoff_seconds: float = 1.0,
) -> list[list[SampledSequence]]:
    """Samples with retries on transient failures (exponential backoff); contract errors fail at once."""
    if not requests:
        return []
    for attempt in range(1, attempts + 1):
        try:
            replies = sampler.sample(requests, settings)
            break
        except SamplerContractError:
            raise
        except Exception as error:
            if attempt == attempts:
                raise RuntimeError(
                    f"sampler failed {attempts} times for {len(requests)} requests; last error: {error!r}"
                ) from error
            delay = backoff_seconds * 2 ** (attempt - 1)
            log.warning("sampler call failed (%r); retry %d/%d in %.1f s", error, attempt, attempts - 1, delay)
            time.sleep(delay)
    if len(replies) != len(requests):
        raise SamplerContractError(f"sampler answered {len(replies)} of {len(requests)} requests")
    for request, sequences in zip(requests, replies, strict=True):
        check_reply(request, sequences)
    return replies


Script = Callable[[SampleRequest, int], tuple[Sequence[int], Sequence[float]]]


@dataclass
class ScriptedSampler:
    """Replays completions chosen by `script(request, sample_index)` -> (tokens, logprobs), cut at
    max_tokens and at the first stop token like a real engine. For tests and benchmarks."""

    script: Script
    seconds_per_token: float = 0.0  # simulated decode latency
    requests: list[SampleRequest] = field(default_factory=list)  # every request seen, in order

    def sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        replies = []
        for request in requests:
            self.requests.append(request)
            sequences = []
            for index in range(request.num_samples):
                tokens, logprobs = (list(values) for values in self.script(request, index))
                stop_at = next(
                    (position + 1 for position, token in enumerate(tokens) if token in settings.stop_token_ids), None
                )
                finish = "stop"
                if stop_at is not None:
                    tokens, logprobs = tokens[:stop_at], logprobs[:stop_at]
                if len(tokens) > request.max_tokens:
                    tokens, logprobs, finish = tokens[: request.max_tokens], logprobs[: request.max_tokens], "length"
                sequences.append(SampledSequence(tuple(tokens), tuple(logprobs), finish))
            if self.seconds_per_token:
                time.sleep(self.seconds_per_token * max(len(sequence.tokens) for sequence in sequences))
            replies.append(sequences)
        return replies
