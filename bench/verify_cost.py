"""`python -m bench verify`: what checking a step costs beside making it. `bench scale`'s step at each size (the real
tasks and files, a scripted ReTool-shaped sampler), its pipeline time as that benchmark measures it, then
`python -m retool verify` of the step in a process of its own: wall seconds, peak resident memory, and how both grow
with the step's tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench import stage_meter
from bench.retool_shape import Shape
from bench.scale import exponent, measure_step, settings_for
from retool.run.shared import protocol_for

SIZES = ((1024, 16), (4096, 64), (8192, 64))  # (trajectories, shards): bench scale's three largest steps
# The child reports its own peak resident memory (ru_maxrss, KiB on Linux) after the command ends.
VERIFY = (
    "import resource, runpy, sys\n"
    "sys.argv = ['python -m retool', 'verify', sys.argv[1], '--out', sys.argv[2]]\n"
    "try:\n    runpy.run_module('retool', run_name='__main__')\n"
    "except SystemExit as end:\n    code = end.code\n"
    "print('peak_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, 'exit', code)\n"
)


def verify_step(run: Path, out: Path) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", VERIFY, str(run), str(out)], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    last = done.stdout.strip().splitlines()[-1].split()
    if done.returncode or last[3] != "0":
        raise RuntimeError(f"verify of {run} did not pass: {done.stdout[-3000:]}{done.stderr[-3000:]}")
    verdict = done.stdout.strip().splitlines()[-2]  # "...: every rule holds (S s); findings -> ..."
    checking = float(verdict.rsplit(" (", 1)[1].split(" s)")[0])
    lines = done.stdout.splitlines()[:-2]
    return {"seconds": seconds, "checking": checking, "peak_bytes": int(last[1]) * 1024, "lines": lines}


def bench_verify(workdir: Path, sizes=SIZES) -> list[tuple[str, str]]:
    import torch

    protocol_for(settings_for(workdir, "warm", 64, 1).model)  # the tokenizer, loaded before any clock starts
    rows = [("machine", f"{os.cpu_count()} cores, torch cpu capability {torch.backends.cpu.get_cpu_capability()}")]
    points, memory = [], []
    for trajectories, shards in sizes:
        with stage_meter.measuring():
            step = measure_step(workdir, trajectories, shards)
        run = workdir / f"scale-{trajectories}-{shards}-1-{Shape().turn_tokens}"
        checked = verify_step(run, workdir / f"verify-{trajectories}.parquet")
        tokens = step["tokens"]
        points.append((tokens, checked["checking"]))
        memory.append((tokens, checked["peak_bytes"]))
        rows.append(
            (
                f"{trajectories} trajectories, {shards} shards, {tokens / 1e6:.1f} M tokens",
                f"pipeline {step['wall']:.1f} s; verify {checked['seconds']:.1f} s, of which checking "
                f"{checked['checking']:.1f} s ({checked['checking'] / step['wall']:.2f} of the pipeline; the rest "
                f"starting Python and loading the tokenizer), peak {checked['peak_bytes'] / 1e9:.2f} GB",
            )
        )
        rows += [
            (f"  {trajectories}: {line.split(':')[0]}", line.split(":", 1)[1].strip()) for line in checked["lines"]
        ]
    if len(points) > 1:
        rows.append(
            ("growth", f"checking seconds ~ tokens^{exponent(points):.2f}, peak ~ tokens^{exponent(memory):.2f}")
        )
    return rows
