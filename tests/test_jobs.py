"""Each job reads only the files its task names in `requires()`: the Luigi graph is the data flow. Every stage of
a finished run (cold start, two RL steps over two shards, the before/after evaluations and the report) is run
again in a run folder that holds only its task's inputs, and writes what it wrote in the full run."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import CodeType

import luigi
import pyarrow.parquet as pq
import pytest

import retool.sampling.engines
from pipeline import BeforeAfter, Report, SampleRound, TrainStep
from retool.run.setup import open_run
from retool.weights.checkpoint import Checkpoint
from tests.conftest import REPO
from tests.pipeline_helpers import TRAIN, tool_policy

TIMED = ("exec_seconds", "seconds", "tokens_per_second")  # columns that measure time: they differ between runs


def graph(roots: list[luigi.Task]) -> list[luigi.Task]:
    """Every task the roots need, the roots included, each once."""
    seen, waiting = {}, list(roots)
    while waiting:
        task = waiting.pop()
        if task.task_id not in seen:
            seen[task.task_id] = task
            waiting += luigi.task.flatten(task.requires())
    return list(seen.values())


def copy_inputs(inputs: list[Path], source: Path, destination: Path) -> None:
    """Input files from one run folder to another; a checkpoint's marker brings its folder."""
    for path in inputs:
        if path.name == Checkpoint(path.parent).marker.name:
            path = path.parent
        into = destination / path.relative_to(source)
        into.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, into, dirs_exist_ok=True)
        else:
            shutil.copy2(path, into)


def without_timings(path: Path):
    table = pq.read_table(path)
    return table.drop_columns([c for c in table.column_names if any(t in c for t in TIMED)])


@pytest.mark.slow
def test_every_job_runs_with_only_the_files_its_task_requires(configure, monkeypatch, tmp_path):
    sections = dict(
        cold_start={"data": str(REPO / "data/synthetic_sft.jsonl"), "steps": 2, "batch_size": 2, "lora_rank": 0},
        trainer=TRAIN,
        rollout={"shards": 2},
    )
    settings = configure("graph", **sections)
    monkeypatch.setattr(
        retool.sampling.engines,
        "sampler_for",
        lambda settings, *_: tool_policy(settings),
    )
    roots = [BeforeAfter(step=1, n=1, limit=3), Report(step=1)]
    assert luigi.build(roots, local_scheduler=True, workers=1, log_level="WARNING")
    tasks = graph(roots)
    assert {type(t).__name__ for t in tasks} >= {"SampleRound", "TrainStep", "ColdStart", "Evaluate", "Report"}
    full = settings.run_dir
    inputs = {task.task_id: [Path(t.path) for t in luigi.task.flatten(task.input())] for task in tasks}
    for index, task in enumerate(tasks):
        alone = configure("graph", **sections, run={"runs_dir": str(tmp_path / f"alone-{index}")})
        copy_inputs(inputs[task.task_id], full, alone.run_dir)
        again = type(task).from_str_params(task.to_str_params())  # the same task, in the new run folder
        again.set_status_message = lambda message: None  # what a Luigi worker gives a task it runs
        open_run(again.settings)  # what a command does once, before Luigi schedules
        again.run()
        for target in luigi.task.flatten(again.output()):
            written = Path(target.path)
            assert written.exists(), f"{again.label()} did not write {written.relative_to(alone.run_dir)}"
            if written.suffix == ".parquet":
                original = full / written.relative_to(alone.run_dir)
                assert without_timings(written).equals(without_timings(original)), again.label()


def files_entered(run: Callable[[], None], until: Callable[[CodeType], bool]) -> list[str]:
    """The files of `pipeline/`, `jobs/` and `retool/` whose functions `run` enters before the first call that
    `until` accepts, in the order first entered (module bodies, run on first import, left out)."""
    files, reached = [], []

    def profile(frame, event, arg):
        code = frame.f_code
        if reached or event != "call" or code.co_name == "<module>":
            return
        if until(code):
            reached.append(code)
            return
        path = Path(code.co_filename)
        if path.is_relative_to(REPO) and path.relative_to(REPO).parts[0] in ("pipeline", "jobs", "retool"):
            name = str(path.relative_to(REPO))
            if name not in files:
                files.append(name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    assert reached, "the call was never reached"
    return files


def test_a_train_step_and_a_sample_round_reach_the_library_through_few_files(configure, monkeypatch, capsys):
    """From a task's run() to the call that does its work, every file whose code runs on the way: each is one more
    a reader follows (docs/layout.md, "Following a stage"). A bound each, so that the count cannot grow unseen;
    `pytest tests/test_jobs.py -k reach -s` prints them."""
    settings = configure("crossed", trainer=TRAIN)
    sampler = tool_policy(settings)
    monkeypatch.setattr(retool.sampling.engines, "sampler_for", lambda *_: sampler)
    monkeypatch.setattr(retool.sampling.engines, "_engines", {})  # as in a new process: no engine an earlier test left
    train, sample = TrainStep(step=0), SampleRound(step=0, round=0)
    assert luigi.build(train.requires()["datums"], local_scheduler=True, workers=1, log_level="WARNING")
    train.set_status_message = sample.set_status_message = lambda message: None
    to_optimizer = files_entered(train.run, lambda code: code.co_name == "step" and "torch/optim/" in code.co_filename)
    to_sampler = files_entered(sample.run, lambda code: code.co_filename.endswith("retool/sampling/scripted.py"))
    with capsys.disabled():
        print(f"\nTrainStep.run to optimizer.step, {len(to_optimizer)} files: {', '.join(to_optimizer)}")
        print(f"SampleRound.run to the sampler, {len(to_sampler)} files: {', '.join(to_sampler)}")
    # TrainStep: 21 since the trainer resumes by replay (resume.py) and stays in memory (resident.py); 22 since the
    # task resolves the checkpoint that sampled the step (config/rollout.py); 23 since a pass that runs out of memory
    # is re-planned (training/out_of_memory.py); 24 since where a step trains is the run layer's (run/placement.py),
    # which the trainer no longer reaches into the sampler to decide.
    assert len(to_optimizer) <= 24 and len(to_sampler) <= 15
