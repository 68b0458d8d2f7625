"""`python -m bench async`: the wall time of a training step with its sampling in turn with training
([rollout] max_staleness = 0) against sampling a step ahead (1), side by side: six steps of the real trainer on
the default model, with a scripted sampler that waits 50 ms a sampled token, as a remote GPU engine would, so that
sampling uses none of the trainer's cores. Two Luigi workers in both runs."""

from __future__ import annotations

import time
from pathlib import Path

from bench.cluster import command, finished, free_port, write_config
from retool.evaluation.metrics import stage_timings
from retool.files.layout import RunFolder

STEPS = 6


def step_figures(run: RunFolder, steps: int) -> dict[str, float]:
    """From the stage timings: the mean seconds a step's rollout took before its training could start (measured
    at staleness 0, where nothing else runs then), its training's, and the wall time per step once the first
    step has trained (start-up apart)."""
    trained = [next(t for t in stage_timings(run.step(s).timings) if t["stage"] == "TrainStep") for s in range(steps)]
    rollouts = [(trained[s]["ended"] - trained[s]["seconds"]) - trained[s - 1]["ended"] for s in range(1, steps)]
    return {
        "rollout": sum(rollouts) / len(rollouts),
        "training": sum(t["seconds"] for t in trained[1:]) / (steps - 1),
        "per_step": (trained[-1]["ended"] - trained[0]["ended"]) / (steps - 1),
    }


def bench_async(workdir: Path) -> list[tuple[str, str]]:
    from retool.weights.models import build_default_model

    model = build_default_model()
    figures = {}
    for lag in (0, 1):
        folder = workdir / f"async-{lag}"
        folder.mkdir(parents=True, exist_ok=True)
        config = write_config(
            folder / "run.cfg", model, folder / "runs", "bench", free_port(), central=False,
            policy="paced_branching_tools", rollout={"max_staleness": str(lag)},
        )  # fmt: skip
        started = time.perf_counter()
        process = command(config, folder / "command", "TrainStep", "--step", str(STEPS - 1), "--workers", "2")
        code, _, errors = finished(process, seconds=3600)
        if code:
            raise RuntimeError(f"the run at max_staleness = {lag} failed:\n{errors[-3000:]}")
        wall = time.perf_counter() - started
        figures[lag] = {**step_figures(RunFolder(folder / "runs" / "bench"), STEPS), "wall": wall}
    rollout, training = figures[0]["rollout"], figures[0]["training"]
    rows = [
        ("rollout of a step (staleness 0)", f"{rollout:.1f} s"),
        ("training of a step (staleness 0)", f"{training:.1f} s"),
        ("sum / max of the two", f"{rollout + training:.1f} s / {max(rollout, training):.1f} s"),
    ]
    for lag in (0, 1):
        per_step = figures[lag]["per_step"]
        rows.append(
            (
                f"max_staleness = {lag}: seconds per step",
                f"{per_step:.1f} s ({per_step / max(rollout, training):.2f}x the max, "
                f"{per_step / (rollout + training):.2f}x the sum; {STEPS} steps in {figures[lag]['wall']:.0f} s)",
            )
        )
    rows.append(("staleness 1 / 0", f"{figures[1]['per_step'] / figures[0]['per_step']:.2f} of the time per step"))
    return rows
