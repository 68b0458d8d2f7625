"""A sampler that replays scripted completions, for tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from retool.sampling.contract import SampledSequence, SampleRequest, SamplingSettings
from retool.weights.checkpoint import Policy

Script = Callable[[SampleRequest, int], tuple[Sequence[int], Sequence[float]]]


@dataclass
class ScriptedSampler:
    """Replays completions chosen by `script(request, sample_index)` -> (tokens, logprobs), cut at
    max_tokens and at the first stop token like a real engine. For tests and benchmarks."""

    script: Script
    seconds_per_token: float = 0.0  # simulated decode latency
    requests: list[SampleRequest] = field(default_factory=list)  # every request seen, in order (if keep_requests)
    keep_requests: bool = True  # False at scale: the requests hold every prompt's tokens
    seconds: float = 0.0  # spent in sample() so far: what a benchmark leaves out of the pipeline's own time
    cpu_seconds: float = 0.0  # the process's CPU time in sample() so far, likewise
    policy: Policy | None = None  # the policy it was last switched to (it replays the same script for any)

    def use_policy(self, policy: Policy | None, in_memory: Mapping[str, Any] | None = None) -> None:
        self.policy = policy

    def sleep(self) -> None:
        pass  # holds no accelerator memory

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    def sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        started, cpu = time.perf_counter(), time.process_time()
        try:
            return self._sample(requests, settings)
        finally:
            self.seconds += time.perf_counter() - started
            self.cpu_seconds += time.process_time() - cpu

    def _sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        replies = []
        for request in requests:
            if self.keep_requests:
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
