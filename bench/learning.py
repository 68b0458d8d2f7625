"""The learning benchmark: does the default run learn? (`python -m bench learning`)

The default CPU run (configs/cpu.cfg) with more RL steps and more evaluation samples: the base model, the
cold start (SFT) and SFT + RL on the held-out questions of data/synthetic_eval.jsonl, the questions of sft,
rl and held-out families apart, with the paired 95 % intervals; then the RL diagnostics of every step.
`--set trainer.learning_rate=1e-5` tries another recipe; `--reuse RUN` starts from the cold start and the
base and SFT evaluations of an earlier run with the same cold-start settings, so that recipes of the RL
stage are compared on the same SFT checkpoint (and `--against RUN` pairs the final policies question by
question).
"""

from __future__ import annotations

import json
import resource
import shutil
from pathlib import Path

from bench.benchmarks import REPO, default_run_settings, luigi_build

LEARNING_STEPS = 10  # RL steps of the learning benchmark
LEARNING_SAMPLES = 2  # evaluation samples per held-out question (all 332 of them)
FINAL_EVALUATIONS = "checkpoint=step*"  # an evaluation folder's RL policies: checkpoint=step0009 and so on


def parse_overrides(assignments: list[str]) -> dict[str, dict[str, str]]:
    """`section.name=value` assignments, by section."""
    sections: dict[str, dict[str, str]] = {}
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        section, _, name = key.partition(".")
        if not value or not name:
            raise SystemExit(f"--set {assignment!r}: expected section.name=value, e.g. trainer.learning_rate=1e-5")
        sections.setdefault(section, {})[name.replace("-", "_")] = value
    return sections


# Sections whose settings an evaluation runs under (its budgets, sampler, sandbox, prompt): where an override
# changes one, the reused cold start is evaluated again under it.
EVALUATION_SECTIONS = ("rollout", "sampler", "sandbox", "model")


def reuse_cold_start(earlier: Path, run: Path, evaluations: bool = True) -> None:
    """The cold start of `earlier` copied into `run`, with the evaluations of its base and SFT policies if
    `evaluations`."""
    if not (earlier / "sft" / "checkpoint" / "_SUCCESS").exists():
        raise SystemExit(f"--reuse {earlier}: no finished cold start there")
    shutil.copytree(earlier / "sft", run / "sft", dirs_exist_ok=True)
    for label in (
        ("base", "sft") if evaluations else ()
    ):  # under checkpoint=<label>, or step=<label> in runs made before
        for evaluation in [*earlier.glob(f"eval/*/*/checkpoint={label}"), *earlier.glob(f"eval/*/*/step={label}")]:
            copy = run / evaluation.parent.relative_to(earlier) / f"checkpoint={label}"
            shutil.copytree(evaluation, copy, dirs_exist_ok=True)


def bench_learning(
    workdir: Path,
    overrides: list[str] = (),
    steps: int = LEARNING_STEPS,
    samples: int = LEARNING_SAMPLES,
    reuse: Path | None = None,
    against: Path | None = None,
) -> list[tuple[str, str]]:
    from pipeline.evaluation import BeforeAfter, Evaluate
    from retool.evaluation.analysis import metrics_by_step
    from retool.evaluation.report import plot_learning_curve, save

    settings = default_run_settings()
    sections = _typed(settings, parse_overrides(list(overrides)))
    sections["run"] = {**sections.get("run", {}), "runs_dir": str(workdir), "name": "learning"}
    settings = settings.changed(**sections)
    if against is not None and not any(against.glob(f"eval/*/*/{FINAL_EVALUATIONS}/trajectories.parquet")):
        raise SystemExit(
            f"--against {against}: no evaluation of an RL step there (a learning run: <its --out>/learning)"
        )
    if reuse is not None:
        evaluated_alike = not set(EVALUATION_SECTIONS) & parse_overrides(list(overrides)).keys()
        reuse_cold_start(reuse, settings.run_dir, evaluations=evaluated_alike)
    wall = luigi_build(settings, BeforeAfter, step=steps - 1, n=samples)
    task = BeforeAfter(step=steps - 1, n=samples)
    metrics = metrics_by_step(settings.run_dir)
    if not overrides and reuse is None and (steps, samples) == (LEARNING_STEPS, LEARNING_SAMPLES):  # the docs' run
        save(plot_learning_curve(metrics), REPO / "docs" / "learning-curve.png")
    rows = [
        ("config", f"configs/cpu.cfg {' '.join(overrides)}, {steps} RL steps, Evaluate n={samples} on {task.dataset}"),
        ("run folder", str(settings.run_dir)),
        ("wall time", f"{wall:.0f} s" + (f" (cold start and base/SFT evaluations from {reuse})" if reuse else "")),
        ("peak resident memory", _peak_memory()),
    ]
    table = Path(task.output().path).read_text()
    group, policies = "", False  # the table's rows of one policy each, after its lead table of changes
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        policies = policies or cells[1:2] == ["policy"]
        if policies and len(cells) > 2 and cells[1] not in ("policy", "---"):
            group = cells[0] or group
            rows.append((f"  {group.split(' (')[0]}: {cells[1]}", " | ".join(cells[2:])))
        elif not policies and len(cells) > 2 and not cells[0].startswith(("questions", "---")):
            rows.append((f"  {cells[0]}: change", " | ".join(cells[1:])))
        elif "paired" in line:
            rows.append(("paired", line))
    rows += _stage_seconds(settings.run_dir)
    for row in metrics.iter_rows(named=True):
        rows.append((f"RL step {row['step']}", _step_line(row)))
    rows.append(("zero-variance groups, mean of the steps", f"{metrics['zero_variance_group_rate'].mean():.3f}"))
    if against is not None:
        final = Evaluate(step=steps - 1, n=samples).folder.path
        rows += _paired_against(final, final_evaluation(against, final.parent.relative_to(settings.run_dir)))
    return rows


def _peak_memory() -> str:
    """The largest resident set of this process (the trainer and the in-process engine) and of any child."""
    own, child = (resource.getrusage(who).ru_maxrss / 2**20 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return f"{own:.1f} GiB (this process), {child:.1f} GiB (its largest child process)"


def _typed(settings, sections: dict[str, dict[str, str]]) -> dict[str, dict]:
    """String values converted to the type of each field."""
    typed = {}
    for section, values in sections.items():
        config = getattr(settings, section)
        typed[section] = {}
        for name, value in values.items():
            current = getattr(config, name)
            convert = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(current, bool) else type(current)
            typed[section][name] = convert(value)
    return typed


def _step_line(row: dict) -> str:
    return (
        f"reward {row['reward_mean']:+.3f}, correct {row['correct']:.3f}, format {row['format']:.3f}, correct of "
        f"valid {row['valid_accuracy']:.3f}, groups kept {row['groups_kept']}/{row['groups_drawn']}, zero-variance "
        f"{row['zero_variance_group_rate']:.2f}, "
        f"{row['train_updates']} updates, entropy {row['train_entropy']:.3f}, KL k1 {row['train_kl_k1']:.1e} k3 "
        f"{row['train_kl_k3']:.1e}, clipped {row['train_clip_fraction']:.3f}, sampled tokens "
        f"{row['sampled_tokens_correct']:.0f}/{row['sampled_tokens_wrong']:.0f} (correct/wrong), sampler gap "
        f"{row['train_logprob_gap']:.1e}"
    )


def _stage_seconds(run: Path) -> list[tuple[str, str]]:
    """Wall time of each stage, summed over the run's steps and evaluations."""
    totals: dict[str, float] = {}
    for path in run.glob("**/_timings/*.json"):
        entry = json.loads(path.read_text())
        kind = "evaluation" if "/eval/" in str(path) else "sft" if "/sft/" in str(path) else "training step"
        key = f"{kind}: {entry['stage']}"
        totals[key] = totals.get(key, 0.0) + entry["seconds"]
    return [(f"seconds, {key}", f"{seconds:.0f}") for key, seconds in sorted(totals.items())]


def final_evaluation(run: Path, evaluation: Path) -> Path:
    """`run`'s final policy in the evaluation `evaluation` (a folder relative to a run folder): its newest RL step
    evaluated there, whatever number of steps that run took."""
    finished = sorted(path.parent for path in (run / evaluation).glob(f"{FINAL_EVALUATIONS}/trajectories.parquet"))
    if not finished:
        raise SystemExit(f"--against {run}: no RL step evaluated in {run / evaluation} (another evaluation set?)")
    return finished[-1]


def _paired_against(final: Path, other: Path) -> list[tuple[str, str]]:
    """This run's final policy against another run's on the same questions, each family role apart."""
    from jobs.before_after import training_sources
    from pipeline.config import current_settings
    from retool.evaluation.scores import paired_difference, question_groups
    from retool.files.layout import StepFolder
    from retool.files.tables import TRAJECTORIES, read_table

    ours, theirs = (read_table(StepFolder(folder).trajectories, TRAJECTORIES) for folder in (final, other))
    rows = []
    for group, part in question_groups(ours, *training_sources(current_settings())).items():
        mean, half_width, questions = paired_difference(theirs, part)
        rows.append((f"vs {other}: {group}", f"Average {mean:+.3f} ± {half_width:.3f} over {questions} questions"))
    return rows
