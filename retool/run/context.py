"""Where a stage of a run reads and writes: one RunContext per task (its settings, its folder, the checkpoint
it samples from); the per-process caches every job shares (protocol, sandbox); and `open_run`, the set-up done
once per run before any stage (and before Luigi forks worker processes, which then share the tokenizer and
the sandbox's pre-warmed servers)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from retool.config.rollout import RolloutConfig
from retool.config.sandbox import SandboxConfig
from retool.config.settings import ModelConfig, RunSettings, SettingsError, check_training
from retool.data.conversations import read_conversations
from retool.data.examples import MathExample, shuffled, take_batch
from retool.evaluation.spec import EvalSpec, _examples, evaluation_settings
from retool.evaluation.tracking import Tracker, check_tracker
from retool.files.layout import RoundPaths, RunFolder, StepFolder
from retool.protocol.chat import ChatProtocol, load_tokenizer
from retool.rollout.replay import replay_files
from retool.rollout.state import Trajectory
from retool.run.setup import (
    bfloat16_warning,
    check_machine,
    freeze,
    kernels_line,
    precision_line,
    workers_warning,
)
from retool.sampling.server import server_urls
from retool.sandbox.call import Sandbox
from retool.weights.checkpoint import Checkpoint, Policy
from retool.weights.models import resolve_model

log = logging.getLogger(__name__)


@lru_cache(maxsize=None)
def open_run(settings: RunSettings, workers: int = 1) -> None:
    """Once per process and run: fail early on settings this machine cannot run, freeze them, and
    load what every task of the run shares (`workers`: the command's worker processes)."""
    check_training(settings)
    check_machine(settings)
    for line in (precision_line(settings), kernels_line(settings)):
        if line:
            print(line, flush=True)
    for warning in (workers_warning(settings, workers), bfloat16_warning(settings)):
        if warning:
            log.warning(warning)
    check_inputs(settings)
    check_tracker(settings.run.tracker)
    freeze(settings)
    if settings.run.tracker != "none":
        Tracker(settings.run.tracker, RunFolder(settings.run_dir), settings.run.name).run_id()  # before workers fork
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
    """Where a task of a run reads and writes: its folder, and the checkpoint its rollout samples from."""

    settings: RunSettings  # the run's settings, as frozen in its config.json
    step: int  # the training step, or the checkpoint an evaluation scores (-1: the base or cold-start model)
    evaluation: EvalSpec | None = None  # None: a training step
    cold_start: bool = False  # a stage of the cold start (folder runs/<run>/sft/)
    rollout: RolloutConfig = field(init=False)  # what this task's rollout runs under (see evaluation_settings)

    def __post_init__(self) -> None:
        if (
            self.evaluation is not None
            and self.evaluation.sft
            and (self.step != -1 or not self.settings.cold_start.data)
        ):
            raise SettingsError(
                "--sft evaluates the cold-start checkpoint: it needs --step -1 and a run with [cold_start] data set"
            )
        # An evaluation asks its own questions, n times each: its data file is read here, when the task is made.
        object.__setattr__(self, "rollout", evaluation_settings(self.settings, self.evaluation).rollout)

    @property
    def run_folder(self) -> RunFolder:
        return RunFolder(self.settings.run_dir)

    @property
    def folder(self) -> StepFolder:
        if self.cold_start:
            return self.run_folder.sft
        if self.evaluation is None:
            return self.run_folder.step(self.step)
        return self.run_folder.evaluation(self.evaluation.name, self.step, self.evaluation.sft)

    @property
    def policy_checkpoint(self) -> Checkpoint | None:
        """The checkpoint this task's rollout samples from (None: the model setting). Training step s samples
        from checkpoint s-1, step 0 from the cold start's (if the run has one); an evaluation of step s from
        checkpoint s, of step -1 from the model setting or (sft) the cold start's."""
        source = self.step if self.evaluation is not None else self.step - 1
        if source >= 0:
            return Checkpoint(self.run_folder.step(source).checkpoint)
        wants_sft = self.evaluation.sft if self.evaluation is not None else bool(self.settings.cold_start.data)
        return Checkpoint(self.run_folder.sft.checkpoint) if wants_sft else None


@lru_cache(maxsize=256)
def context_for(
    run: RunSettings, step: int, evaluation: EvalSpec | None = None, cold_start: bool = False
) -> RunContext:
    """A task's context; tasks ask for it often, so each is built once."""
    return RunContext(run, step, evaluation, cold_start)


def replayed_shard(
    prompts: Path, rounds: Sequence[RoundPaths], run: RunSettings, evaluation: EvalSpec | None, shard: int
) -> tuple[RunSettings, ChatProtocol, list[Trajectory]]:
    """What a round of one shard starts from: the settings it runs under (the run's, or its evaluation's), their
    protocol, and the shard's trajectories after `rounds`, rebuilt from those files (a round's state is never
    stored: a re-run starts from what the files say)."""
    settings = evaluation_settings(run, evaluation)
    protocol = protocol_for(settings.model)
    return settings, protocol, replay_files(prompts, rounds, protocol, settings.rollout, shard)


def policy_of(settings: RunSettings, checkpoint: Path | None) -> Policy | None:
    """The policy of a checkpoint folder of the run (None: the model setting)."""
    return Checkpoint(checkpoint).policy(rl_base_model(settings)) if checkpoint is not None else None


def rl_base_model(settings: RunSettings) -> Path:
    """The weights RL starts from, which LoRA adapters of its checkpoints apply to: the cold-start
    checkpoint's full weights, or the model setting."""
    if settings.cold_start.data:
        return Checkpoint(RunFolder(settings.run_dir).sft.checkpoint).model
    return resolve_model(settings.model.name)


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


def step_examples(settings: RunSettings, step: int, evaluation: EvalSpec | None) -> list[MathExample]:
    if evaluation is not None:
        return evaluation.examples()
    data = settings.data
    return take_batch(shuffled(_examples(data.train), data.seed), step, data.questions_rolled_out)
