"""The learning benchmark: does the default run learn? (`python -m bench learning`)"""

from __future__ import annotations

from pathlib import Path

from bench.benchmarks import REPO, default_run_settings, luigi_build

LEARNING_STEPS = 8  # RL steps of the learning benchmark
LEARNING_SAMPLES = 4  # evaluation samples per held-out question


def bench_learning(workdir: Path) -> list[tuple[str, str]]:
    """The default CPU run (configs/cpu.cfg) with more RL steps: base vs cold start (SFT) vs SFT+RL on
    the held-out questions of data/synthetic_eval.jsonl, and the RL curve; the curve is also drawn to
    docs/learning-curve.png."""
    from jobs.analysis import metrics_by_step
    from jobs.report import plot_learning_curve, save
    from pipeline.tasks import BeforeAfter

    settings = default_run_settings().changed(run={"runs_dir": str(workdir), "name": "learning"})
    wall = luigi_build(settings, BeforeAfter, step=LEARNING_STEPS - 1, n=LEARNING_SAMPLES)
    task = BeforeAfter(step=LEARNING_STEPS - 1, n=LEARNING_SAMPLES)
    metrics = metrics_by_step(settings.run_dir)
    save(plot_learning_curve(metrics), REPO / "docs" / "learning-curve.png")
    rows = [
        ("config", f"configs/cpu.cfg, {LEARNING_STEPS} RL steps, Evaluate n={LEARNING_SAMPLES} on {task.dataset}"),
        ("wall time", f"{wall:.0f} s"),
    ]
    rows += [
        (f"  {line.split('|')[1].strip()}", "|".join(line.split("|")[2:-1]).strip())
        for line in Path(task.output().path).read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| policy")
    ]
    rows += [("paired", line) for line in Path(task.output().path).read_text().splitlines() if "paired" in line]
    for row in metrics.iter_rows(named=True):
        rows.append(
            (
                f"RL step {row['step']}",
                f"reward {row['reward_mean']:+.3f}, correct {row['correct']:.3f}, degenerate groups "
                f"{row['degenerate_group_rate']:.2f}, update {'skipped' if row['train_skipped'] else 'made'}, "
                f"sampler gap {row['train_logprob_gap']:.1e}",
            )
        )
    return rows
