"""What every job of a process shares: the chat protocol (a tokenizer takes most of a second to load), the
sandbox (its pre-warmed servers), a step's questions, and a round's starting state rebuilt from its files."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

from retool.config.sandbox import SandboxConfig
from retool.config.settings import ModelConfig, RunSettings, StageSettings
from retool.data.examples import MathExample, cached_examples, shuffled, take_batch
from retool.data.frontier import Draw, frontier_draw
from retool.files.layout import RoundPaths, RunFolder
from retool.protocol.chat import ChatProtocol, load_tokenizer
from retool.rollout.replay import replay_files
from retool.rollout.state import Trajectory
from retool.sandbox.call import Sandbox
from retool.weights.models import resolve_model, rl_base


@lru_cache(maxsize=4)
def protocol_for(model: ModelConfig) -> ChatProtocol:
    """One per tokenizer and template, shared by runs and by every task of a process (loading one takes a
    tenth of a second: a step of 64 shards runs hundreds of tasks)."""
    return ChatProtocol(
        load_tokenizer(resolve_model(model.name)),
        tool_format=model.tool_format,
        chat_template=model.chat_template or None,
        tools=model.use_tools,
        template_kwargs=model.template_kwargs(),
        system_prompt=(model.system_prompt or None) if model.use_tools else None,  # text-only: its own
        stop_at_tool_call=model.stop_at_tool_call,
    )


def token_decoder(model: ModelConfig) -> Callable[[int], str]:
    """One token id as its text (the model's tokenizer, each id decoded once)."""
    tokenizer = protocol_for(model).tokenizer
    return lru_cache(maxsize=None)(lambda token: tokenizer.decode([token]))


@lru_cache(maxsize=4)
def sandbox_for(config: SandboxConfig) -> Sandbox:
    """One per sandbox configuration, so its pre-warmed servers serve every task of the process."""
    return Sandbox(config)


def step_examples(settings: RunSettings, step: int) -> list[MathExample]:
    """The questions training step `step` rolls out by the shuffled walk: its batch of the shuffled training data."""
    data = settings.data
    return take_batch(shuffled(cached_examples(data.train), data.seed), step, data.questions_rolled_out)


def history_steps(stage: StageSettings) -> range:
    """The earlier steps whose trajectories a frontier draw of a training step under `stage` reads: the newest [data]
    frontier_steps of those finished before its sampling may start (up to the one whose checkpoint samples it); none
    otherwise."""
    data, newest = stage.settings.data, stage.sampled_by
    if data.draw != "frontier":
        return range(0)
    return range(max(newest + 1 - data.frontier_steps, 0), newest + 1)


def step_draws(
    settings: RunSettings, step: int, questions: Sequence[MathExample] | None = None, history: Sequence[dict] = ()
) -> list[Draw]:
    """The questions a step rolls out and why: an evaluation's data set (`questions`) in order; else by [data] draw,
    the frontier draw once there are earlier steps' outcomes (`history`: rows of their trajectories), else the
    shuffled walk."""
    if questions is not None:
        return [Draw(example, None, None, "the evaluation's data set") for example in questions]
    data = settings.data
    if data.draw == "frontier" and history:
        pool = shuffled(cached_examples(data.train), data.seed)
        count, group = data.questions_rolled_out, settings.rollout.group_size
        return frontier_draw(pool, history, count, group, data.frontier_floor, (data.seed, step))
    return [Draw(example, None, None, "the shuffled walk") for example in step_examples(settings, step)]


def replayed_shard(
    prompts: Path, rounds: Sequence[RoundPaths], settings: RunSettings, shard: int
) -> tuple[ChatProtocol, list[Trajectory]]:
    """What a round of one shard starts from: the protocol of the settings it runs under, and the shard's
    trajectories after `rounds`, rebuilt from those files (a round's state is never stored: a re-run starts from
    what the files say)."""
    protocol = protocol_for(settings.model)
    return protocol, replay_files(prompts, rounds, protocol, settings.rollout, shard, detail="state")


def run_rl_base(settings: RunSettings) -> Path:
    """The weights a run's RL starts from (for tools that read a run folder rather than a task's inputs)."""
    cold_start = RunFolder(settings.run_dir).sft.checkpoint if settings.cold_start.data else None
    return rl_base(cold_start, settings.model.name)
