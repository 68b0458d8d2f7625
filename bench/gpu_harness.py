"""What the two GPU checks (bench.gpu, the trainer's; bench.gpu_vllm, the sampler's) share: the options every check
takes (--deadline-seconds, --dry-run, --fail-phase), the runner that isolates each phase (a failure recorded, its
memory freed, the next phase run), the random datums and recipes they train on, and the buckets of positions by
which they report differences."""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from retool.config.settings import RunSettings
from retool.config.trainer import TrainerConfig
from retool.rollout.datums import Datum

POSITION_BUCKETS = (0, 16, 64, 256, 1024)  # differences by position: [0, 16), [16, 64), ..., [1024, end)


class NotRunHere(Exception):
    """A phase that cannot run on this machine: its reason is recorded under "not_run" (not a failure)."""


def position_buckets() -> Iterator[tuple[str, int, int | None]]:
    """Each bucket of POSITION_BUCKETS: its name ("16-64", "1024-end"), its first position and its end (None: to
    the last position)."""
    for start, end in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:] + (None,), strict=True):
        yield f"{start}-{end or 'end'}", start, end


def random_datums(count: int, tokens: int, vocab: int, seed: int = 0) -> list[Datum]:
    """Datums of `tokens` tokens whose second half is sampled (loss tokens), with mixed advantages."""
    rng = random.Random(seed)
    datums = []
    for index in range(count):
        ids = [rng.randrange(vocab) for _ in range(tokens + 1)]
        mask = [position >= tokens // 2 for position in range(tokens)]
        advantage = 1.0 if index % 2 else -1.0
        datums.append(
            Datum(0, index, ids[:-1], ids[1:], [-2.0 if m else 0.0 for m in mask], [advantage * m for m in mask], mask)
        )
    return datums


def recipe(trainer: TrainerConfig, device: str) -> TrainerConfig:
    """`trainer` with every `auto` resolved for `device` as a run's settings resolve it."""
    return RunSettings().changed(run={"device": device}).on_device(trainer)


def synchronize(device: str) -> None:
    """Waits for the device's queued work, so that a timing measures it."""
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """What a finished (or failed) phase held, freed before the next one starts."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def add_phase_options(parser: argparse.ArgumentParser, dry_run: str) -> None:
    """The options both checks take: a deadline, a dry run (`dry_run` says what it runs) and phases made to fail."""
    parser.add_argument("--deadline-seconds", type=float, default=480.0, help="start no phase after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help=dry_run)
    parser.add_argument(
        "--fail-phase", action="append", default=[], metavar="NAME",
        help="a check of the check itself: phase NAME raises at its start; it is recorded as failed, the others "
        "still run, and the exit status is 1 (may be given more than once)",
    )  # fmt: skip


def run_checked(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    phases: dict[str, Callable[[], dict]],
    figures: dict,
    started: float,
    device: str,
    scratch: Path,
) -> bool:
    """The phases run as add_phase_options' options say (the deadline counted from `started`, time.monotonic),
    after refusing a --fail-phase that names no phase (exit status 2). Whether none failed."""
    unknown = sorted(set(args.fail_phase) - set(phases))
    if unknown:
        parser.error(f"--fail-phase {', '.join(unknown)}: no such phase (phases: {', '.join(phases)})")
    return run_phases(phases, figures, args.out, started + args.deadline_seconds, device, args.fail_phase, scratch)


def run_phases(
    phases: dict[str, Callable[[], dict]],
    figures: dict,
    out: Path,
    deadline: float,
    device: str,
    fail: Sequence[str] = (),
    scratch: Path | None = None,
) -> bool:
    """Each phase's figures and seconds into `figures`, written to `out` after every phase (what is measured
    survives a later failure). A phase that raises is recorded under "failed" and the next one runs; one that
    raises NotRunHere is named under "not_run" with its reason; one that would start past `deadline`
    (time.monotonic) is named under "skipped"; one named in `fail` raises at its start. With `scratch`, each
    phase's folder there (scratch / name) is made before it and removed after it. Whether none failed."""
    for key, empty in (("skipped", []), ("failed", {}), ("not_run", {})):
        figures.setdefault(key, empty)
    for name, phase in phases.items():
        if time.monotonic() > deadline:
            figures["skipped"].append(name)
        else:
            if scratch is not None:
                (scratch / name).mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            _run_isolated(name, phase, figures, name in fail)
            figures[name + "_seconds"] = round(time.monotonic() - started, 1)
            free_memory(device)  # once _run_isolated has returned: its traceback and its frames' tensors are gone
            if scratch is not None:
                shutil.rmtree(scratch / name, ignore_errors=True)
        out.write_text(json.dumps(figures, indent=2) + "\n")
    return not figures["failed"]


def _run_isolated(name: str, phase: Callable[[], dict], figures: dict, fail: bool) -> None:
    """The phase's figures under its name, or its error under "failed", or its reason under "not_run"."""
    try:
        if fail:
            raise RuntimeError(f"made to fail by --fail-phase {name}")
        figures[name] = phase()
    except NotRunHere as reason:
        figures["not_run"][name] = str(reason)
    except Exception as error:
        figures["failed"][name] = {
            "error": f"{type(error).__name__}: {error}"[:2000],
            "traceback": traceback.format_exc().splitlines()[-12:],
        }


def report(figures: dict) -> int:
    """The figures printed; the exit status: 1 when a phase failed."""
    print(json.dumps(figures, indent=2))
    return 1 if figures["failed"] else 0
