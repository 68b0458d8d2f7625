"""Full weights from the trainer's memory into a vLLM engine on the same GPU, through vLLM's own weight-transfer
API (0.32: `init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`) with its
CUDA IPC backend, the one for a trainer colocated with the engine. No file is read. CUDA only: the vLLM CPU engine
cannot load weights in place (see vllm_engine.VLLMSampler._load_weights) and takes them from the files."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

WEIGHT_TRANSFER = {"backend": "ipc"}  # the engine's weight_transfer_config (the server's --weight-transfer-config)
# The engine's workers (other processes) receive the IPC handles pickled, which vLLM allows only so.
WEIGHT_TRANSFER_ENVIRONMENT = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def send_weights(in_memory: Mapping[str, Any], dtype: str, engine) -> None:
    """Each tensor, cast to the engine's `dtype` as the checkpoint writes it for the engine, is copied into one
    shared buffer on this process's current GPU (chunks of at least 1 GiB); the engine loads each chunk layer by
    layer as it loads files. `engine`: vLLM's weight-sync client of the engine (in this process, or a server's)."""
    import torch
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

    source = served_weights(in_memory, getattr(torch, dtype))
    largest = max(meta.dtype.itemsize * math.prod(meta.shape) for meta in source.metadata())
    size = max(DEFAULT_PACKED_BUFFER_SIZE_BYTES, largest)
    info = IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=size)
    IPCTrainerWeightTransferEngine.trainer_init(info, client=engine, source=source).send_weights()


def served_weights(in_memory: Mapping[str, Any], dtype):
    """The trainer's tensors as vLLM's `WeightSource`: in their order, floating ones cast to `dtype` as each is
    sent (the whole model is never copied at once)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    def served(tensor):
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    class TrainerWeights(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [
                ParamMeta(name, dtype if t.is_floating_point() else t.dtype, tuple(t.shape))
                for name, t in in_memory.items()
            ]

        def __iter__(self):
            return ((name, served(tensor)) for name, tensor in in_memory.items())

    return TrainerWeights()


class InProcessEngine:
    """vLLM's weight-sync client protocol over an `LLM` in this process (vLLM ships HTTP and Ray clients)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
