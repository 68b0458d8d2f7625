"""Sampling through vLLM's own OpenAI-compatible server: token-id prompts in, the sampled token ids and
each one's logprob out (nothing is re-tokenised). One long-lived server samples for every shard,
worker and command; it loads each step's adapter at run time and sleeps while a step trains on its GPU.

Endpoints used: /health, /v1/completions, /v1/load_lora_adapter and /v1/unload_lora_adapter
(VLLM_ALLOW_RUNTIME_LORA_UPDATING),
and the development ones (VLLM_SERVER_DEV_MODE) /reset_prefix_cache, /collective_rpc, /sleep, /wake_up, and
vLLM's weight-transfer routes (see retool.sampling.weight_transfer).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from retool.recoveries import note_recovery
from retool.sampling.adapters import ADAPTER_WEIGHTS, adapter_for_engine
from retool.sampling.contract import SampledSequence, SampleRequest, SamplerFailure, SamplingSettings
from retool.sampling.progress import sampling_progress, set_tokens
from retool.sampling.weight_transfer import send_weights
from retool.weights.checkpoint import Policy

HEALTH_TIMEOUT_SECONDS = 5.0
log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The vLLM server refused or failed a call; the message names the server and the call. `cause`: a retool.recoveries
    cause when the failure may pass (an HTTP 5xx, a lost connection, a timeout), None when it will not (a 4xx)."""

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause


def is_healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=HEALTH_TIMEOUT_SECONDS).status_code == 200
    except requests.RequestException:
        return False


def served_model(url: str) -> str:
    """The base model a server serves (its name in /v1/models: the folder it was started with)."""
    models = _call("GET", url, "/v1/models", timeout=HEALTH_TIMEOUT_SECONDS)["data"]
    return next(m["id"] for m in models if m.get("parent") is None)


def _call(method: str, url: str, path: str, timeout: float, **kwargs) -> dict:
    try:
        response = requests.request(method, f"{url}{path}", timeout=timeout, **kwargs)
    except requests.RequestException as error:
        cause = "sampler_timeout" if isinstance(error, requests.Timeout) else "sampler_connection"
        message = f"vLLM server {url}: {method} {path} failed ({error.__class__.__name__}: {error})"
        raise ServerError(message, cause) from None
    if response.status_code != 200:
        message = f"vLLM server {url}: {method} {path} answered {response.status_code}: {response.text[:300]}"
        raise ServerError(message, "sampler_server_error" if response.status_code >= 500 else None)
    return response.json() if response.content and "json" in response.headers.get("content-type", "") else {}


class ServerSampler:
    """A Sampler over one vLLM server (see retool.sampling.contract.Sampler)."""

    def __init__(
        self,
        url: str,
        device: str,
        request_timeout_seconds: float = 600.0,
        workers: int = 64,
        memory: tuple[int, str] | None = None,
        attempts: int = 4,
        revive: Callable[[str], None] | None = None,
        backoff_seconds: float = 1.0,
        full_weights: bool = False,
    ):
        """`memory`: the server's GPU (its position among this process's) and dtype, when it takes full weights
        from this process's memory (see retool.sampling.weight_transfer); `attempts`: the tries of a call whose
        failure may pass, `backoff_seconds` apart and doubling; `revive(url)`: returns once a server that stopped
        answering answers again (retool.sampling.server.revive_server), or raises; `full_weights`: the run's
        policies are full weights (not adapters over the server's own)."""
        self.url, self.device, self.memory = url.rstrip("/"), device, memory
        self.request_timeout_seconds = request_timeout_seconds  # a hung server fails the call, then its retries
        self.attempts, self.backoff_seconds, self.revive = attempts, backoff_seconds, revive
        self._revived = 0  # how often the server was found dead and answered again: a call compares it
        self._revive_lock = threading.Lock()  # the calls run in threads: one of them revives the server
        self.base_model = served_model(self.url)  # what every request samples unless an adapter is loaded
        self.model = self.base_model  # the name requests are sampled under now
        self.policy: Policy | None = None  # the policy sampled from; None = the server's own model
        self.weights = Path(self.base_model)  # the full weights the server holds now
        # Adapters renamed for the engine; removed by close(), or when the process exits without closing it.
        self._adapters_folder = tempfile.TemporaryDirectory(prefix="retool-adapters-")
        self._adapters = Path(self._adapters_folder.name)
        self._adapter_path: Path | None = None  # this process's copy of the adapter it samples with, if any
        self._workers = workers  # HTTP calls at once, one per request: the server batches them
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0  # the process the pool's threads run in (a forked worker needs its own)
        # vLLM's sleep level while a step trains: 1 keeps the base weights adapters are served over (to host
        # memory); 2 drops full weights, which the next policy overwrites anyway (no copy out and back).
        self.sleep_level = 2 if full_weights else 1

    def use_policy(self, policy: Policy | None, in_memory: Mapping[str, Any] | None = None) -> None:
        """A LoRA policy is loaded under a new name (the server caches adapters by name); full weights are
        reloaded in place (from `in_memory` where the server takes them so), which the vLLM CPU engine cannot
        do correctly (it keeps the weights its kernels packed at start), so there a server serves only its own
        weights and adapters over them."""
        if policy == self.policy:
            return
        if self.revive is not None and not is_healthy(self.url):  # it died between this process's calls
            self._revive_server(self._revived, policy)
            return
        weights, in_memory = policy.weights if policy is not None else Path(self.base_model), in_memory
        self.wake(weights, in_memory if self.memory else None)
        self._load_weights(weights, in_memory if self.memory else None)
        previous, self.model = self.model, self.base_model
        if policy is not None and policy.adapter is not None:
            # Named by content: every process and command that serves this checkpoint loads the same name,
            # and an adapter trained again at the same path gets a new one (the server caches by name).
            name = "policy-" + hashlib.sha256((policy.adapter / ADAPTER_WEIGHTS).read_bytes()).hexdigest()[:16]
            self._adapter_path = adapter_for_engine(policy.adapter, Path(self.base_model), self._adapters / name)
            self._load_adapter(name)
            self.model = name
        if previous not in (self.base_model, self.model):  # no longer served by this process: off the server's list
            self._unload_adapter(previous)
        _call("POST", self.url, "/reset_prefix_cache", self.request_timeout_seconds)
        self.policy = policy

    def _load_adapter(self, name: str) -> None:
        """Loads (or loads again) the adapter `name` from this process's copy. Another process (a worker, a
        retry, another command or node) may have loaded the same name, with the same content, from its own
        copy: `load_inplace` makes that a reload from this one, which outlives the other's, rather than vLLM's
        "already loaded" refusal."""
        payload = {"lora_name": name, "lora_path": str(self._adapter_path), "load_inplace": True}
        _call("POST", self.url, "/v1/load_lora_adapter", self.request_timeout_seconds, json=payload)

    def _unload_adapter(self, name: str) -> None:
        """Frees the server's entry for an adapter this process no longer samples with. Another process still
        sampling with it loads it again (see _sample_one); one that unloaded it first leaves nothing to do."""
        try:
            _call("POST", self.url, "/v1/unload_lora_adapter", self.request_timeout_seconds, json={"lora_name": name})
        except ServerError as error:
            if " answered 404" not in str(error):
                raise

    def _load_weights(self, weights: Path, in_memory: Mapping[str, Any] | None = None, dropped: bool = False) -> None:
        """`dropped`: the server's weight buffers hold nothing (woken from a level-2 sleep): loaded whatever it held."""
        if weights.resolve() == self.weights.resolve() and not dropped:
            return
        if self.device == "cpu":
            raise ServerError(
                f"vLLM server {self.url} on a CPU cannot switch to the full weights {weights}: the CPU engine "
                "keeps the weights its kernels packed at start. Serve LoRA policies over its own model, or sample "
                "in-process ([sampler] engine = vllm), which loads each new policy in a fresh engine"
            )
        if in_memory is not None:
            import torch
            from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

            gpu, dtype = self.memory
            with torch.cuda.device(gpu):  # the IPC buffer on the server's GPU
                send_weights(in_memory, dtype, HTTPVLLMWeightSyncClient(self.url, self.request_timeout_seconds))
        else:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
            _call("POST", self.url, "/collective_rpc", self.request_timeout_seconds, json=rpc)
        self.weights = weights

    def sleep(self) -> None:
        """Frees the GPU for a training step (KV cache dropped; weights to CPU memory or dropped, by sleep_level);
        nothing on a CPU."""
        if self.device == "cuda":
            _call("POST", self.url, f"/sleep?level={self.sleep_level}", self.request_timeout_seconds)

    def wake(self, weights: Path | None = None, in_memory: Mapping[str, Any] | None = None) -> None:
        """Takes the GPU back. After a level-2 sleep (by this process or another: the server says), `weights` (by
        default those this process serves) are loaded into the woken weight buffers before the KV cache takes its
        memory, as vLLM's sleep-mode recipe for new weights; waking a server that is awake changes nothing."""
        if self.device != "cuda":
            return
        asleep = self.sleep_level == 2 and _call("GET", self.url, "/is_sleeping", self.request_timeout_seconds)
        if not (asleep and asleep.get("is_sleeping")):
            _call("POST", self.url, "/wake_up", self.request_timeout_seconds)
            return
        _call("POST", self.url, "/wake_up?tags=weights", self.request_timeout_seconds)
        self._load_weights(weights or self.weights, in_memory, dropped=True)
        _call("POST", self.url, "/wake_up?tags=kv_cache", self.request_timeout_seconds)

    def close(self) -> None:
        """Closes the client; the server itself goes on serving (whoever started it stops it)."""
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool, self._pool_pid = None, 0
        self._adapters_folder.cleanup()

    def sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        if not requests:
            return []
        self.wake()
        if self._pool_pid != os.getpid():  # made here, not inherited: a forked process has none of its threads
            self._pool, self._pool_pid = ThreadPoolExecutor(max_workers=self._workers), os.getpid()
        replies, sampled_tokens = [], 0
        with sampling_progress(sum(request.num_samples for request in requests)) as progress:
            # Counted in the requests' order, as map hands the replies back.
            for sequences in self._pool.map(lambda request: self._sample_one(request, settings), requests):
                replies.append(sequences)
                sampled_tokens += sum(len(sequence.tokens) for sequence in sequences)
                set_tokens(progress, sampled_tokens)
                progress.update(len(sequences))
        return replies

    def _sample_one(self, request: SampleRequest, settings: SamplingSettings) -> list[SampledSequence]:
        body = {
            "model": self.model,
            "prompt": list(request.prompt_tokens),
            "n": request.num_samples,
            "seed": request.seed,
            "max_tokens": request.max_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "stop": list(settings.stop_strings),
            "stop_token_ids": list(settings.stop_token_ids),
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        reply = self._completion(body)
        sequences = []
        for choice in sorted(reply["choices"], key=lambda c: c["index"]):
            tokens = tuple(choice["token_ids"])
            logprobs = tuple((choice.get("logprobs") or {}).get("token_logprobs") or ())
            finish = "length" if choice["finish_reason"] == "length" else "stop"
            sequences.append(SampledSequence(tokens, logprobs, finish))
        return sequences

    def _completion(self, body: dict) -> dict:
        """One completion call, tried again where its failure may pass; a server found dead is revived and this
        process's policy loaded on it again. The seed in `body` makes a retried call sample the same tokens."""
        for attempt in range(1, self.attempts + 1):
            revived = self._revived
            body["model"] = self.model  # the adapter's name, loaded again on a revived server
            try:
                return _call("POST", self.url, "/v1/completions", self.request_timeout_seconds, json=body)
            except ServerError as error:
                if error.cause is None and " answered 404" in str(error) and self.model != self.base_model:
                    self._load_adapter(self.model)  # another process unloaded it after its own step: load it again
                    continue
                if error.cause is None or attempt == self.attempts:
                    tries = f" (after {attempt} tries)" if attempt > 1 else ""
                    raise SamplerFailure(f"{error}{tries}") from None
                note_recovery(error.cause)
                if error.cause == "sampler_connection" and self.revive is not None and not is_healthy(self.url):
                    self._revive_server(revived, self.policy)
                else:
                    delay = self.backoff_seconds * 2 ** (attempt - 1)
                    log.warning("%s; retry %d/%d in %.0f s", error, attempt, self.attempts - 1, delay)
                    time.sleep(delay)
        raise AssertionError("unreachable")

    def _revive_server(self, seen: int, policy: Policy | None) -> None:
        """Once per death, whichever call saw it first: waits for the server (see `revive`), then loads `policy` on
        it again: a new server holds only its own model."""
        with self._revive_lock:
            if self._revived != seen:  # another call revived it meanwhile
                return
            self.revive(self.url)
            note_recovery("sampler_server_restart")
            self.policy, self.model, self.weights = None, self.base_model, Path(self.base_model)
            self.use_policy(policy)
            self._revived += 1
