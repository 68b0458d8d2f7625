"""The [sampler] section: which engine samples, in which dtype, and how the vLLM server is reached."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retool.config.checks import require
from retool.config.precision import bfloat16_native

ENGINES = ("auto", "vllm", "vllm-server", "hf")


@dataclass(frozen=True)
class SamplerConfig:
    SECTION: ClassVar[str] = "sampler"  # its luigi.cfg section, named by `require`
    # vllm (in-process) | vllm-server (vLLM's OpenAI-compatible server, shared by every process) | hf | auto (vllm
    # on a GPU, hf on a CPU) | scripted:MODULE:FUNCTION (FUNCTION(settings) returns the sampler)
    engine: str = "auto"
    # The engine's weights and arithmetic: auto (bfloat16 where the device computes it natively: a GPU, a CPU with
    # AVX512-BF16 or AMX, 1.6x faster there; float32 elsewhere, where its logprobs match a float32 trainer's to 1e-6)
    # | float32 | bfloat16 (the trainer's logprobs then differ by about 0.01 on average)
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.5  # vLLM on a GPU: the share of its memory the engine may take
    sleep_while_training: bool = True  # vLLM on a GPU: weights to CPU and KV cache freed while a step trains
    servers: str = ""  # vllm-server: comma-separated URLs (shard s uses server s mod count); "" = the run's own
    # vllm-server: the servers a run starts (`retool serve`, or a command that finds none), on ports server_port,
    # server_port + 1, ..., each on its own tensor_parallel_size GPUs; shard s samples on server s mod engines
    engines: int = 1
    tensor_parallel_size: int = 1  # GPUs one vLLM engine spans (a model too large for one GPU); 1 on a CPU
    start_server: bool = True  # vllm-server: start one when none answers (stopped when the command ends)
    server_port: int = 8300  # vllm-server: the port of a server started by `python -m retool serve` or a command
    request_timeout_seconds: float = 600.0  # vllm-server: a call that takes longer fails (and is retried)
    # vllm-server: the tries of a call that fails for a cause that may pass (an HTTP 5xx, a lost connection, a
    # timeout), 1, 2, 4, ... s apart; a server found dead is started again (this command's) or waited for
    request_attempts: int = 4
    server_wait_seconds: float = 300.0  # vllm-server: how long a dead server another command started is waited for

    def __post_init__(self) -> None:
        scripted = self.engine.startswith("scripted:") and self.engine.count(":") == 2
        require(self, "engine", self.engine in ENGINES or scripted, f"{', '.join(ENGINES)} or scripted:MODULE:FUNCTION")
        require(self, "dtype", self.dtype in ("auto", "float32", "bfloat16"), "auto, float32 or bfloat16")
        require(self, "request_timeout_seconds", self.request_timeout_seconds > 0, "positive")
        require(self, "request_attempts", self.request_attempts >= 1, "at least 1")
        require(self, "server_wait_seconds", self.server_wait_seconds >= 0, "0 or more")
        require(self, "gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]")
        for name in ("engines", "tensor_parallel_size"):
            require(self, name, getattr(self, name) > 0, "positive")


def engine_gpus(config: SamplerConfig, index: int) -> str:
    """The GPUs (CUDA_VISIBLE_DEVICES) of the run's `index`-th server: its own tensor_parallel_size of them."""
    size = config.tensor_parallel_size
    return ",".join(str(gpu) for gpu in range(index * size, (index + 1) * size))


def takes_weights_in_memory(config: SamplerConfig, device: str, lora_rank: int, colocated: bool) -> bool:
    """Whether a vLLM engine takes each new policy from the trainer's memory (vLLM's CUDA IPC weight transfer:
    full weights, an engine on one GPU that the trainer's process shares: `colocated`) rather than its files."""
    return device == "cuda" and not lora_rank and config.tensor_parallel_size == 1 and colocated


def engine_dtype(config: SamplerConfig, device: str) -> str:
    """The dtype `auto` stands for on a device: bfloat16 where it computes bfloat16 natively, else float32."""
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if bfloat16_native(device) else "float32"
