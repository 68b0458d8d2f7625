"""Benchmarks: `make bench` (python -m bench [names]) prints figures and the config behind them.
Comparisons run side by side in one process and are reported as ratios; nothing here asserts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import luigi
import pyarrow.parquet as pq

from retool.config.rollout import seed_field
from retool.config.sandbox import SandboxConfig
from retool.config.settings import RunSettings, setting_fields
from retool.protocol.chat import BUNDLED_TEMPLATE
from retool.protocol.tool_calls import tool_call_text
from retool.rollout.in_memory import rollout_in_memory
from retool.run.shared import protocol_for, sandbox_for, step_examples
from retool.sampling.contract import SampleRequest, SamplingSettings
from retool.sampling.engines import sampler_for
from retool.sampling.scripted import ScriptedSampler
from retool.sandbox.call import Sandbox
from retool.weights.models import DEFAULT_MODEL_DIR, build_default_model

REPO = Path(__file__).resolve().parent.parent
SCRIPTED = RunSettings().changed(
    run={"name": "bench", "device": "cpu"},
    model={"name": str(DEFAULT_MODEL_DIR), "chat_template": str(BUNDLED_TEMPLATE)},
    data={"train": str(REPO / "data/synthetic_eval.jsonl"), "questions_per_step": 8},
    rollout={
        "group_size": 4,
        "max_code_calls": 2,
        "max_assistant_turns": 3,
        "max_trajectory_tokens": 1536,
        "max_assistant_tokens": 128,
        "max_tool_response_tokens": 64,
        "trainer_max_tokens": 2048,
    },
    sandbox={"max_workers": 4},
)


def _tool_call(code: str, tool_format: str) -> str:
    return tool_call_text(code, tool_format, "Let me compute.")


def _policy(
    settings: RunSettings, slow_seconds: Callable[[int, int, int], float], seconds_per_token: float = 0.003
) -> ScriptedSampler:
    """Branch g of question q calls the tool (q + g) % 3 times, then answers; a call sleeps
    slow_seconds(q, g, turn). Sampling costs seconds_per_token per generated token."""
    protocol = protocol_for(settings.model)

    def script(request: SampleRequest, index: int):
        question, group, turn = request.question_index, request.group_indices[index], seed_field(request.seed, "turn")
        if turn < (question + group) % 3:
            text = _tool_call(
                f"import time\ntime.sleep({slow_seconds(question, group, turn)})\nprint({question} * 10 + {turn})",
                protocol.tool_format,
            )
        else:
            text = f"So the answer is \\boxed{{{question + group}}}."
        tokens = protocol.encode(text) + [protocol.stop_token_ids[0]]
        return tokens, [-0.5] * len(tokens)

    return ScriptedSampler(script, seconds_per_token=seconds_per_token)


def uniform_policy(settings: RunSettings) -> ScriptedSampler:
    return _policy(settings, lambda q, g, t: 0.05)


def luigi_build(
    settings: RunSettings, task: type[luigi.Task], workers: int = 1, scheduler_port: int = 0, **parameters
) -> float:
    """Runs `task` under `settings` (made after they are set: a task sets its run up when it is made), with Luigi's
    local scheduler or (`scheduler_port`) a luigid on this machine."""
    config = luigi.configuration.get_config()
    for name, section in settings.sections().items():
        if not config.has_section(name):
            config.add_section(name)
        for field in setting_fields(name, type(section)):
            config.set(name, field.name, str(getattr(section, field.name)))
    luigi.task_register.Register.clear_instance_cache()
    started = time.perf_counter()
    task = task(**parameters)
    scheduler = {"scheduler_host": "127.0.0.1", "scheduler_port": scheduler_port} if scheduler_port else {}
    if not luigi.build([task], local_scheduler=not scheduler_port, workers=workers, log_level="WARNING", **scheduler):
        raise RuntimeError(f"{task} failed")
    return time.perf_counter() - started


def default_run_settings() -> RunSettings:
    """The settings `make run` uses: luigi.cfg with configs/cpu.cfg on top."""
    from pipeline.config import SECTIONS, current_settings

    config = luigi.configuration.get_config()
    for name in SECTIONS:  # what earlier benchmarks set
        config.remove_section(name)
    config.read([str(REPO / "luigi.cfg"), str(REPO / "configs/cpu.cfg")])
    return current_settings()


def bench_pipeline_vs_memory(workdir: Path) -> list[tuple[str, str]]:
    """Alternating runs (the protocol, sandbox and data are loaded before any clock starts); the
    best of three each."""
    from pipeline.tasks import ScoreTrajectories

    settings = SCRIPTED.changed(
        run={"runs_dir": str(workdir)}, sampler={"engine": "scripted:bench.benchmarks:uniform_policy"}
    )
    protocol, sandbox = protocol_for(settings.model), sandbox_for(settings.sandbox)
    examples = step_examples(settings, 0)
    in_memory, pipeline = [], []
    for attempt in range(3):
        started = time.perf_counter()
        rollout_in_memory(examples, uniform_policy(settings), sandbox, protocol, settings.rollout, 0)
        in_memory.append(time.perf_counter() - started)
        attempt_settings = settings.changed(run={"name": f"pipeline-{attempt}"})
        pipeline.append(luigi_build(attempt_settings, ScoreTrajectories, step=0))
    best_memory, best_pipeline = min(in_memory), min(pipeline)
    return [
        (
            "config",
            f"{settings.data.questions_per_step} questions x {settings.rollout.group_size}, <= "
            f"{settings.rollout.max_assistant_turns} turns, scripted sampler 3 ms/token, real sandbox",
        ),
        ("in-memory rollout", f"{best_memory:.2f} s (runs: {', '.join(f'{t:.2f}' for t in in_memory)})"),
        ("Luigi/Parquet pipeline", f"{best_pipeline:.2f} s (runs: {', '.join(f'{t:.2f}' for t in pipeline)})"),
        ("pipeline / in-memory", f"{best_pipeline / best_memory:.3f} (goal <= 1.05)"),
    ]


def bench_round_barrier(workdir: Path) -> list[tuple[str, str]]:
    """The same step as one chain (--workers 1) and as 4 shards (--workers 4); the best of two
    alternating runs each, after the protocol and sandbox are loaded."""
    from pipeline.tasks import ScoreTrajectories

    protocol_for(SCRIPTED.model), sandbox_for(SCRIPTED.sandbox)
    rows = []
    for name in ("tail", "uniform"):
        times: dict[int, list[float]] = {1: [], 4: []}
        for attempt in range(2):
            for shards in (1, 4):
                settings = SCRIPTED.changed(
                    run={"runs_dir": str(workdir), "name": f"barrier-{name}-{shards}-{attempt}"},
                    rollout={"shards": shards},
                    sampler={"engine": f"scripted:bench.benchmarks:{name}_policy"},
                )
                times[shards].append(luigi_build(settings, ScoreTrajectories, workers=shards, step=0))
        chain, sharded = min(times[1]), min(times[4])
        rows += [
            (f"{name}: one chain", f"{chain:.2f} s"),
            (f"{name}: 4 shards, --workers 4", f"{sharded:.2f} s"),
            (
                f"{name}: speed-up",
                f"{chain / sharded:.2f}x ({'goal >= 1.5x' if name == 'tail' else 'goal: no slower, >= 1.0x'})",
            ),
        ]
    return [("config", "as pipeline; tail: one call per tool round sleeps 2 s (others 50 ms)")] + rows


def bench_stage_overhead(workdir: Path) -> list[tuple[str, str]]:
    """Step 0 of the default CPU run (configs/cpu.cfg: the embedded model, hf sampler, real
    sandbox) through Luigi in this process, timed from the build call to its return. Overhead: the
    wall time outside every task's run() (Luigi's scheduling and completeness checks) plus the
    Parquet reads and writes inside them (_timings/*.json). The tokenizer and the sandbox's zygote
    are loaded before the clock starts, once a run; loading the model is a stage's own work."""
    from pipeline.tasks import TrainStep
    from retool.evaluation.metrics import stage_timings
    from retool.files.layout import RunFolder

    settings = default_run_settings().changed(
        run={"runs_dir": str(workdir), "name": "default-step"}, cold_start={"data": ""}
    )  # one RL step alone
    protocol_for(settings.model), sandbox_for(settings.sandbox).prewarm()
    wall = luigi_build(settings, TrainStep, step=0)
    timings = stage_timings(RunFolder(settings.run_dir).step(0).timings)
    in_runs, parquet = sum(t["seconds"] for t in timings), sum(t["parquet_seconds"] for t in timings)
    scheduling = wall - in_runs
    return [
        (
            "config",
            f"configs/cpu.cfg step 0: {settings.data.questions_per_step} questions x {settings.rollout.group_size}, "
            f"sampler {settings.sampler.engine}, {len(timings)} tasks",
        ),
        ("step wall time", f"{wall:.2f} s"),
        ("inside task runs", f"{in_runs:.2f} s, of which Parquet reads and writes {parquet:.3f} s"),
        ("Luigi scheduling (outside task runs)", f"{scheduling:.3f} s"),
        ("overhead share", f"{(scheduling + parquet) / wall:.2%} (goal <= 3 %)"),
    ]


def bench_sandbox(_: Path) -> list[tuple[str, str]]:
    """Per-call latency, cold (a new interpreter per call) against pre-warmed (a child forked from a
    server that imported sympy and numpy), both with the same containment; median of 7 calls."""
    cold, warm = (
        Sandbox(SandboxConfig(max_workers=1, prewarmed=False)),
        Sandbox(SandboxConfig(max_workers=1, prewarmed=True)),
    )
    rows = [("containment (both)", cold.containment.describe()), ("pre-warmed available here", str(warm.prewarmed))]
    try:
        for label, code, goal in (
            ("trivial code", "print(1 + 1)", "goal <= 0.33"),
            ("import sympy and numpy", "import sympy, numpy\nsympy.factorint(360)", "goal >= 5x faster"),
        ):
            medians = {}
            for name, sandbox in (("cold", cold), ("pre-warmed", warm)):
                sandbox.run_code(code)  # page cache, and the server's start
                medians[name] = statistics.median(sandbox.run_code(code).seconds for _ in range(7))
            rows += [
                (f"{label}: cold", f"{medians['cold'] * 1000:.0f} ms"),
                (f"{label}: pre-warmed", f"{medians['pre-warmed'] * 1000:.0f} ms"),
                (
                    f"{label}: pre-warmed / cold",
                    f"{medians['pre-warmed'] / medians['cold']:.2f} = {medians['cold'] / medians['pre-warmed']:.1f}x "
                    f"faster ({goal})",
                ),
            ]
    finally:
        warm.close()
    return rows


def _random_datums(count: int) -> list:
    """Datums of random tokens, 150 to 300 long, the second half of each trained on with advantage +-0.5."""
    import random

    from retool.rollout.datums import Datum

    rng = random.Random(0)
    datums = []
    for index in range(count):
        length = rng.randint(150, 300)
        tokens = [rng.randint(100, 40000) for _ in range(length)]
        mask = [position > length // 2 for position in range(length - 1)]
        old_logprobs = [-1.0 if m else 0.0 for m in mask]
        advantages = [(0.5 if index % 2 else -0.5) if m else 0.0 for m in mask]
        datums.append(Datum(0, index, tokens[:-1], tokens[1:], old_logprobs, advantages, mask))
    return datums


def bench_trainer(_: Path) -> list[tuple[str, str]]:
    import torch

    from retool.config.trainer import TrainerConfig
    from retool.training.packing import pack_micro_batches
    from retool.training.step import load_policy, update_policy

    config = TrainerConfig(lora_rank=32, micro_batch_items=4, micro_batch_tokens=2048).on("cpu")
    model, optimizer = load_policy(build_default_model(), None, config)
    datums = _random_datums(6)

    def bare_tokens_per_second() -> float:
        started = time.perf_counter()
        for batch in pack_micro_batches(
            [d.num_tokens for d in datums], config.micro_batch_items, config.micro_batch_tokens
        ):
            rows = [datums[i] for i in batch.indices]
            ids = torch.tensor([d.input_tokens + [0] * (batch.width - d.num_tokens) for d in rows])
            mask = torch.tensor([[1] * d.num_tokens + [0] * (batch.width - d.num_tokens) for d in rows])
            model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return sum(d.num_tokens for d in datums) / (time.perf_counter() - started)

    ppo_runs, bare_runs = [], []
    for _ in range(3):  # alternating; the first of each warms the kernels up
        metrics = update_policy(model, optimizer, datums, config, len(datums))
        ppo_runs.append(metrics.tokens_per_second)
        bare_runs.append(bare_tokens_per_second())
    ppo, bare = max(ppo_runs), max(bare_runs)
    return [
        ("model", "SmolLM2-135M-Instruct, LoRA rank 32, float32, CPU"),
        (
            "PPO step (optimizer step included)",
            f"{ppo:.0f} tokens/s (best of {', '.join(f'{r:.0f}' for r in ppo_runs)})",
        ),
        (
            "bare forward+backward, same batches",
            f"{bare:.0f} tokens/s (best of {', '.join(f'{r:.0f}' for r in bare_runs)})",
        ),
        ("PPO / bare", f"{ppo / bare:.2f} (goal >= 0.9)"),
        ("padded / real tokens", f"{metrics.padded_tokens / metrics.tokens:.3f} (goal <= 1.15)"),
    ]


def bench_sampler(workdir: Path) -> list[tuple[str, str]]:
    """Each sampler on the default model: directly, and (hf) through the SampleRound stage."""
    from pipeline.tasks import SampleRound
    from retool.sampling.vllm_engine import vllm_available

    settings = SCRIPTED.changed(
        run={"runs_dir": str(workdir), "name": "sampler"},
        model={"name": "default"},
        sampler={"engine": "hf"},
        data={"questions_per_step": 2},
        rollout={"group_size": 8, "max_assistant_tokens": 32},
    )
    protocol = protocol_for(settings.model)
    requests = [
        SampleRequest(
            q, tuple(range(8)), tuple(protocol.build_prompt(protocol.initial_messages(e.question))), 32, seed=q
        )
        for q, e in enumerate(step_examples(settings, 0))
    ]
    rows = []
    for kind in ("hf", "vllm") if vllm_available() else ("hf",):
        loading = time.perf_counter()
        sampler = sampler_for(settings.changed(sampler={"engine": kind}))
        loaded = time.perf_counter() - loading
        started = time.perf_counter()
        replies = sampler.sample(requests, SamplingSettings(stop_token_ids=protocol.stop_token_ids))
        tokens = sum(len(s.tokens) for reply in replies for s in reply)
        rows.append(
            (
                f"{kind}: 2 prompts x 8 samples x <= 32 tokens, direct",
                f"{tokens / (time.perf_counter() - started):.1f} tokens/s (engine start {loaded:.1f} s)",
            )
        )
    stage_seconds = luigi_build(settings, SampleRound, step=0, round=0)
    samples = sum(
        len(t)
        for t in pq.read_table(workdir / "sampler/step=0000/shard=00/round=00/samples.parquet")
        .column("completion_tokens")
        .to_pylist()
    )
    rows.append(("hf through SampleRound (Prompts and scheduling included)", f"{samples / stage_seconds:.1f} tokens/s"))
    return rows
