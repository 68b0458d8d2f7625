"""Each pipeline stage measured from inside the process that runs it (Luigi's events fire there, in forked workers
too): seconds (a scripted sampler's own apart), peak resident memory, bytes read and written; and the trainer's
planning of a step, measured the same way. For `python -m bench scale`."""

from __future__ import annotations

import json
import os
import resource
import time
from contextlib import contextmanager
from pathlib import Path

import luigi

from bench.retool_shape import PrintingSandbox
from retool.config.settings import RunSettings

LOG: Path | None = None  # where each finished stage appends its figures (a JSON line); None: not measuring
BESIDE_THE_UPDATE = "BuildDatums (beside the update)"  # the stage TrainStep runs while it trains: no update waits


def io_bytes() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["rchar"]), "written": int(fields["wchar"])}


def peak_bytes() -> int:
    """The process's peak resident memory since the last reset (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current resident memory


def _sampler_seconds(kind: str = "seconds") -> float:
    """Seconds (or CPU seconds: `kind` cpu_seconds) this process's scripted samplers have spent sampling: the
    sampler's, not the pipeline's."""
    from retool.sampling import engines

    return sum(getattr(engine, kind, 0.0) for engine in engines._engines.values())


def _started(task) -> None:
    if LOG is not None:
        reset_peak()
        task.scale_started = (
            time.time(), time.perf_counter(), time.process_time(), io_bytes(), _sampler_seconds(),
            _sampler_seconds("cpu_seconds"),
        )  # fmt: skip


def _finished(task) -> None:
    if LOG is None or not hasattr(task, "scale_started"):
        return
    wall, started, cpu, io, sampling, sampling_cpu = task.scale_started
    now = io_bytes()
    outputs = [Path(target.path) for target in luigi.task.flatten(task.output())]
    figures = {
        "stage": task.task_family,
        "started": wall,
        "seconds": time.perf_counter() - started - (_sampler_seconds() - sampling),  # the pipeline's own
        # CPU time of the task's process, every thread's (the seconds it takes on a core of its own, without waiting
        # for one), the sampler's apart
        "cpu_seconds": time.process_time() - cpu - (_sampler_seconds("cpu_seconds") - sampling_cpu),
        "sampler_seconds": _sampler_seconds() - sampling,
        "peak_bytes": peak_bytes(),
        "read_bytes": now["read"] - io["read"],
        "written_bytes": now["written"] - io["written"],
        "output_bytes": sum(path.stat().st_size for path in outputs if path.is_file()),
        "files": len(outputs),
        "pid": os.getpid(),
    }
    with LOG.open("a") as log:
        log.write(json.dumps(figures) + "\n")


_hooked = False  # the stage hooks are on the pipeline's tasks (idle while LOG is None)


@contextmanager
def measuring():
    """Stage hooks on every pipeline task, and the stand-in sandbox in place of the real one (forked workers keep
    both) while the bench's steps run; the real sandbox is back afterwards."""
    import jobs.execute_round
    from pipeline.tasks import RunTask

    global _hooked
    if not _hooked:
        RunTask.event_handler(luigi.Event.START)(_started)
        RunTask.event_handler(luigi.Event.SUCCESS)(_finished)
        _hooked = True
    real = jobs.execute_round.sandbox_for
    jobs.execute_round.sandbox_for = lambda config: PrintingSandbox()
    try:
        yield
    finally:
        jobs.execute_round.sandbox_for = real


IN_PROCESS_RUNS = 3  # a stage measured in this process runs this often; its median run is kept


def _run_once(stage: str, work) -> dict:
    """`work()`, measured in this process as a stage is."""
    reset_peak()
    io, started, cpu = io_bytes(), time.perf_counter(), time.process_time()
    figures = work()
    now = io_bytes()
    return {
        "stage": stage,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu,
        "peak_bytes": peak_bytes(),
        "read_bytes": now["read"] - io["read"],
        "written_bytes": now["written"] - io["written"],
        **figures,
    }


def _measured(stage: str, work) -> dict:
    """The median of IN_PROCESS_RUNS measured runs of `work()` (a run of a second or two on a shared machine sometimes
    spends half a second more in the kernel, with the same page faults)."""
    from retool.files.tables import forget_read_files

    runs = []
    for _ in range(IN_PROCESS_RUNS):
        forget_read_files()  # each run reads its files, as the stage's own process would
        runs.append(_run_once(stage, work))
    return sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]


def _shard_datums(settings: RunSettings) -> list[Path]:
    """Step 0's shards' datums files, which the update reads."""
    from retool.files.layout import RunFolder

    folder = RunFolder(settings.run_dir).step(0)
    return [folder.shard_datums(shard) for shard in range(settings.rollout.shards)]


def plan_training(settings: RunSettings) -> dict:
    """What the trainer does with the step's files before its first forward pass: reads the shards' datums, splits
    them into mini-batches and packs those into micro-batches with their loss weights."""
    from retool.training.packing import loss_token_weights, pack_micro_batches
    from retool.training.resume import read_datums
    from retool.training.step import mini_batches

    def plan() -> dict:
        config, datums = settings.trainer, read_datums(tuple(_shard_datums(settings)))
        batches = 0
        for members in mini_batches(len(datums), config.ppo_mini_batches):
            chosen = [datums[i] for i in members]
            items, tokens = config.micro_batch_items, config.micro_batch_tokens
            batches += len(pack_micro_batches([d.num_tokens for d in chosen], items, tokens))
            loss_token_weights([d.loss_tokens for d in chosen], config.loss_aggregation, len(datums))
        return {"output_bytes": 0, "files": 0, "micro_batches": batches}

    return _measured("TrainStep (plan only)", plan)


def join_datums(settings: RunSettings) -> dict:
    """The step's datums.parquet, the shards' joined, as TrainStep writes it while the update runs."""
    from retool.config.settings import training_stage
    from retool.files.layout import RunFolder
    from retool.run.joined_datums import join_step_datums

    def join() -> dict:
        folder = RunFolder(settings.run_dir).step(0)
        join_step_datums(_shard_datums(settings), folder.datums, training_stage(settings, 0), 0, folder.timings)
        return {"output_bytes": folder.datums.stat().st_size, "files": 1}

    return _measured(BESIDE_THE_UPDATE, join)
