"""The sampler contract: what the rollout asks for, what a sampler returns, and the checks and
retries that sit between them. Engines (scripted, transformers, vLLM) live in their own modules."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from retool.weights.checkpoint import Policy

log = logging.getLogger(__name__)


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
    """What every engine does: sample, switch to a policy, give its memory back while a step trains, close."""

    def sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        """One list of `request.num_samples` sequences per request, in request order."""
        ...

    def use_policy(self, policy: Policy | None, in_memory: Mapping[str, Any] | None = None) -> None:
        """Samples from `policy` from now on; None: the model the engine was started with. `in_memory`: the
        policy's full weights by parameter name, as the trainer in this process holds them, which an engine that
        can load weights in place takes instead of reading the policy's files."""
        ...

    def sleep(self) -> None:
        """Gives the accelerator memory it holds back to a training step in this process or on its GPU."""
        ...

    def wake(self) -> None:
        """Takes the memory back; sampling wakes a sleeping engine too."""
        ...

    def close(self) -> None:
        """Frees everything it holds, now rather than when the process ends."""
        ...


class SamplerContractError(ValueError):
    """A sampler reply breaks the contract; retrying will not help."""


class SamplerFailure(RuntimeError):
    """A sampler failed for good: its own retries are spent, or the cause is not one that passes (an HTTP 4xx, a
    server gone); the message says which, and it is not retried again."""


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
        except (SamplerContractError, SamplerFailure):
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
