"""One run's settings: a frozen section per concern, each field declared once (with its default and a
one-line comment) in the dataclass of the code that uses it. Each section is a Luigi config section
([rollout] group_size = 8, or --rollout-group-size 8), and runs/<run>/config.json nests the same way."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from retool.config.checks import SettingsError, require
from retool.config.cold_start import ColdStartConfig
from retool.config.reward import RewardConfig
from retool.config.rollout import RolloutConfig, behaviour_step, seed_capacity
from retool.config.sampler import SamplerConfig, engine_dtype
from retool.config.sandbox import SandboxConfig
from retool.config.trainer import TrainerConfig

TRACKERS = ("none", "tensorboard", "wandb", "mlflow")  # see retool.evaluation.tracking
DRAWS = ("shuffled", "frontier")  # how a step's questions are chosen ([data] draw)
DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct, built from a PyPI wheel


@dataclass(frozen=True)
class RunConfig:
    SECTION: ClassVar[str] = "run"  # its luigi.cfg section, named by `require`
    name: str = "default"  # the run's folder under runs_dir
    runs_dir: str = "runs"  # the folder of every run's folder
    device: str = "cuda"  # cuda | cpu
    train_processes: int = 1  # > 1 trains under torchrun with that many processes (one per GPU)
    keep_last: int = 3  # checkpoints that keep their weights and optimizer state
    keep_every: int = 0  # also keep those of every N-th step (0 = none)
    tracker: str = "none"  # none | tensorboard | wandb | mlflow: where step scalars and evaluations are also logged

    def __post_init__(self) -> None:
        require(self, "tracker", self.tracker in TRACKERS, f"one of {', '.join(TRACKERS)}")
        require(self, "device", self.device in ("cuda", "cpu"), "cuda or cpu")
        for name in ("train_processes", "keep_last"):
            require(self, name, getattr(self, name) > 0, "positive")


@dataclass(frozen=True)
class ModelConfig:
    SECTION: ClassVar[str] = "model"  # its luigi.cfg section, named by `require`
    name: str = "Qwen/Qwen3.5-4B"  # a local folder, a model in the local Hugging Face cache, or "default"
    chat_template: str = ""  # path to a Jinja chat template; "" uses the model's own
    tool_format: str = "auto"  # xml | hermes | auto (detected from the template)
    use_tools: bool = True  # false: no tool is declared (a text-only run)
    enable_thinking: bool = False  # passed to the template (Qwen3 family); the seed's recipe runs without thinking
    chat_template_kwargs: str = "{}"  # JSON object of further keyword arguments for every render of the template
    system_prompt: str = ""  # the system message of a run with the tool; "" = retool.protocol.chat.SYSTEM_PROMPT
    # Sampling ends a turn at </tool_call> (its closing then joins the observation) rather than at the end-of-turn
    # token the model samples after a call too (false: the seed's)
    stop_at_tool_call: bool = False

    def __post_init__(self) -> None:
        try:
            extra = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as error:
            extra = error.msg
        require(self, "chat_template_kwargs", isinstance(extra, dict), f"a JSON object ({extra})")

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.enable_thinking, **json.loads(self.chat_template_kwargs)}


@dataclass(frozen=True)
class DataConfig:
    SECTION: ClassVar[str] = "data"  # its luigi.cfg section, named by `require`
    train: str = "data/synthetic_train.jsonl"  # training questions (native, AIME or DAPO layout)
    seed: int = 0  # shuffle of the training set
    questions_per_step: int = 8  # question groups a step trains on
    # Dynamic sampling (DAPO) when set: questions rolled out per step, of which only groups whose answers differ
    # in correctness train, the first questions_per_step of them. 0 = off: questions_per_step are drawn, all kept.
    questions_drawn: int = 0
    # How a step's questions are chosen: shuffled (the next batch of a walk through the shuffled data) | frontier
    # (drawn by the pass rates earlier steps' trajectories show, favouring groups likely to disagree; see
    # retool/data/frontier.py; measured in docs/training.md). The draw and its reason are in prompts.parquet.
    draw: str = "frontier"
    frontier_steps: int = 8  # frontier: the earlier steps whose trajectories it reads (the newest finished ones)
    frontier_floor: float = 0.05  # frontier: the least draw weight, so no question is never drawn again

    def __post_init__(self) -> None:
        require(self, "questions_per_step", self.questions_per_step > 0, "positive")
        require(self, "draw", self.draw in DRAWS, f"one of {', '.join(DRAWS)}")
        require(self, "frontier_steps", self.frontier_steps > 0, "positive")
        require(self, "frontier_floor", 0 < self.frontier_floor <= 1, "in (0, 1]")
        drawn = not self.questions_drawn or self.questions_drawn >= self.questions_per_step
        at_least = f"0 (off) or at least questions_per_step = {self.questions_per_step}: dynamic sampling draws them"
        require(self, "questions_drawn", drawn, at_least)

    @property
    def questions_rolled_out(self) -> int:
        """Questions each step samples trajectories for."""
        return self.questions_drawn or self.questions_per_step

    @property
    def keep_limit(self) -> int | None:
        """With dynamic sampling, how many mixed-correctness groups a step keeps; None: every group."""
        return self.questions_per_step if self.questions_drawn else None


@dataclass(frozen=True)
class RunSettings:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)

    def __post_init__(self) -> None:
        if self.rollout.shards > self.data.questions_rolled_out:
            raise SettingsError(
                f"setting [rollout] shards = {self.rollout.shards} exceeds the {self.data.questions_rolled_out} "
                "questions a step rolls out ([data] questions_per_step, or questions_drawn): some shards would be empty"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.runs_dir) / self.run.name

    def trainer_on_device(self) -> TrainerConfig:
        """The [trainer] section for this run's device, `auto` resolved (see on_device)."""
        return self.on_device(replace(self.trainer, temperature=self.rollout.temperature))

    def sft_trainer(self) -> TrainerConfig:
        """The cold start trains through the same trainer, with the supervised objective."""
        sft = replace(
            self.trainer,
            objective="sft",
            lora_rank=self.cold_start.lora_rank,
            learning_rate=self.cold_start.learning_rate,
            loss_aggregation="token_mean",
            correction="none",
            kl_coef=0.0,  # the cold start makes the policy RL's penalty refers to
            temperature=1.0,
        )
        return self.on_device(sft)

    def on_device(self, trainer: TrainerConfig) -> TrainerConfig:
        """`trainer` with `auto` resolved for this run's device (float32 weights for a full fine-tune, bfloat16
        for a LoRA's base on CUDA; autocast where the device computes bfloat16 natively), and activations
        recomputed only on CUDA (a CPU run has memory to spare)."""
        on_cuda = self.run.device == "cuda"
        return replace(trainer.on(self.run.device), gradient_checkpointing=trainer.gradient_checkpointing and on_cuda)

    def changed(self, **sections: dict[str, Any]) -> RunSettings:
        """These settings with some fields of some sections changed: changed(rollout={"group_size": 4})."""
        return replace(self, **{name: replace(getattr(self, name), **values) for name, values in sections.items()})

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Settings that change how fast or where a run goes, never what it produces: free to differ between commands.
OPERATIONAL = {
    "run": ("name", "runs_dir", "train_processes", "keep_last", "keep_every", "tracker"),
    "sandbox": ("max_workers", "python", "contain", "prewarmed"),
    "trainer": ("data_parallel", "save_every"),  # the order of a sum's terms at most; a resume replays to the same bits
    "sampler": (
        "gpu_memory_utilization",
        "sleep_while_training",
        "servers",
        "engines",  # each request carries its seed: the same tokens from any server
        "start_server",
        "server_port",
        "request_timeout_seconds",
        "request_attempts",
        "server_wait_seconds",
    ),
}
# [sampler] engine may differ too between engines that give the same tokens for the same seeds: vLLM in this
# process and vLLM's server (a test compares them). Another engine (hf, or a scripted one) samples other tokens.
SAME_SAMPLES = {"vllm-server": "vllm"}


@dataclass(frozen=True)
class StageSettings:
    """What a stage of a step runs under, resolved once by its task (pipeline/tasks.py RunTask.stage): the stages
    below it resolve nothing again."""

    settings: RunSettings  # the run's, or an evaluation's (retool/evaluation/spec.py evaluation_settings)
    sampled_by: int  # the RL step whose checkpoint samples the step's rollout (-1: the RL base)


def training_stage(settings: RunSettings, step: int) -> StageSettings:
    """A training step's: sampled by the checkpoint [rollout] max_staleness steps before the step before it."""
    return StageSettings(settings, behaviour_step(step, settings.rollout.max_staleness))


def sampling_engine(engine: str, device: str) -> str:
    """The engine whose tokens a run's samples are: `auto` resolved, vLLM's server counted as vLLM."""
    resolved = ("vllm" if device == "cuda" else "hf") if engine == "auto" else engine
    return SAME_SAMPLES.get(resolved, resolved)


# Fields of a section's dataclass that are not settings (the code sets them).
INTERNAL = {"trainer": ("objective", "temperature")}


def setting_fields(section: str, config: type) -> list:
    return [f for f in fields(config) if f.name not in INTERNAL.get(section, ())]


def frozen(settings: RunSettings) -> dict[str, dict[str, Any]]:
    """What config.json records: the settings that shape results, `auto` resolved to what it chose on this
    machine (so two machines share a run only where their `auto` chose alike)."""
    sections = {name: asdict(config) for name, config in settings.sections().items()}
    trainer = settings.trainer_on_device()
    sections["trainer"]["dtype"] = trainer.dtype
    sections["trainer"]["autocast_bfloat16"] = trainer.autocast_bfloat16
    sections["sampler"]["dtype"] = engine_dtype(settings.sampler, settings.run.device)
    sections["sampler"]["engine"] = sampling_engine(settings.sampler.engine, settings.run.device)
    for section, names in [*OPERATIONAL.items(), *INTERNAL.items()]:
        for name in names:
            del sections[section][name]
    return sections


# The settings that choose a precision; their `auto` depends on the machine (retool.config.precision).
PRECISION = {"sampler": ("dtype",), "trainer": ("dtype", "autocast_bfloat16")}


def check_training(settings: RunSettings) -> None:
    """Rules for a training run's own settings (an evaluation's rollout may differ: n = 1 is fine there)."""
    if settings.rollout.group_size < 2:
        raise SettingsError(
            f"setting [rollout] group_size = {settings.rollout.group_size}: training needs at least 2 samples per "
            "question, since advantages are rewards minus their group's mean and a group of one never has a "
            "learning signal"
        )
    if settings.rollout.top_p < 1:
        raise SettingsError(
            f"setting [rollout] top_p = {settings.rollout.top_p}: training samples with top_p = 1, since the trainer "
            "takes each token's logprob over the whole vocabulary (at the sampling temperature) and a nucleus "
            "would make the sampler's distribution another one; an evaluation may set its own (--top-p)"
        )
    if settings.run.keep_last <= settings.rollout.max_staleness:
        raise SettingsError(
            f"setting [run] keep_last = {settings.run.keep_last} with [rollout] max_staleness = "
            f"{settings.rollout.max_staleness}: the steps sampling behind need the last max_staleness + 1 checkpoints' "
            "weights, which keep_last would delete"
        )
    limit = seed_capacity("question_index")
    if settings.data.questions_rolled_out > limit:
        name = "questions_drawn" if settings.data.questions_drawn else "questions_per_step"
        raise SettingsError(
            f"setting [data] {name} = {settings.data.questions_rolled_out} exceeds {limit}, the questions a step's "
            "seeds tell apart"
        )
