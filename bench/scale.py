"""`python -m bench scale`: the pipeline's own cost as a step grows, from 64 to 8192 trajectories.

The real Luigi tasks, files, rollout, scoring, datum and packing code run one RL step whose sampler and tool calls
cost nothing (bench/retool_shape.py: a script that returns trajectories shaped like ReTool's, and a stand-in that
returns what the real sandbox would print for the scripted code). The trainer only plans the step: it reads the
datums as the trainer does and packs them into micro-batches. Every stage's process is measured from inside
(Luigi's events, in each worker process): seconds and CPU seconds (the scripted sampler's apart), peak resident
memory (VmHWM, reset at the stage's start), bytes read and written (/proc/self/io), files written; and the command's
scheduling (tasks, seconds outside stages)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import luigi

import bench.retool_shape
from bench import stage_meter
from bench.benchmarks import REPO, luigi_build
from bench.retool_shape import Shape, script_material
from retool.config.settings import RunSettings
from retool.protocol.chat import BUNDLED_TEMPLATE
from retool.run.shared import protocol_for
from retool.weights.models import DEFAULT_MODEL_DIR

# The GPU recipe's budgets (luigi.cfg's [rollout] with up to 6 tool turns), sized for bench/retool_shape.py's Shape.
ROLLOUT = {
    "max_code_calls": 5,
    "max_assistant_turns": 6,
    "max_trajectory_tokens": 16384,
    "max_assistant_tokens": 2048,
    "max_tool_response_tokens": 512,
    "trainer_max_tokens": 16384,
}
GROUP = 16  # samples per question, as the recipes draw them
SIZES = ((64, 1), (256, 4), (1024, 16), (4096, 64), (8192, 64))  # (trajectories, shards) of each measured step
# The GPU step's trajectories (about 7k tokens each: turns 5 x as long, up to 4096 tokens) at a quarter of its 8192,
# in configs/node8.cfg's 8 shards, in 32 and in 64 (more shards: more workers at once, more tasks to schedule)
LONG, LONG_TURNS, LONG_TURN_TOKENS, LONG_SHARDS = 2048, 5, 4096, (8, 32, 64)
SHAPE_TURNS = Shape().turn_tokens  # the median turn of the sizes' steps
# A stage's figures summed over its tasks (its peak memory is their largest)
SUMMED = ("seconds", "cpu_seconds", "sampler_seconds", "read_bytes", "written_bytes", "output_bytes", "files")


def settings_for(
    workdir: Path, name: str, trajectories: int, shards: int, turn_tokens: int = ROLLOUT["max_assistant_tokens"]
) -> RunSettings:
    return RunSettings().changed(
        run={"name": name, "runs_dir": str(workdir), "device": "cpu", "tracker": "none"},
        model={"name": str(DEFAULT_MODEL_DIR), "chat_template": str(BUNDLED_TEMPLATE)},
        data={"train": str(REPO / "data/synthetic_train.jsonl"), "questions_per_step": trajectories // GROUP},
        rollout={**ROLLOUT, "group_size": GROUP, "shards": shards, "max_assistant_tokens": turn_tokens},
        sampler={"engine": "scripted:bench.retool_shape:retool_shaped_policy"},
        trainer={"micro_batch_tokens": 16384, "micro_batch_items": 8},
    )


class StepDatums(luigi.WrapperTask):
    """What TrainStep requires, without its update: one root task, as TrainStep is in a command (Luigi walks the
    graph of each root it is given apart: the shards' datums as roots would walk the step once per shard)."""

    step = luigi.IntParameter(description="the training step")

    def requires(self):
        from pipeline.tasks import TrainStep

        return TrainStep(step=self.step).shard_datums(self.step)


def measure_step(
    workdir: Path, trajectories: int, shards: int, workers: int = 1, luigid: bool = False, shape: Shape = Shape()
) -> dict:
    """One step of `trajectories` in `shards` through Luigi (`workers` processes; with `luigid`, a central
    scheduler on this machine): each stage's figures, summed over its tasks, and the step's tokens, files and
    scheduling."""
    from retool.files.layout import RunFolder
    from retool.files.tables import TRAJECTORIES, read_table
    from retool.sampling import engines

    name = f"scale-{trajectories}-{shards}-{workers}{'-luigid' if luigid else ''}-{shape.turn_tokens}"
    bench.retool_shape.SHAPE = shape
    long = shape.turn_tokens != SHAPE_TURNS
    settings = settings_for(workdir, name, trajectories, shards, *([LONG_TURN_TOKENS] if long else []))
    engines._engines.clear()  # the script answers this step's questions
    script_material(settings)
    stage_meter.LOG = workdir / f"{name}.jsonl"
    stage_meter.LOG.unlink(missing_ok=True)
    started = time.time()
    if luigid:
        from bench.cluster import free_port
        from bench.cluster import luigid as central_scheduler

        config = workdir / f"{name}.cfg"
        config.write_text("")
        with central_scheduler(config, free_port(), workdir / f"{name}.state") as port:
            wall = luigi_build(settings, StepDatums, workers=workers, scheduler_port=port, step=0)
    else:
        wall = luigi_build(settings, StepDatums, workers=workers, step=0)
    records = [json.loads(line) for line in stage_meter.LOG.read_text().splitlines()]
    stage_meter.LOG = None
    planned, joined = stage_meter.plan_training(settings), stage_meter.join_datums(settings)
    stages: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for record in [*records, planned, joined]:
        stage = stages[record["stage"]]
        stage["tasks"] += 1
        for key in SUMMED:
            stage[key] += record.get(key, 0.0)
        stage["peak_bytes"] = max(stage["peak_bytes"], record["peak_bytes"])
    scored = read_table(RunFolder(settings.run_dir).step(0).trajectories, TRAJECTORIES)
    step_folder = RunFolder(settings.run_dir).step(0).path
    return {
        "trajectories": trajectories,
        "shards": shards,
        "workers": workers,
        "scheduler": "luigid" if luigid else "local",
        "turn_tokens": shape.turn_tokens,
        "tokens": sum(scored.column("trajectory_tokens").to_pylist()),
        "sampled_tokens": sum(scored.column("sampled_tokens").to_pylist()),
        "stop_reasons": dict(sorted(_count(scored.column("stop_reason").to_pylist()).items())),
        "wall": wall,
        "first_stage_after": min(r["started"] for r in records) - started,
        "in_stages": sum(r["seconds"] + r["sampler_seconds"] for r in records) / workers,
        "tasks": len(records),
        "files": sum(1 for path in step_folder.rglob("*") if path.is_file()),
        "stages": {name: dict(figures) for name, figures in stages.items()},
    }


def _count(values) -> dict:
    counts: dict = defaultdict(int)
    for value in values:
        counts[value] += 1
    return counts


def exponent(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of log(y) on log(x): y grows as x to this power."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(max(y, 1e-6)) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


STAGE_ORDER = (
    "Prompts", "SampleRound", "ExecuteRound", "ScoreShard", "ScoreTrajectories", "ShardDatums", "TrainStep (plan only)",
    stage_meter.BESIDE_THE_UPDATE,
)  # fmt: skip


def bench_scale(workdir: Path, sizes=SIZES, workers: tuple[int, ...] = (1, 2), luigid: bool = True, long: bool = True):
    """Each size with --workers 1; then (`long`) the GPU step's trajectories at a quarter of their count in each of
    LONG_SHARDS with each count of `workers`, and (`luigid`) in 64 with two under a central scheduler. A table row
    per step and stage, each stage's growth exponent, a plot, and the modelled GPU node's share."""
    import torch

    protocol_for(settings_for(workdir, "warm", 64, 1).model)  # the tokenizer, loaded before any clock starts
    with stage_meter.measuring():
        steps = [measure_step(workdir, trajectories, shards) for trajectories, shards in sizes]
        if long:
            longer = Shape(turn_tokens=SHAPE_TURNS * LONG_TURNS)
            for shards in LONG_SHARDS:
                steps += [measure_step(workdir, LONG, shards, workers=count, shape=longer) for count in workers]
            if luigid:
                steps.append(measure_step(workdir, LONG, LONG_SHARDS[-1], workers=2, luigid=True, shape=longer))
    rows = [
        ("machine", f"{os.cpu_count()} cores, torch cpu capability {torch.backends.cpu.get_cpu_capability()}"),
        ("shape", f"{Shape()} (long: turn_tokens x {LONG_TURNS}); rollout {ROLLOUT}, group {GROUP}"),
    ]
    for step in steps:
        rows += step_rows(step)
    single = [s for s in steps if s["workers"] == 1 and s["scheduler"] == "local" and s["turn_tokens"] == SHAPE_TURNS]
    for name in STAGE_ORDER:
        points = [(s["tokens"], s["stages"][name]["seconds"]) for s in single if name in s["stages"]]
        memory = [(s["tokens"], s["stages"][name]["peak_bytes"]) for s in single if name in s["stages"]]
        if len(points) > 1:
            rows.append((f"exponent {name}", f"seconds ~ tokens^{exponent(points):.2f}, peak ~ {exponent(memory):.2f}"))
    if long and len(single) > 1 and 2 in workers:
        for shards in LONG_SHARDS:
            rows += gpu_node_share(workdir, steps, single, shards)
    (workdir / "scale.json").write_text(json.dumps(steps, indent=1))
    if len(single) > 1:
        draw(single, workdir / "scale.png")
    rows.append(("figures", f"{workdir / 'scale.json'}, plot {workdir / 'scale.png'}"))
    return rows


def step_rows(step: dict) -> list[tuple[str, str]]:
    """A step's line and a line per stage."""
    long = f", turns x {step['turn_tokens'] // SHAPE_TURNS}" if step["turn_tokens"] != SHAPE_TURNS else ""
    outside = step["wall"] - step["in_stages"] - step["first_stage_after"]
    label = (
        f"{step['trajectories']} x{long}, {step['shards']} shards, --workers {step['workers']} ({step['scheduler']})"
    )
    rows = [
        (
            label,
            f"{step['tokens'] / 1e6:.2f} M tokens, {step['tasks']} tasks, {step['files']} files, wall "
            f"{step['wall']:.1f} s, first stage after {step['first_stage_after']:.1f} s, outside stages "
            f"{outside:.1f} s; stops {step['stop_reasons']}",
        )
    ]
    for name in STAGE_ORDER:
        figures = step["stages"].get(name)
        if figures:
            rows.append(
                (
                    f"  {name}",
                    f"{figures['seconds']:.2f} s (CPU {figures['cpu_seconds']:.2f} s), peak "
                    f"{figures['peak_bytes'] / 2**30:.2f} GiB, read "
                    f"{figures['read_bytes'] / 2**20:.1f} MiB, written {figures['written_bytes'] / 2**20:.1f} MiB "
                    f"(files {figures['output_bytes'] / 2**20:.1f} MiB in {int(figures['files'])}), "
                    f"{int(figures['tasks'])} tasks"
                    + (
                        f"; the scripted sampler {figures['sampler_seconds']:.2f} s more"
                        if name == "SampleRound"
                        else ""
                    ),
                )
            )
    return rows


def draw(steps: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name in STAGE_ORDER:
        points = [(s["tokens"], s["stages"][name]["seconds"]) for s in steps if name in s["stages"]]
        if points:
            axis.loglog(*zip(*points), marker="o", label=f"{name} (x^{exponent(points):.2f})")
    axis.set_xlabel("tokens in the step")
    axis.set_ylabel("seconds (sum over the stage's tasks)")
    axis.set_title("The pipeline's own cost per stage as a step grows")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- the share of a GPU node's step ------------------------------------------------------------------------------
# Assumptions, not measurements of this machine: an 8 x H100 node training a 4B model on the recipes' step.
GPU_STEP_TRAJECTORIES = 8192  # 512 questions x 16 samples, of the long shape (about 8k tokens each)
NODE_GPUS = 8
NODE_CORES = 64  # CPU cores for Luigi's workers beside the GPUs (an 8-GPU node has 96 to 224)
GENERATION_TOKENS_PER_SECOND = 20_000  # per GPU: vLLM decoding a 4B model at large batch
TRAINING_FLOPS_PER_TOKEN = 8 * 4e9  # forward and backward (6N) and the metrics pass after the update (2N), N = 4e9
GPU_FLOPS = 989e12 * 0.4  # an H100's dense bfloat16 peak at 40 % utilisation
PARALLEL_STAGES = ("SampleRound", "ExecuteRound", "ScoreShard", "ShardDatums")  # tasks per shard: over the workers


FORK_PROBE = """
import os, sys, time
import pipeline.tasks
from bench.scale import settings_for
from retool.run.shared import protocol_for
protocol_for(settings_for(sys.argv[1], "fork", 64, 1).model)
times = []
for _ in range(21):
    started = time.perf_counter()
    child = os.fork()
    if child == 0:
        os._exit(0)
    times.append(time.perf_counter() - started)
    os.waitpid(child, 0)
print(sorted(times)[10])
"""


def fork_seconds(workdir: Path) -> float:
    """What a command's scheduling process pays to start a task's process with --workers > 1: one fork of itself
    (the pipeline imported and the tokenizer loaded, as when it schedules; median of 21), measured in a new one."""
    probe = subprocess.run(
        [sys.executable, "-c", FORK_PROBE, str(workdir)], cwd=REPO, capture_output=True, text=True, check=True
    )
    return float(probe.stdout.split()[-1])


def gpu_node_share(workdir: Path, steps: list[dict], single: list[dict], shards: int) -> list[tuple[str, str]]:
    """The pipeline's own time in the modelled GPU node's step, from the long step (a quarter of its trajectories):
    the single-task stages as measured with one worker, the rollout stages as measured in forked workers (two)
    spread over min(cores, shards) of them, each grown to the node's trajectories by its exponent (at least
    linearly); Luigi's own work outside the stages with one worker and a fork per task, in its one process.
    The rollout stages are counted twice over: by their tasks' wall time here, where two workers and the scheduling
    process share two cores, and by their CPU time, the time on a core of their own as a node's workers have."""
    long = [s for s in steps if s["turn_tokens"] != SHAPE_TURNS and s["scheduler"] == "local" and s["shards"] == shards]
    one, two = (next(s for s in long if s["workers"] == count) for count in (1, 2))
    growth = GPU_STEP_TRAJECTORIES / one["trajectories"]
    workers = min(NODE_CORES, two["shards"])
    serial, beside, parallel = 0.0, 0.0, {"seconds": 0.0, "cpu_seconds": 0.0}
    for name in STAGE_ORDER:
        points = [(s["tokens"], s["stages"][name]["seconds"]) for s in single if name in s["stages"]]
        power = growth ** max(1.0, exponent(points))
        if name in PARALLEL_STAGES:
            for clock in parallel:
                parallel[clock] += two["stages"][name][clock] * power / workers
        elif name == stage_meter.BESIDE_THE_UPDATE:
            beside += one["stages"][name]["seconds"] * power
        else:
            serial += one["stages"][name]["seconds"] * power
    fork = fork_seconds(workdir)
    scheduling = one["wall"] - one["in_stages"] + one["tasks"] * fork
    tokens, sampled_share = one["tokens"] * growth, one["sampled_tokens"] / one["tokens"]
    sampling = tokens * sampled_share / (NODE_GPUS * GENERATION_TOKENS_PER_SECOND)
    training = tokens * TRAINING_FLOPS_PER_TOKEN / (NODE_GPUS * GPU_FLOPS)
    serial += max(0.0, beside - training)  # only what outlasts the update delays the step
    own = {clock: serial + rollout + scheduling for clock, rollout in parallel.items()}
    share = {clock: time / (sampling + training + time) for clock, time in own.items()}
    return [
        (
            f"GPU node model, {shards} shards",
            f"{NODE_GPUS} GPUs, {NODE_CORES} cores; {GPU_STEP_TRAJECTORIES} trajectories, {tokens / 1e6:.0f} M tokens "
            f"({sampled_share:.0%} sampled): sampling {sampling:.0f} s at {GENERATION_TOKENS_PER_SECOND} tokens/s a "
            f"GPU, training {training:.0f} s at {GPU_FLOPS / 1e12:.0f} TFLOP/s a GPU",
        ),
        (
            "  pipeline's own time",
            f"{own['seconds']:.1f} s: single-task stages {serial:.1f} s (and the datums' join, {beside:.1f} s, beside "
            f"the update), rollout stages {parallel['seconds']:.1f} s "
            f"over {workers} workers ({parallel['cpu_seconds']:.1f} s by their CPU time), scheduling {scheduling:.1f} "
            f"s ({one['tasks']} tasks, a fork {fork * 1000:.1f} ms); x{growth:.0f} the long step's trajectories",
        ),
        (
            "  share of the step",
            f"{share['seconds']:.2%} of {sampling + training + own['seconds']:.0f} s; {share['cpu_seconds']:.2%} with "
            "the rollout stages by their CPU time (goal <= 2 %)",
        ),
    ]
