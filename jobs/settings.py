"""One run's settings: validated once, frozen into runs/<run>/config.json at first use, and refused
when a later command for the same run differs."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from jobs.cold_start import ColdStartConfig
from jobs.rollout import SEED_FIELDS, RolloutConfig
from jobs.sandbox import SandboxConfig
from jobs.trainer_config import TrainerConfig

# Settings that change how fast a run goes, never what it produces: free to differ between commands.
OPERATIONAL = ("sandbox_workers", "runs_dir", "run", "train_processes", "keep_last", "keep_every")
DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct, built from a PyPI wheel


class SettingsError(ValueError):
    """A setting is invalid or does not fit this machine; the message names the setting."""


@dataclass(frozen=True)
class RunSettings:
    run: str = "default"  # folder name under runs_dir
    runs_dir: str = "runs"
    model: str = "Qwen/Qwen3.5-4B"  # local folder, a model in the local Hugging Face cache, or "default"
    chat_template: str = ""  # path to a Jinja chat template; "" uses the model's own
    tool_format: str = "auto"  # xml | hermes | auto (detected from the template)
    use_tools: bool = True  # false: no tool is declared (a text-only run)
    enable_thinking: bool = False  # passed to the chat template (Qwen3 family); the seed's recipe runs without thinking
    chat_template_kwargs: str = "{}"  # JSON object of further keyword arguments for every render of the template
    device: str = "cuda"  # cuda | cpu
    sampler: str = "auto"  # vllm | hf | auto (vllm on a GPU, else the faster one here) | scripted:MODULE:FUNCTION
    train_data: str = "data/synthetic_train.jsonl"
    data_seed: int = 0  # shuffle of the training set
    questions_per_step: int = 8
    shards: int = 1  # independent round chains per step
    group_size: int = 8
    max_code_calls: int = 4
    max_assistant_turns: int = 6
    max_trajectory_tokens: int = 8192
    max_assistant_tokens: int = 1024
    max_tool_response_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 42
    trainer_max_tokens: int = 8192
    lora_rank: int = 32  # 0 = full fine-tune
    lora_alpha: int = 64
    learning_rate: float = 4e-5
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_aggregation: str = "sample_mean"  # sample_mean | token_mean
    micro_batch_items: int = 8
    micro_batch_tokens: int = 16384  # padded tokens per micro-batch
    max_sampler_gap: float = 0.0  # fail a step whose sampler logprobs are not the policy's (mean gap); 0 = no check
    tis_cap: float = 0.0  # truncated importance sampling cap; 0 = off
    filter_zero_variance_groups: bool = False
    trainer_dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on a CPU) | float32 | bfloat16
    gradient_checkpointing: bool = True  # on CUDA, recompute activations in the backward pass (a CPU run never does)
    train_processes: int = 1  # > 1 trains under torchrun with that many processes
    keep_last: int = 3  # checkpoints that keep their weights and optimizer state
    keep_every: int = 0  # also keep those of every N-th step (0 = none)
    cold_start_data: str = ""  # JSONL of tool-integrated solutions to fine-tune on before RL; "" = RL from `model`
    sft_steps: int = 8  # optimizer steps of the cold start
    sft_batch_size: int = 8  # conversations per cold-start step
    sft_learning_rate: float = 1e-4
    sft_lora_rank: int = 32  # LoRA rank of the cold start (merged into full weights at its end); 0 = full fine-tune
    sft_save_every: int = 4  # cold-start steps between resume points; 0 = none
    sandbox_timeout_seconds: float = 10.0
    sandbox_memory_mb: int = 2048
    sandbox_workers: int = 4

    def __post_init__(self) -> None:
        for name in ("questions_per_step", "shards", "sandbox_workers", "train_processes", "keep_last"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"setting {name} must be positive, got {getattr(self, name)}")
        if self.shards > self.questions_per_step:
            raise SettingsError(
                f"setting shards={self.shards} exceeds questions_per_step={self.questions_per_step}: some shards "
                "would be empty"
            )
        if self.trainer_dtype not in ("auto", "float32", "bfloat16"):
            raise SettingsError(f"setting trainer_dtype must be auto, float32 or bfloat16, got {self.trainer_dtype!r}")
        if self.device not in ("cuda", "cpu"):
            raise SettingsError(f"setting device must be cuda or cpu, got {self.device!r}")
        if self.sampler not in ("auto", "vllm", "hf") and not (
            self.sampler.startswith("scripted:") and self.sampler.count(":") == 2
        ):
            raise SettingsError(
                f"setting sampler must be auto, vllm, hf or scripted:MODULE:FUNCTION, got {self.sampler!r}"
            )
        try:
            extra = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as error:
            raise SettingsError(
                f"setting chat_template_kwargs is not valid JSON ({error.msg}): {self.chat_template_kwargs!r}"
            ) from None
        if not isinstance(extra, dict):
            raise SettingsError(
                f"setting chat_template_kwargs must be a JSON object, got {self.chat_template_kwargs!r}"
            )
        try:
            self.rollout_config()
            self.sandbox_config()
            self.trainer_config()
            self.sft_trainer_config()
            self.cold_start_config()
        except ValueError as error:
            raise SettingsError(str(error)) from None

    def rollout_config(self) -> RolloutConfig:
        names = {f.name for f in fields(RolloutConfig)}
        return RolloutConfig(**{name: value for name, value in asdict(self).items() if name in names})

    def trainer_config(self) -> TrainerConfig:
        names = {f.name for f in fields(TrainerConfig)} - {"dtype", "gradient_checkpointing"}
        return TrainerConfig(
            dtype=self.resolved_trainer_dtype,
            gradient_checkpointing=self.gradient_checkpointing and self.device == "cuda",
            **{name: value for name, value in asdict(self).items() if name in names},
        )

    @property
    def resolved_trainer_dtype(self) -> str:
        if self.trainer_dtype == "auto":
            return "bfloat16" if self.device == "cuda" else "float32"
        return self.trainer_dtype

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.enable_thinking, **json.loads(self.chat_template_kwargs)}

    def sft_trainer_config(self) -> TrainerConfig:
        """The cold start trains through the same trainer, with the supervised objective."""
        return replace(
            self.trainer_config(),
            objective="sft",
            lora_rank=self.sft_lora_rank,
            learning_rate=self.sft_learning_rate,
            loss_aggregation="token_mean",
            tis_cap=0.0,
        )

    def cold_start_config(self) -> ColdStartConfig:
        return ColdStartConfig(
            steps=self.sft_steps, batch_size=self.sft_batch_size, save_every=self.sft_save_every, seed=self.data_seed
        )

    @property
    def cold_start(self) -> bool:
        return bool(self.cold_start_data)

    def sandbox_config(self) -> SandboxConfig:
        return SandboxConfig(
            timeout_seconds=self.sandbox_timeout_seconds,
            cpu_seconds=max(1, int(self.sandbox_timeout_seconds)),
            memory_mb=self.sandbox_memory_mb,
            max_workers=self.sandbox_workers,
        )

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run

    def frozen(self) -> dict[str, Any]:
        """What config.json records: the settings that shape results, `auto` resolved to what it chose."""
        frozen = {key: value for key, value in asdict(self).items() if key not in OPERATIONAL}
        return {**frozen, "trainer_dtype": self.resolved_trainer_dtype}


def check_training(settings: RunSettings) -> None:
    """Rules for a training run's own settings (an evaluation's rollout may differ: n = 1 is fine there)."""
    if settings.group_size < 2:
        raise SettingsError(
            f"setting group_size = {settings.group_size}: training needs at least 2 samples per question, since "
            "advantages "
            "are rewards minus their group's mean and a group of one never has a learning signal"
        )
    limit = 2 ** dict(SEED_FIELDS)["question_index"]
    if settings.questions_per_step > limit:
        raise SettingsError(
            f"setting questions_per_step = {settings.questions_per_step} exceeds {limit}, the questions a step's "
            "seeds tell apart"
        )


def check_machine(settings: RunSettings) -> None:
    """Fails at once when the settings cannot run here, naming the setting to change."""
    if settings.device == "cuda":
        import torch

        if torch.cuda.is_available() and settings.train_processes > torch.cuda.device_count():
            raise SettingsError(
                f"setting train_processes = {settings.train_processes}, but this machine has "
                f"{torch.cuda.device_count()} visible GPU(s): one training process per GPU"
            )
        if not torch.cuda.is_available():
            raise SettingsError(
                "setting device = cuda, but this machine has no GPU: run the CPU configuration "
                "(LUIGI_CONFIG_PATH=configs/cpu.cfg, as `make run` does) or set device = cpu in the [retool] section"
            )
    resolve_model(settings.model)
    if settings.chat_template and not Path(settings.chat_template).is_file():
        raise SettingsError(f"setting chat_template = {settings.chat_template!r}: no such file")
    for name in ("train_data", "cold_start_data"):
        if getattr(settings, name) and not Path(getattr(settings, name)).is_file():
            raise SettingsError(f"setting {name} = {getattr(settings, name)!r}: no such file")


def resolve_model(model: str) -> Path:
    """The local folder of a model setting; never downloads (there may be no hub)."""
    if model == DEFAULT_MODEL:
        from jobs.models import build_default_model

        return build_default_model()
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        raise SettingsError(
            f"setting model = {model!r} is neither a local folder nor in the local Hugging Face cache: set model to "
            "the "
            f"folder of a downloaded model, or to {DEFAULT_MODEL!r} for the embedded SmolLM2-135M-Instruct"
        ) from None


def freeze(settings: RunSettings) -> None:
    """Writes runs/<run>/config.json on first use; afterwards refuses different settings."""
    path = settings.run_dir / "config.json"
    wanted = settings.frozen()
    if path.exists():
        # A setting added after the run was frozen counts as frozen at its default: old runs need no migration.
        defaults = {f.name: f.default for f in fields(RunSettings)}
        frozen = {**{key: defaults[key] for key in wanted}, **json.loads(path.read_text())}
        differing = sorted(key for key in set(frozen) | set(wanted) if frozen.get(key) != wanted.get(key))
        if differing:
            details = ", ".join(f"{key}={wanted.get(key)!r} (frozen: {frozen.get(key)!r})" for key in differing)
            raise SettingsError(
                f"{path}: this run was started with other settings; differing: {details}. Use the frozen values or "
                "another run name"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".config.json.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n")
    try:
        os.link(temporary, path)  # fails if another command froze the run first
    except FileExistsError:
        freeze(settings)
    finally:
        temporary.unlink()
